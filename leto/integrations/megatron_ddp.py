"""Megatron-Core's ``DistributedDataParallel`` over Leto's retained gradient regions.

Megatron's DDP (megatron-core 0.16.1, ``distributed/param_and_grad_buffer.py``) keeps every
gradient in one contiguous buffer per (param dtype, grad dtype) group: ``grad_data``,
allocated by ``_ParamAndGradBuffer.__init__`` with ``torch.zeros(numel, dtype=grad_dtype,
device=torch.cuda.current_device())``, and each parameter's ``main_grad`` is a view of it.
Its backward hooks add each ``.grad`` into ``main_grad`` (then drop ``.grad``), and the
buckets of the buffer are all-reduced over the data-parallel group — in ``finish_grad_sync``,
or launched from the hooks as soon as a bucket is complete (``overlap_grad_reduce``).

Here those buffers are retained regions ("ddp.grads.<dtype>"), protected by the two-tier
parity like Leto's own "grads" and read by the resumable updater:

1. **Plan.** ``grad_placement`` computes where Megatron will put each gradient from shapes
   alone (Megatron's rule without the distributed optimizer: per dtype group in
   ``named_parameters`` order, parameters reversed, back to back, no padding; the dense
   parameters' buffers first, then the expert parameters' (``allreduce=False``) in
   buffers of their own, "ddp.grads.expert.<dtype>", which Megatron reduces over the
   expert-data-parallel group), so the regions exist before the model does (a shadow
   plans them from its ``meta`` model).
2. **Allocation.** After ``ctx.retain`` has bound the parameters to retained memory, the
   ``DistributedDataParallel`` constructor runs inside ``GradBufferAllocation``, a
   ``TorchFunctionMode`` that answers exactly the buffers' ``torch.zeros(numel, dtype=...)``
   calls with the retained regions (not zeroed: a reattaching trainer may need its final
   gradients to finish an update). Everything else passes through. Then every
   ``main_grad`` is checked to be the planned view (``RetainedState.check_main_grads``):
   a Megatron release that lays the buffer out differently fails loudly, never silently.
   DDP is built after ``retain`` because ``retain`` swaps the parameters' tensors, which
   would orphan the gradient-accumulator hooks DDP registers.
3. **Step.** ``ctx.grad_sync`` gets ``reduce=ddp.finish_grad_sync`` (before clipping and
   ``GRADS_READY``) and ``zero=ddp.zero_grad_buffer`` (at the start of a step);
   ``RetainedState`` points ``.grad`` at ``main_grad`` for clipping and the update.

The distributed optimizer (``param_data`` and sharded state) is
``leto.integrations.megatron_distopt``. Not supported (refused): ``main_grad`` dtypes other than the
parameter's (``grad_reduce_in_fp32`` with non-fp32 parameters: torch's AdamW would mix them).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from leto.errors import ConfigError, ProtocolError
from leto.retained.layout import GradPlacement

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from leto.trainer.context import Context
    from leto.trainer.state import RetainedState

logger = logging.getLogger(__name__)

REGION_PREFIX = "ddp.grads."


def check_ddp_config(ddp_config: DistributedDataParallelConfig, *, sharded: bool = False) -> None:
    """Refuse what this integration does not retain (one-line ``ConfigError``s).
    ``sharded``: the distributed optimizer's path (``leto.integrations.megatron_distopt``)."""
    unsupported = {
        "use_distributed_optimizer": "Megatron's DistributedOptimizer buffers are planned by "
        "leto.integrations.megatron_distopt (lm.retain_megatron does this)",
        "use_megatron_fsdp": "Megatron FSDP shards parameters outside leto's layout",
        "use_custom_fsdp": "Megatron FSDP shards parameters outside leto's layout",
        "nccl_ub": "NCCL user buffers allocate the gradient buffer from their own pool",
        "reuse_grad_buf_for_mxfp8_param_ag": "MXFP8 parameters are not supported",
    }
    if sharded:
        del unsupported["use_distributed_optimizer"]
    for key, why in unsupported.items():
        if getattr(ddp_config, key, False):
            raise ConfigError(f"DistributedDataParallelConfig.{key}=True: {why}")


def region_name(param_dtype: torch.dtype, grad_dtype: torch.dtype, *, expert: bool = False) -> str:
    """The retained region of a (param dtype, grad dtype) buffer, e.g. ``ddp.grads.float32``,
    or ``ddp.grads.expert.float32`` for expert parameters."""
    p, g = str(param_dtype).removeprefix("torch."), str(grad_dtype).removeprefix("torch.")
    return REGION_PREFIX + ("expert." if expert else "") + (p if p == g else f"{p}.{g}")


def grad_placement(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    ddp_config: DistributedDataParallelConfig,
) -> GradPlacement:
    """Where Megatron's DDP puts each gradient of ``params`` (the optimizer's order), from
    shapes alone: works on a ``meta`` model. Mirrors ``_ParamAndGradBuffer.__init__``
    without the distributed optimizer (no padding, so bucket boundaries move nothing)."""
    check_ddp_config(ddp_config)
    groups: dict[tuple[bool, torch.dtype, torch.dtype], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else p.dtype
        if grad_dtype != p.dtype:
            raise ConfigError(
                f"parameter {name}: main_grad {grad_dtype} != param {p.dtype}; leto's AdamW reads "
                "main_grad as the gradient: use fp32 params (leto retains them as main params)"
            )
        groups.setdefault((not getattr(p, "allreduce", True), p.dtype, grad_dtype), []).append(p)
    regions, where = [], {}
    ordered = sorted(
        groups.items(), key=lambda item: item[0][0]
    )  # stable: dense buffers, then experts'
    for index, ((expert, param_dtype, grad_dtype), members) in enumerate(ordered):
        itemsize = torch.empty((), dtype=grad_dtype).element_size()
        start = 0
        for p in reversed(members):  # Megatron's order: roughly the order of backward
            where[id(p)] = (index, start * itemsize)
            start += p.numel()
        regions.append((region_name(param_dtype, grad_dtype, expert=expert), start * itemsize))
    missing = [tuple(p.shape) for p in params if id(p) not in where]
    if missing:
        raise ConfigError(
            f"{len(missing)} optimizer parameters are not trainable parameters of the model "
            f"(first shape {missing[0]})"
        )
    return GradPlacement(regions=tuple(regions), slots=tuple(where[id(p)] for p in params))


class GradBufferAllocation(TorchFunctionMode):
    """Answers Megatron's gradient-buffer ``torch.zeros(numel, dtype=...)`` calls, in order,
    with views of retained regions; every other call passes through."""

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        super().__init__()
        self.pending = list(buffers)
        self.answered = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and self.pending and self._is_next(args, kwargs):
            self.answered += 1
            return self.pending.pop(0)
        return func(*args, **kwargs)

    def _is_next(self, args: tuple, kwargs: dict) -> bool:
        want = self.pending[0]
        size = args[0] if len(args) == 1 else kwargs.get("size", args)
        numel = size if isinstance(size, int) else (size[0] if len(size) == 1 else None)
        return numel == want.numel() and kwargs.get("dtype") == want.dtype


def ddp_on_buffers(
    model: torch.nn.Module,
    ddp_config: DistributedDataParallelConfig,
    buffers: list[torch.Tensor],
    *,
    what: str,
) -> DistributedDataParallel:
    """Megatron's ``DistributedDataParallel`` whose buffer ``torch.zeros`` calls are answered,
    in order, by ``buffers`` (``GradBufferAllocation``); ``ProtocolError`` if one is left over."""
    from megatron.core.distributed import DistributedDataParallel

    allocation = GradBufferAllocation(buffers)
    with allocation:
        ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    if allocation.pending:
        raise ProtocolError(
            f"Megatron's DDP allocated {allocation.answered} of {len(buffers)} planned {what} "
            "from leto's regions; this megatron-core lays them out differently"
        )
    return ddp


def build_ddp(
    ctx: Context,
    state: RetainedState,
    model: torch.nn.Module,
    ddp_config: DistributedDataParallelConfig,
) -> DistributedDataParallel:
    """Megatron's ``DistributedDataParallel`` around ``model`` (already retained), its
    gradient buffers the retained regions; ``ctx.grad_sync`` then reduces and zeroes them."""
    import dataclasses

    layout = state.layout
    if not layout.main_grad or not all(
        name.startswith(REGION_PREFIX) for name, _ in layout.grad_regions
    ):
        raise ProtocolError("build_ddp needs a state retained with grads=grad_placement(...)")
    buffers = []
    for name, nbytes in layout.grad_regions:
        dtype = next(
            s.dtype for s, r in zip(layout.grads, layout.grad_region, strict=True) if r == name
        )
        buffers.append(state.grad_regions[name][:nbytes].view(dtype))
    t0 = time.perf_counter()
    ddp = ddp_on_buffers(model, ddp_config, buffers, what="gradient buffers")
    state.check_main_grads()
    ctx.grad_sync = dataclasses.replace(
        ctx.grad_sync,
        reduce=ddp.finish_grad_sync,
        zero=ddp.zero_grad_buffer,
        collectives_in_backward=ddp_config.overlap_grad_reduce,
    )
    logger.info(
        "[rank %d] Megatron DDP on retained gradient regions %s (%d buckets, overlap %s) in %.1f ms",
        ctx.rank,
        [name for name, _ in layout.grad_regions],
        sum(len(g.buckets) for g in ddp.bucket_groups),
        ddp_config.overlap_grad_reduce,
        (time.perf_counter() - t0) * 1e3,
    )
    return ddp
