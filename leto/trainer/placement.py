"""Where a rank's retained state goes: the plan, then the mapped regions.

``plan`` reads the model and optimizer only (a shadow plans from its meta model): which
tensors are retained, FSDP2's shards among them, the ``Layout`` of the regions, and the
settings that cannot go together. ``Context.retain`` plans first, adopts FSDP2's gradient
sync when the plan found shards, then hands the plan to ``RetainedState``.

``map_regions`` allocates or reattaches every region of the plan (state, gradients, mirrors,
marker, the updater's buffers, parity) and builds the updater over them. Mapping never
creates what a successor should find and never reads the data, so a shadow maps ahead.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from leto.contract import ROLE_ACTIVE
from leto.erasure import padded_bytes
from leto.erasure.protection import ProtectedRegion
from leto.errors import ConfigError, ScriptError
from leto.pool.pagemap import plan_chunk_bytes
from leto.retained.layout import GradPlacement, Layout
from leto.retained.marker import MARKER_BYTES, Marker
from leto.retained.optim_state import StateSlots
from leto.retained.presence import GradPresence
from leto.trainer.buffers import refuse_buffer_updates
from leto.trainer.env import TrainerEnv
from leto.trainer.grad_sync import GradSync
from leto.trainer.memory import RegionMemory
from leto.trainer.rng import rng_blob
from leto.trainer.services import TrainerServices
from leto.trainer.sharding import FsdpShards, has_dtensor_params
from leto.updater.base import Updater
from leto.updater.fused import resolve_fused
from leto.updater.rmu import PARITY, UNDO, ResumableUpdater
from leto.updater.snapshot import SNAPSHOT, SnapshotUpdater

logger = logging.getLogger(__name__)

ENV_RMU_PARITY = "LETO_RMU_PARITY"
"""Test hook: "0" turns off the RMU's incremental parity (the paper's "RMP alone")."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What one rank retains and how its regions are laid out."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    """The optimizer's parameters, in its groups' order (the layout's order)."""
    buffers: list[torch.Tensor]
    """The module's buffers."""
    frozen: list[torch.nn.Parameter]
    """The model's parameters outside the optimizer (``Layout.frozen``)."""
    device: torch.device
    """Where the retained regions live: the parameters' device, or the rank's for a meta model."""
    shards: FsdpShards | None
    """FSDP2's shards among the parameters (``leto.trainer.sharding``), or None."""
    layout: Layout


def refuse_wrappers(model: torch.nn.Module) -> None:
    """A model wrapped for torch's data parallelism is refused with what to pass instead:
    the wrapper holds its parameters (they cannot become views of retained memory) and its
    buckets would hold the gradients; ``state.step()`` all-reduces them itself."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise ConfigError(
            "ctx.retain() got a DistributedDataParallel: do not wrap the model (the wrapper "
            "holds its parameters and buckets its gradients); pass the model itself, "
            "state.step() all-reduces the gradients"
        )
    if isinstance(model, FullyShardedDataParallel):
        raise ConfigError(
            "ctx.retain() got a FullyShardedDataParallel (FSDP1), which leto does not retain: "
            "shard the model with torch.distributed.fsdp.fully_shard (FSDP2) instead"
        )


def refuse_sparse_gradients(model: torch.nn.Module) -> None:
    """An embedding built with ``sparse=True`` is refused: its sparse gradients cannot land
    in the retained (dense) gradient memory, and a dense update of its rows is not the one
    torch's sparse-aware optimizers make."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            raise ConfigError(
                f"ctx.retain(): module {name or 'the model'!r} is an "
                f"{type(module).__name__}(sparse=True), whose sparse gradients leto's retained "
                "gradients (dense) cannot hold: build it with sparse=False"
            )


def refuse_uninitialized(model: torch.nn.Module) -> None:
    """A lazy module's parameter not yet materialised (``nn.LazyLinear`` before its first
    forward) is refused: it has no shape to retain yet."""
    from torch.nn.parameter import is_lazy

    for name, p in model.named_parameters():
        if is_lazy(p):
            raise ConfigError(
                f"ctx.retain(): parameter {name} is uninitialised (a lazy module's): run one "
                "forward pass before ctx.retain(), as before building an optimizer over it"
            )


def note_trainable_outside(
    model: torch.nn.Module, frozen: list[torch.nn.Parameter], rank: int
) -> None:
    """Say which parameters outside the optimizer still require a gradient: autograd
    computes it every step, but leto neither averages it over the ranks nor counts it in
    ``step(max_grad_norm=...)``'s norm, which a torch loop's
    ``clip_grad_norm_(model.parameters())`` would (so its clipping would differ)."""
    outside = {id(p) for p in frozen}
    _name_parameters(
        [n for n, p in model.named_parameters() if id(p) in outside and p.requires_grad],
        rank,
        "outside the optimizer require a gradient ({}): their gradients are computed but "
        "never averaged, clipped with or applied; freeze them with requires_grad_(False), or "
        "give them to the optimizer",
    )


def note_strided(model: torch.nn.Module, rank: int) -> None:
    """Say which parameters are not contiguous (``channels_last`` convolutions, a transposed
    weight): they are retained contiguous, so their kernels may differ from torch's in the
    last bits and, on a GPU, in speed (a ``channels_last`` convolution's weight no longer is)."""
    _name_parameters(
        [n for n, p in model.named_parameters() if p.numel() > 1 and not p.is_contiguous()],
        rank,
        "are retained contiguous, not in their own memory layout ({})",
    )


def _name_parameters(names: list[str], rank: int, what: str) -> None:
    """One warning naming the first few of ``names``, if any (``what`` has a ``{}`` for them)."""
    if names:
        listed = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        logger.warning("[rank %d] %d parameter(s) %s", rank, len(names), what.format(listed))


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
    refuse_wrappers(model)
    refuse_sparse_gradients(model)
    refuse_uninitialized(model)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len({id(p) for p in params}) != len(params):
        raise ScriptError("a parameter appears twice in the optimizer's parameter groups")
    buffers = list(model.buffers())
    device = device if params[0].is_meta else params[0].device
    # a sharded optimizer holds shards: the full parameters are its mirror regions
    frozen = [] if mirror else outside_optimizer(model, params)
    if env.role == ROLE_ACTIVE:  # said once: a shadow plans the same model
        note_trainable_outside(model, frozen, env.rank)
        note_strided(model, env.rank)
    shards = None
    retained: list[torch.Tensor] = [*params, *frozen]
    if has_dtensor_params(params):  # the frozen ones' shards follow the optimizer's
        shards = FsdpShards.find(model, optimizer, retained, world_size)
        if grads is not None or mirror or grad_sync != GradSync():
            raise ConfigError(
                "fully_shard reduces its own gradients: no integration's gradient buffers, "
                "full-parameter mirror or ctx.grad_sync with it"
            )
        retained = shards.stand_ins(retained)
    layout = Layout.plan(
        retained[: len(params)],
        buffers,
        optimizer,
        rng_bytes=rng_blob(device).numel(),
        grads=grads,
        mirror=mirror,
        sharding="" if shards is None else shards.description([*params, *frozen]),
        frozen=tuple(retained[len(params) :]),
    )
    if env.erasure is not None:
        refuse_buffer_updates(model)
    if mirror and env.consistency != "rmu":
        raise ConfigError(
            "a sharded optimizer (Megatron's distributed optimizer) needs consistency: rmu; "
            "the snapshot path steps torch's optimizer over full parameters"
        )
    return Plan(model, optimizer, params, buffers, frozen, device, shards, layout)


def outside_optimizer(
    model: torch.nn.Module, params: list[torch.nn.Parameter]
) -> list[torch.nn.Parameter]:
    """The model's parameters the optimizer does not hold (frozen ones: a fine-tuning job's
    base model under its adapters), once each, in the model's order."""
    held = {id(p) for p in params}
    return [p for p in model.parameters() if id(p) not in held]


@dataclass(frozen=True, slots=True)
class Regions:
    """One rank's retained regions, mapped, and the updater that works in them."""

    memory: RegionMemory
    state: torch.Tensor
    """The "state" region: parameters, buffers, optimizer state, RNG (``Layout``)."""
    grads: dict[str, torch.Tensor]
    """Gradient regions by name (Leto's "grads", or an integration's buffers)."""
    mirrors: dict[str, torch.Tensor]
    """Full parameter buffers of a sharded optimizer, by name (``Layout.mirror_regions``)."""
    marker: Marker
    rng_next: torch.Tensor
    """The RNG state after a step's compute, saved before GRADS_READY for a finishing rank."""
    protected: dict[str, ProtectedRegion]
    """The erasure-protected regions by name ("state" and the gradients); empty without
    ``leto.erasure``."""
    presence: GradPresence | None
    """Which parameters the step's update skips (``Layout.grad_present``); None where an
    integration placed the gradients."""
    updater: Updater


def map_regions(plan: Plan, services: TrainerServices, slots: Callable[[], StateSlots]) -> Regions:
    """Allocate or reattach every region of ``plan`` on this rank (and its parity regions).
    ``slots``: the optimizer state's slots once bound (the snapshot updater steps them)."""
    pool, rank, env, layout = services.pool, services.rank, services.env, plan.layout
    erasure = env.erasure
    state_nbytes = layout.state_bytes
    grad_nbytes = dict(layout.grad_regions)
    if erasure is not None:  # protected regions are whole pages
        state_nbytes = padded_bytes(state_nbytes, erasure)
        grad_nbytes = {name: padded_bytes(n, erasure) for name, n in grad_nbytes.items()}
    mem = RegionMemory(pool, rank, plan.device)
    chunk = None  # unprotected regions: one chunk (nothing could rebuild a lost one)
    if erasure is not None:  # one chunk per erasure page, unless the fd budget says coarser
        chunk = plan_chunk_bytes(
            state_nbytes + sum(grad_nbytes.values()),
            erasure.page_bytes,
            mem.granularity,
            mem.chunk_budget(),
        )
    views = {
        "state": mem.device_region("state", state_nbytes, chunk)[0],
        **{name: mem.device_region(name, n, chunk)[0] for name, n in grad_nbytes.items()},
        **{name: mem.device_region(name, n)[0] for name, n in layout.mirror_regions},
        "marker": mem.host_region("marker", MARKER_BYTES)[0],
        "rng_next": mem.host_region("rng_next", layout.rng.nbytes)[0],
    }
    # the updater's own buffers: rmu's undo and working parity, or the host snapshot
    fused = False
    if env.consistency == "rmu":
        fused = resolve_fused(env.rmu_fused, plan.device, layout)
        buffers = ResumableUpdater.buffers(
            layout, state_nbytes, env.rmu_chunk_bytes, erasure, fused=fused
        )
    else:
        buffers = SnapshotUpdater.buffers(state_nbytes)
    for buf in buffers:
        region = mem.host_region if buf.host else mem.device_region
        views[buf.name] = region(buf.name, buf.nbytes)[0]
    marker_words = mem.mapped_on_device(views["marker"])
    marker = Marker(
        views["marker"], None if marker_words is None else marker_words.view(torch.int64)
    )
    protected = (
        {}
        if erasure is None
        else {
            name: ProtectedRegion(
                pool, rank, name, views[name], erasure, functools.partial(mem.lost_pages, name)
            )
            for name in ("state", *grad_nbytes)
        }
    )
    grads = {name: views[name] for name in grad_nbytes}
    presence = (
        None
        if layout.grad_present is None
        else GradPresence(layout.grad_present.view(grads["grads"]))
    )
    updater: Updater
    if env.consistency == "rmu":
        updater = ResumableUpdater(
            layout=layout,
            state=views["state"],
            grads=grads,
            rng_next=views["rng_next"],
            optimizer=plan.optimizer,
            marker=marker,
            undo=views[UNDO],
            parity=views.get(PARITY),
            protected=protected.get("state"),
            injector=services.injector,
            chunk_bytes=env.rmu_chunk_bytes,
            incremental_parity=os.environ.get(ENV_RMU_PARITY, "1") != "0",
            fused=fused,
            presence=presence,
        )
    else:
        updater = SnapshotUpdater(
            layout=layout,
            state=views["state"],
            snapshot=views[SNAPSHOT],
            rng_next=views["rng_next"],
            optimizer=plan.optimizer,
            slots=slots,
            marker=marker,
            protected=protected.get("state"),
            injector=services.injector,
            fence=mem.fence,
            presence=presence,
        )
    return Regions(
        memory=mem,
        state=views["state"],
        grads=grads,
        mirrors={name: views[name][:n] for name, n in layout.mirror_regions},
        marker=marker,
        rng_next=views["rng_next"],
        protected=protected,
        presence=presence,
        updater=updater,
    )
