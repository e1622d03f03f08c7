"""Where a rank's retained state goes: the plan, decided before any memory is mapped.

``plan`` reads the model and optimizer only (a shadow plans from its meta model): which
tensors are retained, FSDP2's shards among them, the ``Layout`` of the regions, and the
settings that cannot go together. ``Context.retain`` plans first, adopts FSDP2's gradient
sync when the plan found shards, then hands the plan to ``RetainedState``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from leto.errors import ConfigError, ProtocolError
from leto.retained.layout import GradPlacement, Layout
from leto.trainer.buffers import refuse_buffer_updates
from leto.trainer.env import TrainerEnv
from leto.trainer.grad_sync import GradSync
from leto.trainer.rng import rng_blob
from leto.trainer.sharding import FsdpShards, has_dtensor_params


@dataclass(frozen=True, slots=True)
class Plan:
    """What one rank retains and how its regions are laid out."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    """The optimizer's parameters, in its groups' order (the layout's order)."""
    buffers: list[torch.Tensor]
    """The module's buffers."""
    device: torch.device
    """Where the retained regions live: the parameters' device, or the rank's for a meta model."""
    shards: FsdpShards | None
    """FSDP2's shards among the parameters (``leto.trainer.sharding``), or None."""
    layout: Layout


def plan(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    env: TrainerEnv,
    device: torch.device,
    world_size: int,
    grad_sync: GradSync,
    grads: GradPlacement | None = None,
    mirror: tuple[tuple[str, int], ...] = (),
) -> Plan:
    """The plan of ``model`` and ``optimizer`` on a rank computing on ``device``;
    ``grad_sync``: the context's, before the plan (an integration may have set it).
    ``grads`` and ``mirror``: as ``RetainedState`` describes them. Raises ``ConfigError``
    for settings that cannot go together."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len({id(p) for p in params}) != len(params):
        raise ProtocolError("a parameter appears twice in the optimizer's groups")
    buffers = list(model.buffers())
    device = device if params[0].is_meta else params[0].device
    shards = None
    if has_dtensor_params(params):
        shards = FsdpShards.find(model, optimizer, params, world_size)
        if grads is not None or mirror or grad_sync != GradSync():
            raise ConfigError(
                "fully_shard reduces its own gradients: no integration's gradient buffers, "
                "full-parameter mirror or ctx.grad_sync with it"
            )
    layout = Layout.plan(
        params if shards is None else shards.stand_ins(params),
        buffers,
        optimizer,
        rng_bytes=rng_blob(device).numel(),
        grads=grads,
        mirror=mirror,
        sharding="" if shards is None else shards.description(params),
    )
    if env.erasure is not None:
        refuse_buffer_updates(model)
    if mirror and env.consistency != "rmu":
        raise ConfigError(
            "a sharded optimizer (Megatron's distributed optimizer) needs consistency: rmu; "
            "the snapshot path steps torch's optimizer over full parameters"
        )
    return Plan(model, optimizer, params, buffers, device, shards, layout)
