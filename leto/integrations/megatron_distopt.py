"""Megatron-Core's distributed optimizer on Leto's retained state (ZeRO-1 over the DP group).

What megatron-core 0.16.1 does with ``DistributedDataParallelConfig(use_distributed_optimizer=True)``:
``_ParamAndGradBuffer`` lays every (param dtype, grad dtype) group out as one padded buffer
(each parameter's start padded to 64 elements, each bucket's end to ``lcm(dp, 128)``),
allocates ``param_data`` and ``grad_data`` of that size, makes every ``param.data`` a view of
``param_data`` and every ``main_grad`` a view of ``grad_data``; ``finish_grad_sync``
reduce-scatters each bucket (scaled by ``1/dp``), so DP rank ``r`` holds the reduced
gradients of shard ``r`` of every bucket (``shard_buffer``). The ``DistributedOptimizer``
then owns exactly those shards (``_build_model_gbuf_range_map``: per parameter, the part of
it inside the rank's shard), keeps fp32 main params and Adam moments for them only, and
after its step all-gathers the updated shards into ``param_data`` (``start_param_sync``).

Here:

* **Retained state = the rank's shard.** ``plan_shards`` computes Megatron's padded layout
  and the rank's shard ranges from shapes alone (a shadow plans from its ``meta`` model).
  Each range becomes one fp32 *main param* (a 1-D ``nn.Parameter``, Megatron's
  ``shard_main_param``) of a torch ``AdamW`` with the job's groups (``shard_optimizer``);
  ``ctx.retain`` lays out those main params, their ``exp_avg``/``exp_avg_sq`` and step
  counters in the protected "state" region, so the optimizer state is ``1/dp`` of the
  model's, and the RMU updates only the shard, chunk by chunk, with the two-tier parity.
  Each main param's gradient is its range of ``ddp.grads.<dtype>`` (a retained, protected
  region, as without the distributed optimizer), where the reduce-scatter leaves it.
* **Full parameters = ``ddp.params.<dtype>``**, Megatron's ``param_data`` as a retained
  but unprotected region (``Layout.mirror_regions``): every byte of it is a copy of some
  rank's committed main params, so nothing needs parity. ``build_ddp`` answers Megatron's
  two ``torch.zeros`` per buffer with the two regions (``megatron_ddp.ddp_on_buffers``; a
  reattaching trainer's ``meta`` parameters are first placed over ``param_data``), then
  checks Megatron's own ``param_index_map``, bucket boundaries and
  ``DistributedOptimizer._build_gbuf_range_map`` against the plan (``ProtocolError`` if a
  release lays them out differently).
* **The all-gather belongs to the update** (``GradSync.gather``): after the RMU commits
  step t (IDLE(t+1)), each rank copies its main params into its shard of ``param_data`` and
  runs Megatron's per-bucket-group ``start_param_sync``. It reads only committed shards and
  writes only the mirror, so a kill inside it is repaired by running it again: every rank
  gathers once at resume, after the resume protocol has finished step t's update wherever
  any rank began it. A promoted trainer therefore never trusts ``param_data`` (lost chunks
  of it are simply replaced).
* **Clipping** (``clip_grads_sharded``): Megatron's distributed-optimizer rule: each
  rank's squared norm of its main-param gradients (not shared, not TP duplicates),
  summed over every rank, the root; the same ``max_norm / (norm + 1e-6)`` coefficient.

Tensor parallelism works unchanged (each TP rank's buffer sharded over its DP group).
Refused: ``overlap_param_gather`` (its forward pre-hooks gather in the next step's compute
phase), expert parallelism (expert buffers shard over another group), pipeline parallelism
and ``leto.checkpoint`` (``lm.retain_megatron``), several distributed-optimizer instances,
and ``consistency: snapshot`` (``RetainedState``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from leto.errors import ConfigError, ProtocolError
from leto.integrations.megatron_ddp import check_ddp_config, ddp_on_buffers, region_name
from leto.retained.layout import GradPlacement
from leto.trainer.rebind import rebind

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from leto.trainer.context import Context
    from leto.trainer.state import RetainedState

logger = logging.getLogger(__name__)

PARAM_REGION_PREFIX = "ddp.params."


@dataclasses.dataclass(frozen=True, slots=True)
class ShardPiece:
    """The part of one parameter inside this rank's shard of its bucket."""

    param: int
    """Index into the full optimizer's parameters."""
    buffer: int
    """Index into ``ShardPlan.buffers``."""
    lo: int
    """First element of the parameter (flattened) in the shard."""
    hi: int
    """One past the last."""
    start: int
    """Element offset of element ``lo`` in the buffer."""

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclasses.dataclass(frozen=True, slots=True)
class BufferPlan:
    """One of Megatron's padded (param dtype, grad dtype) buffers."""

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    numel: int
    """Elements, padding included (a multiple of the DP size)."""
    buckets: tuple[tuple[int, int], ...]
    """``_ParamAndGradBuffer.bucket_indices``: (start, end) element ranges, padded."""
    index: dict[int, tuple[int, int, int]]
    """``param_index_map`` by optimizer parameter index: (start, end, bucket)."""

    @property
    def grad_region(self) -> str:
        return region_name(self.param_dtype, self.grad_dtype)

    @property
    def param_region(self) -> str:
        return PARAM_REGION_PREFIX + str(self.param_dtype).removeprefix("torch.")

    def itemsize(self, dtype: torch.dtype) -> int:
        return torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True, slots=True)
class ShardPlan:
    """Megatron's distributed-optimizer layout for one DP rank."""

    dp_rank: int
    dp_size: int
    buffers: tuple[BufferPlan, ...]
    pieces: tuple[ShardPiece, ...]
    """In the full optimizer's parameter order; at most one per parameter."""

    @property
    def grad_placement(self) -> GradPlacement:
        """Each main param's gradient: its range of the buffer's ``grad_data``."""
        regions = tuple((b.grad_region, b.numel * b.itemsize(b.grad_dtype)) for b in self.buffers)
        slots = tuple(
            (p.buffer, p.start * self.buffers[p.buffer].itemsize(self.buffers[p.buffer].grad_dtype))
            for p in self.pieces
        )
        return GradPlacement(regions=regions, slots=slots)

    @property
    def mirror(self) -> tuple[tuple[str, int], ...]:
        """(name, bytes) of the full parameter buffers (Megatron's ``param_data``)."""
        return tuple((b.param_region, b.numel * b.itemsize(b.param_dtype)) for b in self.buffers)

    def shard_numel(self) -> int:
        """Elements of optimizer state per moment on this rank (no padding)."""
        return sum(p.numel for p in self.pieces)


def check_sharded_config(ddp_config: DistributedDataParallelConfig) -> None:
    """What this integration supports of Megatron's distributed optimizer (one-line errors)."""
    if not ddp_config.use_distributed_optimizer:
        raise ConfigError(
            "megatron_distopt needs DistributedDataParallelConfig(use_distributed_optimizer=True)"
        )
    check_ddp_config(ddp_config, sharded=True)
    if ddp_config.overlap_param_gather:
        raise ConfigError(
            "overlap_param_gather=True: the parameter all-gather would run in the next forward; "
            "leto runs it as part of the update (docs/MEGATRON.md)"
        )
    if ddp_config.num_distributed_optimizer_instances != 1:
        raise ConfigError(
            "num_distributed_optimizer_instances > 1 (partial distributed optimizer) is not supported"
        )


def _bucket_size(ddp_config: DistributedDataParallelConfig, dp_size: int) -> int | None:
    """``DistributedDataParallel.__init__``'s bucket size (None: one bucket)."""
    from megatron.core import parallel_state

    if not ddp_config.overlap_grad_reduce or parallel_state.get_pipeline_model_parallel_rank() > 0:
        return None
    return ddp_config.bucket_size or max(40000000, 1000000 * dp_size)


def plan_shards(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    ddp_config: DistributedDataParallelConfig,
    *,
    dp_rank: int,
    dp_size: int,
) -> ShardPlan:
    """Megatron's padded buffer layout and this DP rank's shard ranges, from shapes alone.

    Mirrors ``_ParamAndGradBuffer.__init__`` with the distributed optimizer (reverse
    parameter order, 64-element parameter starts, bucket ends padded to ``lcm(dp, 128)``,
    the shared embedding in a bucket of its own) and
    ``DistributedOptimizer._build_model_gbuf_param_range_map`` (contiguous equal shards
    of each bucket). ``build_ddp`` checks the result against Megatron's own maps."""
    check_sharded_config(ddp_config)
    position = {id(p): i for i, p in enumerate(params)}
    groups: dict[tuple[torch.dtype, torch.dtype], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not getattr(p, "allreduce", True):
            raise ConfigError(
                f"parameter {name} is an expert parameter: the distributed optimizer is not "
                "integrated with expert parallelism"
            )
        grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else p.dtype
        if grad_dtype != p.dtype:
            raise ConfigError(
                f"parameter {name}: main_grad {grad_dtype} != param {p.dtype}; use fp32 params"
            )
        if id(p) not in position:
            raise ConfigError(f"parameter {name} is trainable but not in the optimizer")
        groups.setdefault((p.dtype, grad_dtype), []).append(p)
    bucket_size = _bucket_size(ddp_config, dp_size)
    divisor = math.lcm(
        dp_size, 128, *((2**16,) if ddp_config.pad_buckets_for_high_nccl_busbw else ())
    )
    buffers, pieces = [], []
    for (param_dtype, grad_dtype), members in groups.items():
        buckets, index = _layout(members, position, bucket_size, divisor)
        b = len(buffers)
        buffers.append(
            BufferPlan(
                param_dtype=param_dtype,
                grad_dtype=grad_dtype,
                numel=buckets[-1][1],
                buckets=tuple(buckets),
                index=index,
            )
        )
        for i, (start, end, bucket) in index.items():
            lo_b, hi_b = buckets[bucket]
            shard = (hi_b - lo_b) // dp_size
            own_lo, own_hi = lo_b + dp_rank * shard, lo_b + (dp_rank + 1) * shard
            lo, hi = max(start, own_lo), min(end, own_hi)
            if hi > lo:
                pieces.append(ShardPiece(param=i, buffer=b, lo=lo - start, hi=hi - start, start=lo))
    pieces.sort(key=lambda p: p.param)
    if not pieces:
        raise ConfigError(
            f"DP rank {dp_rank} owns no parameter elements (a model this small needs DP < {dp_size})"
        )
    return ShardPlan(dp_rank=dp_rank, dp_size=dp_size, buffers=tuple(buffers), pieces=tuple(pieces))


def _layout(
    members: list[torch.nn.Parameter],
    position: dict[int, int],
    bucket_size: int | None,
    divisor: int,
) -> tuple[list[tuple[int, int]], dict[int, tuple[int, int, int]]]:
    """Bucket (start, end) ranges and each parameter's (start, end, bucket), Megatron's loop."""

    def pad(n: int, d: int) -> int:
        return -(-n // d) * d

    buckets: list[tuple[int, int]] = []
    index: dict[int, tuple[int, int, int]] = {}
    start = bucket_start = 0
    in_bucket = 0
    end = 0

    def close(at: int) -> int:
        nonlocal bucket_start, in_bucket
        buckets.append((bucket_start, pad(at, divisor)))
        bucket_start, in_bucket = buckets[-1][1], 0
        return bucket_start

    for p in reversed(members):  # roughly the order of backward
        start = pad(start, 64)
        shared = bool(getattr(p, "shared_embedding", False))
        if shared and in_bucket:
            start = close(start)
        end = start + p.numel()
        index[position[id(p)]] = (start, end, len(buckets))
        in_bucket += 1
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            start = close(end)
        else:
            start = end
    if in_bucket:
        close(end)
    return buckets, index


def main_params(params: list[torch.nn.Parameter], plan: ShardPlan) -> list[torch.nn.Parameter]:
    """One fp32 main param per shard piece (Megatron's ``shard_main_param``): a copy of the
    piece's elements (on ``meta`` when the model is)."""
    mains = []
    for piece in plan.pieces:
        p = params[piece.param]
        mains.append(
            torch.nn.Parameter(
                p.detach().reshape(-1)[piece.lo : piece.hi].clone(), requires_grad=p.requires_grad
            )
        )
    return mains


def shard_optimizer(
    optimizer: torch.optim.AdamW, mains: list[torch.nn.Parameter], plan: ShardPlan
) -> torch.optim.AdamW:
    """A torch ``AdamW`` over the main params with ``optimizer``'s groups and settings (a
    group this rank owns nothing of stays, empty, so group indices and lrs line up)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
    members: list[list[torch.nn.Parameter]] = [[] for _ in optimizer.param_groups]
    for piece, main in zip(plan.pieces, mains, strict=True):
        members[group_of[id(params[piece.param])]].append(main)
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": m}
        for g, m in zip(optimizer.param_groups, members, strict=True)
    ]
    return torch.optim.AdamW(groups, lr=optimizer.defaults["lr"], foreach=True)


def place_meta_params(
    model_params: list[torch.nn.Parameter], plan: ShardPlan, mirror: dict[str, torch.Tensor]
) -> None:
    """A reattaching trainer's ``meta`` parameters become tensors over their planned places
    in ``param_data`` (sharing the region's storage, not views of it: Megatron asserts
    ``param.data._base is None`` before it re-points ``.data`` there and copies the old
    values, here onto themselves). Nothing is allocated; the values are whatever the region
    holds until the gather at resume. Megatron's attributes are kept."""
    for b in plan.buffers:
        region = mirror[b.param_region].view(b.param_dtype)
        for i, (start, _, _) in b.index.items():
            p = model_params[i]
            if not p.is_meta:
                continue
            data = torch.empty(0, dtype=b.param_dtype, device=region.device).set_(
                region.untyped_storage(), region.storage_offset() + start, p.shape
            )
            attrs = dict(vars(p))
            rebind(p, torch.nn.Parameter(data, requires_grad=p.requires_grad))
            for key, value in attrs.items():
                setattr(p, key, value)


@dataclasses.dataclass(slots=True)
class ShardedUpdate:
    """The state of one rank's distributed optimizer: its main params, their places in the
    full parameter buffers, and the all-gather."""

    ctx: Context
    ddp: Any
    mains: list[torch.nn.Parameter]
    shards: list[torch.Tensor]
    """Each main param's range of ``param_data`` (where it is copied before the all-gather)."""
    pads: list[torch.Tensor]
    """Padding inside this rank's shards of ``param_data`` (zeroed before the all-gather)."""
    mirror: list[torch.Tensor]

    def gather(self) -> None:
        """Main params → this rank's shards of ``param_data``; Megatron's all-gather of every
        bucket group (``start_param_sync``, synchronous). A pure function of the committed
        main params of every rank."""
        for pad in self.pads:
            pad.zero_()
        if self.mains:
            torch._foreach_copy_(self.shards, [m.detach() for m in self.mains])
        for i, group in enumerate(self.ddp.bucket_groups):
            group.start_param_sync(force_sync=True)
            if i == 0:
                self.ctx.injector.point("update", at="gather", on_fire=self._scribble)

    def _scribble(self) -> None:
        """What a gather killed midway may leave: any bytes in ``param_data``."""
        gen = torch.Generator().manual_seed(13)
        for region in self.mirror:
            flat = region.view(torch.uint8)
            flat.copy_(
                torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=gen).to(
                    flat.device
                )
            )


def clip_grads_sharded(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Megatron's distributed-optimizer clipping over the main params' gradients; returns
    the global norm. Squares of the counted shards (``param_is_not_shared``,
    ``param_is_not_tensor_parallel_duplicate``: the attributes are copied onto the main
    params) summed over every rank (each element of the model is in exactly one rank's
    shard, counted once), then the root; coefficient ``max_norm / (norm + 1e-6)`` when < 1."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    grads = [p.grad for p in params if p.grad is not None]
    counted = [
        p.grad
        for p in params
        if p.grad is not None
        and param_is_not_shared(p)
        and param_is_not_tensor_parallel_duplicate(p)
    ]
    if counted:
        squares = torch.stack([n.float() for n in torch._foreach_norm(counted)]).square().sum()
    else:
        squares = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    dist.all_reduce(squares)
    norm = squares.sqrt()
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def build_ddp(
    ctx: Context,
    state: RetainedState,
    model: torch.nn.Module,
    ddp_config: DistributedDataParallelConfig,
    plan: ShardPlan,
    model_params: list[torch.nn.Parameter],
) -> DistributedDataParallel:
    """Megatron's ``DistributedDataParallel`` with ``param_data``/``grad_data`` in the
    retained regions, checked against the plan; sets ``ctx.grad_sync`` (reduce-scatter,
    zeroing, sharded clipping, the all-gather)."""
    pending = []
    for b in plan.buffers:
        pending.append(state.mirror_regions[b.param_region].view(b.param_dtype))
        pending.append(
            state.grad_regions[b.grad_region][: b.numel * b.itemsize(b.grad_dtype)].view(
                b.grad_dtype
            )
        )
    t0 = time.perf_counter()
    place_meta_params(model_params, plan, state.mirror_regions)
    ddp = ddp_on_buffers(model, ddp_config, pending, what="parameter and gradient buffers")
    check_against_megatron(ddp, plan, model_params)
    grads = state.grad_views()
    for main, grad in zip(state.params, grads, strict=True):
        main.main_grad = grad
    state.check_main_grads()
    shards, pads, mirror = [], [], []
    for bi, (b, buffer) in enumerate(zip(plan.buffers, ddp.buffers, strict=True)):
        data = buffer.param_data
        mirror.append(data)
        owned = sorted((p.start, p.start + p.numel) for p in plan.pieces if p.buffer == bi)
        for lo_b, hi_b in b.buckets:
            shard = (hi_b - lo_b) // plan.dp_size
            cur, end = lo_b + plan.dp_rank * shard, lo_b + (plan.dp_rank + 1) * shard
            for lo, hi in owned:
                if lo >= cur and hi <= end:
                    if lo > cur:
                        pads.append(data[cur:lo])
                    cur = hi
            if cur < end:
                pads.append(data[cur:end])
    for piece in plan.pieces:
        shards.append(ddp.buffers[piece.buffer].param_data[piece.start : piece.start + piece.numel])
    update = ShardedUpdate(
        ctx=ctx, ddp=ddp, mains=list(state.params), shards=shards, pads=pads, mirror=mirror
    )
    ctx.grad_sync = dataclasses.replace(
        ctx.grad_sync,
        reduce=ddp.finish_grad_sync,
        zero=ddp.zero_grad_buffer,
        clip=clip_grads_sharded,
        gather=update.gather,
        collectives_in_backward=ddp_config.overlap_grad_reduce,
    )
    logger.info(
        "[rank %d] Megatron distributed optimizer: DP rank %d of %d owns %d of %d elements, %d buckets, "
        "built in %.1f ms",
        ctx.rank,
        plan.dp_rank,
        plan.dp_size,
        plan.shard_numel(),
        sum(b.numel for b in plan.buffers),
        sum(len(b.buckets) for b in plan.buffers),
        (time.perf_counter() - t0) * 1e3,
    )
    return ddp


def check_against_megatron(
    ddp: DistributedDataParallel, plan: ShardPlan, params: list[torch.nn.Parameter]
) -> None:
    """Megatron's own buffers and ``DistributedOptimizer`` range maps equal the plan."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if len(ddp.buffers) != len(plan.buffers) or ddp.expert_parallel_buffers:
        raise ProtocolError(
            f"Megatron built {len(ddp.buffers)} buffers, leto planned {len(plan.buffers)}"
        )
    position = {id(p): i for i, p in enumerate(params)}
    for bi, (buffer, b) in enumerate(zip(ddp.buffers, plan.buffers, strict=True)):
        index = {position[id(p)]: tuple(v) for p, v in buffer.param_index_map.items()}
        if (
            buffer.numel != b.numel
            or [tuple(r) for r in buffer.bucket_indices] != list(b.buckets)
            or index != b.index
        ):
            raise ProtocolError(
                f"Megatron's buffer {bi} ({buffer.numel} elements, {len(buffer.bucket_indices)} buckets) "
                f"differs from leto's plan ({b.numel}, {len(b.buckets)}): this megatron-core pads "
                "or buckets differently"
            )
        (ranges,) = DistributedOptimizer._build_gbuf_range_map(buffer).values()
        theirs = sorted(
            (position[id(p)], r["param"].start, r["param"].end, r["gbuf_world"].start)
            for bucket in ranges
            for p, r in bucket["param_map"].items()
        )
        ours = sorted((p.param, p.lo, p.hi, p.start) for p in plan.pieces if p.buffer == bi)
        if theirs != ours:
            raise ProtocolError(
                f"Megatron's DistributedOptimizer shards buffer {bi} differently from leto's plan "
                f"({len(theirs)} vs {len(ours)} ranges)"
            )
