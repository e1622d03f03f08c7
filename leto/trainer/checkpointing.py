"""A trainer's retained state as a ``leto.checkpoint.Checkpointer``'s named tensors.

The checkpointer saves and loads any named tensors; what they are for a ``RetainedState``
(its DCP keys, and what must follow a load) is the trainer's knowledge, kept here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from leto.checkpoint import Checkpointer

if TYPE_CHECKING:
    from leto.config import CheckpointConfig
    from leto.trainer.state import RetainedState


def named_views(state: RetainedState) -> dict[str, torch.Tensor]:
    """The retained state as DCP keys → views of retained memory (no copy)."""
    region = state.state_region
    rank = state.services.rank
    pnames = {id(p): n for n, p in state.model.named_parameters(remove_duplicate=False)}
    bnames = {id(b): n for n, b in state.model.named_buffers(remove_duplicate=False)}
    views: dict[str, torch.Tensor] = {}
    for i, (p, pslot, oslots) in enumerate(
        zip(state.params, state.layout.params, state.layout.optim, strict=True)
    ):
        # a parameter the optimizer holds outside the model (a learned temperature, say) is
        # named by its place in the optimizer's order, the same in every process of the job
        name = pnames.get(id(p), f"<optimizer param {i}>")
        views[f"model.{name}"] = state.seen(i, pslot.view(region))  # an FSDP2 shard: its DTensor
        for key, slot in oslots.items():
            views[f"optim.{name}.{key}"] = state.seen(i, slot.view(region))
    for j, (f, slot) in enumerate(zip(state.frozen, state.layout.frozen, strict=True)):
        views[f"model.{pnames[id(f)]}"] = state.seen(len(state.params) + j, slot.view(region))
    for b, slot in zip(state.buffers, state.layout.buffers, strict=True):
        views[f"buffer.rank{rank}.{bnames[id(b)]}"] = slot.view(region)
    views[f"rng.rank{rank}"] = state.layout.rng.view(region)
    views[f"extras.rank{rank}"] = state.extras.store.region
    return views


def checkpointer_for(config: CheckpointConfig, state: RetainedState) -> Checkpointer:
    """The checkpointer of a trainer's retained state (``Context.retain``)."""
    services = state.services

    def loaded(step: int) -> None:
        state.encode("state")  # the RMU updates parity incrementally: it must match the load
        state.marker.initialise(state.layout.digest, step=step)
        state.allow_uneven_counts()
        state.extras.reload()  # steps() restores the objects from the loaded records
        if services.env.digest:
            state.emit_digest()

    return Checkpointer(
        config,
        named_views(state),
        rank=services.rank,
        group=dist.new_group(backend="gloo"),
        events=services.events,
        generation=services.env.generation,
        restart_count=services.env.restart_count,
        collective_device=services.collective_device,
        on_loaded=loaded,
    )
