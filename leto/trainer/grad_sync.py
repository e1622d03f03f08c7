"""How a rank's gradients are synchronised and clipped before the update.

The default is plain data parallelism: a mean all-reduce over the whole world and
``torch.nn.utils.clip_grad_norm_``. A model-parallel integration (Megatron's tensor
parallelism, ``leto.integrations.megatron``) sets ``Context.grad_sync`` before ``retain``:
the all-reduce then spans its data-parallel group only, and clipping takes the global norm
over the model-parallel shards (each parameter counted once). Both run in the compute phase,
before ``GRADS_READY``, so the update — the RMU's chunks included — applies gradients that
are already reduced and clipped, and a finishing rank reads them from retained memory.

An integration whose own buffers hold the gradients (Megatron's ``DistributedDataParallel``,
its buffers placed in retained regions by ``Layout``'s ``GradPlacement``) also sets
``reduce`` (its bucketed all-reduce, e.g. ``finish_grad_sync``) and ``zero`` (its
``zero_grad_buffer``), which replace Leto's flat all-reduce and the zeroing of "grads".
With a sharded optimizer (Megatron's distributed optimizer) ``reduce`` reduce-scatters, each
rank updates only its shard, and ``gather`` all-gathers the updated shards into every rank's
full parameter buffer after the update commits, and again at every resume.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

ClipFn = Callable[[list[torch.nn.Parameter], float], torch.Tensor]
"""Clips the parameters' ``.grad`` in place to a global norm; returns the norm before clipping."""


@dataclass(kw_only=True, slots=True)
class GradSync:
    """The gradient synchronisation seam of ``RetainedState.step``."""

    group: dist.ProcessGroup | None = None
    """Group of the gradient mean all-reduce: the data-parallel group. None: the whole world."""
    clip: ClipFn | None = None
    """Global-norm clipping. None: ``torch.nn.utils.clip_grad_norm_`` (every parameter local)."""
    reduce: Callable[[], None] | None = None
    """The integration's gradient reduction over its buffers (replaces the mean all-reduce)."""
    zero: Callable[[], None] | None = None
    """Zeroes the integration's gradient buffers at the start of a step (replaces Leto's zeroing)."""
    gather: Callable[[], None] | None = None
    """After each committed update, and at every resume on every rank: rebuild the full
    parameters from the committed shards (the distributed optimizer's all-gather). It must
    be a pure function of retained state, so a kill inside it is repaired by running it again."""
    collectives_in_backward: bool = False
    """Backward launches collectives (bucketed all-reduces overlapping it): a rank cannot
    re-run its backward alone, so an out-of-memory error there is not retried."""

    @property
    def from_integration(self) -> bool:
        """An integration set its own group, reduction or overlapped backward: its model's
        forward may run collectives too."""
        return self.group is not None or self.reduce is not None or self.collectives_in_backward

    def size(self) -> int:
        """Ranks that average their gradients (1: nothing to reduce)."""
        return dist.get_world_size(self.group)

    def all_reduce_mean_(self, tensor: torch.Tensor) -> None:
        """Average ``tensor`` in place over the group."""
        size = self.size()
        if size == 1:
            return
        dist.all_reduce(tensor, group=self.group)
        tensor.div_(size)

    def clip_coef(
        self, params: list[torch.nn.Parameter], max_norm: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The total norm and the factor ``clip_`` would multiply every gradient by (float32
        device scalars, torch's ``clip_grad_norm_`` norm and coefficient, bit for bit),
        without applying it; None where an integration clips (its rule may not be a single
        factor)."""
        if self.clip is not None:
            return None
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, 2.0, False, foreach=True)
        return total, torch.clamp(max_norm / (total + 1e-6), max=1.0)

    def clip_(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the gradients of ``params`` in place to ``max_norm``; returns the total norm."""
        if self.clip is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return self.clip(params, max_norm)


def norm_order(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[int]:
    """Indices of ``params`` in the order ``model.parameters()`` yields them (any not in the
    model after, as given): the order in which a script's ``clip_grad_norm_(model.parameters())``
    stacks the per-parameter norms. The optimizer's groups may order them otherwise (decay,
    then no decay), and the total norm's last bits depend on that order."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    return sorted(range(len(params)), key=lambda i: position.get(id(params[i]), len(position) + i))
