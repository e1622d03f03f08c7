"""Kernel warm-up: a level-3 shadow compiles and loads its Triton kernels before any failure.

Without it, a promoted trainer pays for Triton at first use: its first rebuild of lost
pages in a process costs several times a later one (BENCHMARKS.md, "Device-page
localisation on GPU"), and a resumed fused update pays the first launch of its AdamW
kernel. Triton caches a compiled kernel per *specialisation*: its constexprs,
``num_warps``, the dtype of every pointer and the width (i32 / i64) of every integer,
whether each pointer and each specialised integer is divisible by 16, and whether such an
integer equals 1. So the warm-up launches exactly the specialisations the real calls will
launch, by running the same code paths on scratch memory:

* ``gf16_mac`` and ``gf16_syndrome`` (parity): tiny replicas of this trainer's protection groups (the job's D,
  H1, H2 and group sizes, one 2 KiB tile per page) go through the public
  :class:`~leto.erasure.ProtectionGroup` calls the trainer makes: ``encode_all``,
  ``rebuild`` for every count of lost data and tier-1 pages (counts choose the tuning
  bucket, the output count and the alignment of the offset tables), ``rebuild`` of a
  working-parity (syndrome) group, the load's ``syndromes_of``, ``update_pages`` in and
  out of place for one run length per tuning bucket, and the flush's ``parity_of`` and
  device-side ``encode_tier2_of``. Page size changes no key (strides and column
  counts stay multiples of 16).
* ``adamw_rmu`` (fused update): ``triton_kernels.adamw_rmu.warm_up`` with the alignment
  of every chunk of this trainer's plan, at both widths of the flag token.
* ``rmu_update``: the update's torch kernels, which CUDA loads lazily at first launch, by a
  miniature of the trainer's update (``leto.preinit.rehearsal``).

Scratch memory only: retained regions are never read or written. A new kernel is one
entry in :data:`WARMERS` (``register("name")(fn)``, ``fn(target) -> calls``).

Runs at shadow level 3 only, on CUDA. On CPU it is a no-op (the trainer's page arithmetic
is PyTorch's: nothing to compile), except under the test hook :data:`ENV_CPU` with
``TRITON_INTERPRET=1``, where the same code paths run in Triton's interpreter.
``preinit.warm_kernels: false`` turns it off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from leto.erasure import ErasureConfig, ProtectionGroup, padded_bytes, plan_groups
from leto.erasure.bitslice import TILE_BYTES
from leto.events import Kind
from leto.preinit.rehearsal import UpdateRehearsal

if TYPE_CHECKING:
    from leto.preinit.site import ShadowSite
    from leto.retained.layout import Layout

logger = logging.getLogger(__name__)

ENV_CPU = "LETO_WARM_KERNELS_CPU"
"""Test hook: "1" (with ``TRITON_INTERPRET=1``) runs the warm-up of a CPU shadow in Triton's
interpreter, so its code paths run in CPU tests; a CPU trainer itself never launches them."""

Warmer = Callable[["WarmupTarget"], int]
"""Warms one kernel for a target; returns how many calls it made (0: nothing to warm)."""

WARMERS: dict[str, Warmer] = {}
"""Every kernel the shadow warms, by name, in registration order."""


def register(name: str) -> Callable[[Warmer], Warmer]:
    """Add a kernel's warmer to :data:`WARMERS` (one line per kernel)."""

    def add(fn: Warmer) -> Warmer:
        if name in WARMERS:
            raise ValueError(f"a kernel warmer named {name!r} is already registered")
        WARMERS[name] = fn
        return fn

    return add


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmupTarget:
    """What a promoted trainer will launch, derived from its layout and the job's settings."""

    device: torch.device
    """The trainer's device; warm-up scratch lives there."""
    erasure: ErasureConfig | None = None
    """The job's erasure protection (None: no parity kernels)."""
    group_pages: tuple[int, ...] = ()
    """Distinct data-page counts of the protection groups of the protected regions."""
    run_pages: int = 1
    """Most consecutive pages of one group that one RMU chunk's parity fold spans."""
    fused_calls: tuple[tuple[int, int, bool], ...] = field(default=())
    """``(align, token, discard)`` of every chunk's launch (``adamw_rmu.warm_up``), once per width
    of the flag token; empty when the update is not fused."""
    rehearsal: UpdateRehearsal | None = None
    """A miniature of the trainer's RMU update (its torch kernels); None: no rmu."""
    grad_dtypes: tuple[torch.dtype, ...] = ()
    """Dtypes of the retained gradients, which the gradient landing copies into."""

    @classmethod
    def plan(
        cls,
        *,
        device: torch.device,
        layout: Layout,
        optimizer: torch.optim.Optimizer,
        erasure: ErasureConfig | None,
        rmu: bool,
        chunk_bytes: int,
        fused: bool,
    ) -> WarmupTarget:
        """The target of a trainer with this layout (the same planning functions it uses)."""
        from leto.updater.plan import plan_chunks

        state_nbytes = padded_bytes(layout.state_bytes, erasure) if erasure else layout.state_bytes
        chunks = (
            plan_chunks(layout, chunk_bytes, TILE_BYTES if erasure else 64, state_nbytes)
            if rmu
            else []
        )
        group_pages: tuple[int, ...] = ()
        run_pages = 1
        if erasure is not None:
            sizes = {
                s.num_pages
                for n in (layout.state_bytes, *(b for _, b in layout.grad_regions))
                for s in plan_groups(padded_bytes(n, erasure), erasure)
            }
            group_pages = tuple(sorted(sizes))
            spans = [n for c in chunks for _, n in c.spans]
            run_pages = min(
                erasure.data_pages, max((-(-n // erasure.page_bytes) + 1 for n in spans), default=1)
            )
        calls = (
            _fused_calls(layout, chunks, state_nbytes, device, erasure is not None)
            if rmu and fused
            else ()
        )
        return cls(
            device=device,
            erasure=erasure,
            group_pages=group_pages,
            run_pages=run_pages,
            fused_calls=calls,
            rehearsal=UpdateRehearsal.of(optimizer, fused) if rmu else None,
            grad_dtypes=tuple(sorted({slot.dtype for slot in layout.grads}, key=str)),
        )


def _fused_calls(
    layout: Layout, chunks: list, state_nbytes: int, device: torch.device, parity_reads_undo: bool
) -> tuple[tuple[int, int, bool], ...]:
    """The fused kernel's ``(align, token, discard)`` for every chunk of the updater's own
    plan on ``device`` (``FusedChunks`` over meta tensors: planning reads no memory), with
    tokens below and above 2**31 (step 256 on)."""
    from leto.updater.fused import FusedChunks, drops_undo, flag_bytes, fused_token

    meta = torch.device("meta")
    undo_nbytes = max(c.undo_bytes for c in chunks) + flag_bytes(chunks)
    fused = FusedChunks(
        layout,
        chunks,
        torch.empty(state_nbytes, dtype=torch.uint8, device=meta),
        torch.empty(layout.grad_bytes, dtype=torch.uint8, device=meta),
        torch.empty(undo_nbytes, dtype=torch.uint8, device=meta),
        parity_reads_undo=parity_reads_undo,
    )
    discard = drops_undo(device, parity_reads_undo)
    last = len(chunks) - 1
    tokens = (fused_token(0, last), fused_token(1 << 9, last))
    return tuple(
        dict.fromkeys(
            (t.align, token, discard) for t in fused.tables if t.programs for token in tokens
        )
    )


@register("gf16_mac")
def warm_parity(target: WarmupTarget) -> int:
    """The erasure kernels, through replicas of the trainer's protection groups."""
    if target.erasure is None:
        return 0
    from triton_kernels.gf16_mac import bucket

    cfg = dataclasses.replace(target.erasure, page_bytes=TILE_BYTES)
    calls = 0
    for pages in target.group_pages:
        calls += _warm_group(cfg, pages, target.run_pages, target.device, bucket)
    return calls


def _warm_group(
    cfg: ErasureConfig, pages: int, run_pages: int, dev: torch.device, bucket: Callable[[int], str]
) -> int:
    pb, h1, h2 = cfg.page_bytes, cfg.tier1_parity, cfg.tier2_parity
    cuda = dev.type == "cuda"
    backend = "auto" if cuda else "triton"  # CPU: the interpreter (tests)

    def host(nbytes: int) -> torch.Tensor:  # parity tiers live in page-locked host memory
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)

    data = torch.zeros(pages * pb, dtype=torch.uint8, device=dev)
    group = ProtectionGroup(cfg, data, host(h1 * pb), host(h2 * pb), backend=backend)  # type: ignore[arg-type]
    group.encode_all()
    calls = 1
    for lost_data in range(min(h1, pages) + 1):
        for lost_t1 in range(h1 - lost_data + 1):
            if (
                lost_data or lost_t1
            ):  # lost tier-1 pages beyond tier 2's reach: all of tier 2 lost too
                group.rebuild(range(lost_data), range(lost_t1), range(h2) if lost_t1 else ())
                calls += 1
    # the updater's working parity: tier-1 syndromes on the device (Q[sel] and the spare)
    work = ProtectionGroup(
        dataclasses.replace(cfg, tier2_parity=0),
        data,
        torch.zeros(h1 * pb, dtype=torch.uint8, device=dev),
        torch.empty(0, dtype=torch.uint8, device=dev),
        backend=backend,  # type: ignore[arg-type]
        syndromes=True,
    )
    spare = torch.zeros(h1 * pb, dtype=torch.uint8, device=dev)
    work.syndromes_of(spare, work.tier1)  # the load: S = W P
    calls += 1
    for lost_data in range(1, min(h1, pages) + 1):
        work.rebuild(range(lost_data))
        calls += 1
    undo = torch.zeros_like(data)
    per_bucket = {
        bucket(k): k for k in range(min(pages, run_pages), 0, -1)
    }  # the smallest k of each
    for k in sorted(per_bucket.values()):
        old, new = undo[: k * pb], data[: k * pb]
        if k > 1:  # a run of whole pages is a [k, page] view, as the updater passes it
            old, new = old.view(k, pb), new.view(k, pb)
        work.update_pages(spare, 0, k, 0, old, new, parity_in=work.tier1)  # a chunk's first fold
        work.update_pages(work.tier1, 0, k, 0, old, new)  # a later fold into the same range
        calls += 2
    work.parity_of(work.tier1, spare)  # the flush: P = W^-1 S
    calls += 1
    if h2:  # the flush encodes tier 2 of the staged parity where it lives
        group.encode_tier2_of(spare, torch.zeros(h2 * pb, dtype=torch.uint8, device=dev))
        calls += 1
    return calls


@register("adamw_rmu")
def warm_fused_update(target: WarmupTarget) -> int:
    """The fused RMU kernel, for the argument widths of every piece of the chunk plan."""
    if not target.fused_calls:
        return 0
    from triton_kernels import adamw_rmu

    return adamw_rmu.warm_up(target.device, target.fused_calls)


@register("grad_landing")
def warm_grad_landing(target: WarmupTarget) -> int:
    """The gradient landing's multi-tensor copy (``leto.trainer.grad_landing``), once per
    gradient dtype. A process's first ``_foreach_copy_`` of a dtype pays its kernel's first
    use on the host, milliseconds inside the promoted trainer's first backward otherwise."""
    calls = 0
    for dtype in target.grad_dtypes:
        sources = [torch.zeros(4, dtype=dtype, device=target.device) for _ in range(2)]
        torch._foreach_copy_([torch.empty_like(t) for t in sources], sources)
        calls += 1
    return calls


@register("rmu_update")
def warm_update(target: WarmupTarget) -> int:
    """The update's torch kernels, through a miniature of it (``leto.preinit.rehearsal``)."""
    if target.rehearsal is None:
        return 0
    try:
        return target.rehearsal.run(target.device)
    except Exception as e:  # noqa: BLE001 - an optimizer the miniature cannot rebuild: no warm-up
        logger.info("update rehearsal skipped: %s: %s", type(e).__name__, e)
        return 0


@dataclass(frozen=True, slots=True)
class WarmupReport:
    """What :func:`warm_up` did: calls per kernel and the time it took."""

    calls: dict[str, int]
    seconds: float


def warm_up(target: WarmupTarget, warmers: dict[str, Warmer] | None = None) -> WarmupReport:
    """Run every registered warmer (or ``warmers``) for ``target``; waits for the device."""
    t0 = time.perf_counter()
    calls = {name: fn(target) for name, fn in (WARMERS if warmers is None else warmers).items()}
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
        torch.cuda.empty_cache()  # scratch goes back: the shadow's footprint stays its level's
    return WarmupReport(calls, time.perf_counter() - t0)


def skip_reason(device: torch.device, level: int, enabled: bool) -> str | None:
    """Why a shadow at ``level`` on ``device`` does not warm kernels (None: it does)."""
    if not enabled:
        return "disabled (preinit.warm_kernels: false)"
    if level < 3:
        return f"shadow level {level}: kernels are warmed at level 3"
    if device.type == "cuda":
        return None
    if os.environ.get(ENV_CPU) == "1" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "no CUDA device: the CPU path runs PyTorch, nothing to compile"


def warm_shadow(
    site: ShadowSite, layout: Layout, optimizer: torch.optim.Optimizer
) -> WarmupReport | None:
    """The shadow's warm-up before it waits for promotion; emits ``kernels_warmed``.

    A failed warm-up is logged and reported, never fatal: the kernels then compile at first
    use after promotion, as without a warm-up.
    """
    from leto.updater.fused import resolve_fused

    env = site.env
    fields: dict[str, Any] = {"rank": site.rank, "gen": env.generation, "level": env.shadow_level}
    reason = skip_reason(site.device, env.shadow_level, env.preinit.warm_kernels)
    if reason is not None:
        logger.info("[rank %d] kernel warm-up skipped: %s", site.rank, reason)
        site.events.emit(Kind.KERNELS_WARMED, **fields, ran=False, reason=reason)
        return None
    try:
        rmu = env.consistency == "rmu"
        target = WarmupTarget.plan(
            device=site.device,
            layout=layout,
            optimizer=optimizer,
            erasure=env.erasure,
            rmu=rmu,
            chunk_bytes=env.rmu_chunk_bytes,
            fused=rmu and resolve_fused(env.rmu_fused, site.device, layout),
        )
        report = warm_up(target)
    except Exception as e:  # noqa: BLE001 - the shadow stays promotable; the error is reported
        logger.warning("[rank %d] kernel warm-up failed: %s", site.rank, e)
        site.events.emit(
            Kind.KERNELS_WARMED,
            **fields,
            ran=False,
            reason=f"failed: {type(e).__name__}: {e}"[:300],
        )
        return None
    logger.info("[rank %d] kernels warmed in %.2f s: %s", site.rank, report.seconds, report.calls)
    site.events.emit(
        Kind.KERNELS_WARMED,
        **fields,
        ran=True,
        calls=report.calls,
        seconds=round(report.seconds, 4),
    )
    return report
