"""The resumable model updater: one optimizer step as a sequence of chunk transactions.

Per step (paper Pseudocode 1, lines 5–12)::

    Q[0], Q[1] <- W H (syndromes of host tier 1 H)       PARITY_LOADED(sel=0)
    for chunk j:
        U <- chunk j's pre-update bytes                   CHUNK_SAVED(j)
        chunk j <- AdamW(chunk j, G)        (in place; or the optimizer's own step)
        Q[1-sel] ^= RS_j(U xor chunk j)     (scratch)
        commit                                            CHUNK_COMMITTED(j, sel=1-sel)
        Q[sel_old][ranges of j] <- Q[sel]   (resync the other buffer)
    H <- W^-1 Q[sel]; H2 <- T2(H) (on the device)       FLUSHING → IDLE(t+1)

Every arrow into a marker state is one 64-bit store (``leto.retained.marker``), so a kill
anywhere leaves a state from which the step can be finished exactly:

* CHUNK_SAVED(j): the data of chunk j may be torn; the undo buffer restores it, after
  which ``Q[sel]`` is the parity of the data and lost pages are rebuilt from it;
* CHUNK_COMMITTED(j) / PARITY_LOADED: the data matches ``Q[sel]``; ``Q[1-sel]`` may be
  half-written, so it is resynchronised from ``Q[sel]``;
* FLUSHING: every chunk is in; the host copy of both tiers is redone from ``Q[sel]``
  (see ``_install_parity`` for why torn host tiers are harmless).

The working parity is held as tier-1 *syndromes* (``leto.erasure.rs.GRSCode``): a chunk's
fold is then a Horner sum in fixed constants (the Triton kernel of
``triton_kernels.gf16_syndrome``, several times faster than the generic kernel;
BENCHMARKS.md), and the conversions cost 16 pages per group per step.

All three buffers (undo, Q[0], Q[1]) are pool regions ("rmu.undo", "rmu.parity"), so they
survive the trainer. On a GPU they are the memory the paper borrows from activations (they
are needed only after backward); here they are allocated once.

Any other ``torch.optim`` optimizer (the layout's ``torch`` rule) updates a chunk of whole
parameters with its own ``step()`` (``leto.updater.torch_step``); undo, parity and commit are
the same.

Departure from the paper: chunks cut the flat *parameter* space, so one chunk's bytes
(param, exp_avg, exp_avg_sq) lie in several protection groups; the working parity of every
group is held at once (2 · H1/D of the state) and flushed after the last chunk, instead of
one group at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from leto.erasure import ErasureConfig, ProtectionGroup, split_range
from leto.erasure.bitslice import TILE_BYTES
from leto.erasure.protection import ProtectedRegion
from leto.errors import ConfigError, ProtocolError, UnrecoverableStateError
from leto.faults import FaultInjector
from leto.retained.layout import Layout
from leto.retained.marker import Marker, Phase
from leto.retained.presence import GradPresence
from leto.updater.adamw import AdamWHyper, adamw_fused_pieces, adamw_pieces, f32_add_one
from leto.updater.base import Buffer
from leto.updater.fused import FusedChunks, flag_bytes
from leto.updater.plan import Chunk, plan_chunks
from leto.updater.torch_step import TorchStep

logger = logging.getLogger(__name__)

WORKING_PHASES = frozenset(
    {Phase.PARITY_LOADED, Phase.CHUNK_SAVED, Phase.CHUNK_COMMITTED, Phase.FLUSHING}
)
"""Phases in which the working parity Q[sel], not the host tier 1, matches the data."""
UNDO = "rmu.undo"
"""The device region holding one chunk's pre-update bytes (and the fused path's flags)."""
PARITY = "rmu.parity"
"""The device region holding the two working parity buffers Q[0], Q[1]."""


def buffer_bytes(
    layout: Layout,
    state_nbytes: int,
    chunk_bytes: int,
    erasure: ErasureConfig | None,
    *,
    fused: bool = False,
) -> tuple[int, int]:
    """Sizes of the undo buffer (with the fused path's progress flags at its end) and of
    the two working parity buffers together."""
    align = TILE_BYTES if erasure is not None else 64
    chunks = plan_chunks(layout, chunk_bytes, align, state_nbytes)
    undo = max(c.undo_bytes for c in chunks) + (flag_bytes(chunks) if fused else 0)
    if erasure is None:
        return undo, 0
    groups = -(-state_nbytes // erasure.group_bytes)
    return undo, 2 * groups * erasure.tier1_parity * erasure.page_bytes


def _only_region(regions: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fused kernel addresses every gradient in one flat region."""
    if len(regions) != 1:
        raise ConfigError(
            f"leto.rmu_fused needs one gradient region, the layout has {sorted(regions)}; "
            "set rmu_fused: false"
        )
    (region,) = regions.values()
    return region


class ResumableUpdater:
    """Applies the optimizer to the retained state chunk by chunk, crash-consistently."""

    def __init__(
        self,
        *,
        layout: Layout,
        state: torch.Tensor,
        grads: torch.Tensor | Mapping[str, torch.Tensor],
        rng_next: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        marker: Marker,
        undo: torch.Tensor,
        parity: torch.Tensor | None,
        protected: ProtectedRegion | None,
        injector: FaultInjector,
        chunk_bytes: int,
        incremental_parity: bool = True,
        fused: bool = False,
        presence: GradPresence | None = None,
    ) -> None:
        """``state``/``grads``/``undo``/``parity`` are flat uint8 views of retained regions;
        ``grads`` maps the layout's gradient region names to theirs (a tensor: the one
        "grads" region).

        ``incremental_parity=False`` is the paper's "RMP alone" (§8.4): chunks are still
        applied in place, but the parity is only re-encoded from the data after the last
        chunk, so a failure mid-update leaves parity that does not match the data. Only the
        negative test uses it.

        ``fused=True`` saves and updates each chunk with the Triton kernel of
        ``triton_kernels.adamw_rmu`` (CUDA, or the interpreter on CPU); the undo region
        must then be sized by ``buffer_bytes(..., fused=True)``. A job must use the same
        path before and after a failure (the two save the undo copy differently).

        ``presence``: the retained record of the parameters a step skips (no gradient on any
        rank), which a finishing update reads.
        """
        self.layout, self.state, self.marker, self.injector = layout, state, marker, injector
        self.optimizer, self.rng_next, self.undo = optimizer, rng_next, undo
        self.protected, self.presence = protected, presence
        self._skipped: frozenset[int] = frozenset()
        """The parameters the update in progress leaves alone (``leto.retained.presence``)."""
        self.incremental_parity = incremental_parity
        align = TILE_BYTES if protected is not None else 64
        self.chunks = plan_chunks(layout, chunk_bytes, align, state.numel())
        if undo.numel() < max(c.undo_bytes for c in self.chunks):
            raise ProtocolError("the undo buffer is smaller than the largest chunk")
        regions = {"grads": grads} if isinstance(grads, torch.Tensor) else dict(grads)
        self._torch: TorchStep | None = None
        if layout.rule.kind == "torch":
            if fused:
                raise ConfigError(
                    f"leto.rmu_fused is Leto's AdamW kernel; {layout.rule.reason}: set rmu_fused: false "
                    "or leave it unset"
                )
            self._torch = TorchStep(optimizer, layout, state, regions)
        else:
            self._param = [s.view(state).view(-1) for s in layout.params]
            self._m = [o["exp_avg"].view(state).view(-1) for o in layout.optim]
            self._v = [o["exp_avg_sq"].view(state).view(-1) for o in layout.optim]
            self._step = [o["step"].view(state) for o in layout.optim]
            self._grad = [
                s.view(regions[name]).view(-1)
                for s, name in zip(layout.grads, layout.grad_region, strict=True)
            ]
        self._host_step: list[float] | None = None
        """The step counters on the host, kept in step with the device after a whole update
        (None: read them, once, at the next update)."""
        self._views_by_chunk: dict[int, dict[int, tuple[list[Any], ...]]] = {}
        """Each chunk's piece views (``_piece_views``)."""
        self._owners: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
        """Each chunk's step-counter owners and counters, in an update skipping none."""
        self._step_owner = {p.param: c.index for c in self.chunks for p in c.pieces if p.owns_step}
        """The chunk that advances each parameter's step counter."""
        self._counters = [
            (i, o[key].view(state))
            for i, o in enumerate(layout.optim)
            for key in sorted(layout.rule.counters)
            if key in o
        ]
        """Step counters of the ``torch`` rule (``UpdateRule.counters``), for check_counters."""
        self._rng = layout.rng.view(state)
        self._rng_staged: torch.Tensor | None = None
        """The page-locked RNG bytes of the update in progress (``run``'s ``rng``)."""
        self._group_of = [gi for gi, g in enumerate(optimizer.param_groups) for _ in g["params"]]
        self.fused = (
            FusedChunks(
                layout,
                self.chunks,
                state,
                _only_region(regions),
                undo,
                parity_reads_undo=protected is not None,
            )
            if fused
            else None
        )
        self._working: list[list[ProtectionGroup]] = []
        self._stale: dict[int, list[tuple[int, int]]] = {}
        """Parity byte ranges per group where Q[1-sel] lags Q[sel] (see ``_fold_parity``)."""
        self._copy_stream: torch.cuda.Stream | None = None  # the flush's device-to-host copies
        if protected is not None:
            if parity is None:
                raise ProtocolError("erasure protection needs the working parity buffers")
            cfg = protected.cfg
            h1 = cfg.tier1_parity * cfg.page_bytes
            n = len(protected.groups)
            if parity.numel() < 2 * n * h1:
                raise ProtocolError("the working parity region is too small")
            no_t2 = dataclasses.replace(cfg, tier2_parity=0)
            empty = torch.empty(0, dtype=torch.uint8, device=parity.device)
            self._working = [
                [
                    ProtectionGroup(
                        no_t2,
                        g.data,
                        parity[(s * n + i) * h1 : (s * n + i + 1) * h1],
                        empty,
                        backend=g.backend,
                        syndromes=True,
                    )
                    for i, g in enumerate(protected.groups)
                ]
                for s in (0, 1)
            ]

    @classmethod
    def buffers(
        cls,
        layout: Layout,
        state_nbytes: int,
        chunk_bytes: int,
        erasure: ErasureConfig | None,
        *,
        fused: bool = False,
    ) -> list[Buffer]:
        """One chunk of undo (``UNDO``) and, under erasure, the two working parity buffers
        (``PARITY``): device regions, sized by :func:`buffer_bytes`."""
        undo, parity = buffer_bytes(layout, state_nbytes, chunk_bytes, erasure, fused=fused)
        return [Buffer(UNDO, undo)] + ([Buffer(PARITY, parity)] if parity else [])

    def bind_buffers(self, undo: torch.Tensor, parity: torch.Tensor | None) -> None:
        """Point the updater at new undo / working-parity memory of the same sizes.

        The buffers are needed only between GRADS_READY and IDLE, so on a GPU they can be
        lent from activation memory each step (allocated after backward, freed before the
        next forward) instead of being held for the whole run. Contents are not carried
        over: call only between updates (marker IDLE or GRADS_READY).
        """
        if self.marker.phase in WORKING_PHASES:
            raise ProtocolError(
                f"cannot move the rmu buffers in the middle of an update ({self.marker.phase.name})"
            )
        if undo.numel() != self.undo.numel() or (parity is None) != (not self._working):
            raise ProtocolError(
                "bind_buffers needs buffers of the sizes the updater was built with"
            )
        self.undo = undo
        if self.fused is not None:
            self.fused.bind(undo)
        if self._working:
            assert parity is not None
            n, h1 = len(self._working[0]), self._working[0][0].tier1.numel()
            if parity.numel() < 2 * n * h1:
                raise ProtocolError("the working parity region is too small")
            for s in (0, 1):
                for i, g in enumerate(self._working[s]):
                    g.tier1 = parity[(s * n + i) * h1 : (s * n + i + 1) * h1]

    @property
    def grad_scale(self) -> torch.Tensor | None:
        """The fused kernel's gradient factor (``FusedChunks.grad_scale``); the unfused
        paths read the gradients as clipping left them."""
        return None if self.fused is None else self.fused.grad_scale

    def lendable(self) -> dict[str, torch.Tensor]:
        """The undo buffer: read and written only between GRADS_READY and IDLE."""
        return {UNDO: self.undo}

    def unprotected_needs(self, phase: Phase) -> tuple[str, ...]:
        """Mid-update, the undo copy (while a chunk is saved) and the working parity are the
        only consistent record of the state, and nothing protects them."""
        if phase == Phase.CHUNK_SAVED:
            return (UNDO, PARITY)
        return (PARITY,) if phase in WORKING_PHASES else ()

    def rebuilds_state(self, phase: Phase) -> bool:
        return True

    def rebuild_groups(self, phase: Phase) -> list[ProtectionGroup] | None:
        """Mid-update the data matches the authoritative working parity (after
        :meth:`prepare`), not the host tier 1, which the flush rewrites."""
        return self.working_groups() if phase in WORKING_PHASES else None

    # -- one step ----------------------------------------------------------------------------
    def run(
        self, step: int, skipped: frozenset[int] = frozenset(), rng: torch.Tensor | None = None
    ) -> None:
        """Apply step ``step``'s update from GRADS_READY; ends at IDLE(step + 1). The
        parameters in ``skipped`` (no gradient on any rank) are left as they are; ``rng``
        (``Updater.run``) is what the RNG-installing chunk copies, else ``rng_next``.

        On CUDA the step's last host copies and its IDLE store are left running on the copy
        stream (they overlap the next step's compute); :meth:`join` orders the current
        stream after them and must run before the next marker write."""
        self._skipped = skipped
        self._rng_staged = rng
        try:
            self.join()
            self._load_parity()
            if self.fused is not None:
                self.fused.clear_flags()
            self.marker.advance(Phase.PARITY_LOADED, sel=0)
            self._chunks_from(step, 0)
        finally:
            self._rng_staged = None  # a finishing update reads the retained rng_next

    def resume(self, step: int) -> str:
        """Finish step ``step``'s update from wherever the marker says it stopped.

        :meth:`prepare` must have run first (undo restored, parity resynchronised, lost
        pages rebuilt). Returns the action taken, for the ``resumed`` event.
        """
        self._skipped = self.presence.retained_skipped() if self.presence else frozenset()
        self.check_counters(step)
        phase = self.marker.phase
        if phase == Phase.GRADS_READY:
            self.run(step, self._skipped)
            return "finish"
        if phase == Phase.PARITY_LOADED:
            self._chunks_from(step, 0)
            return "resume+finish"
        if phase == Phase.CHUNK_SAVED:
            self._chunks_from(step, self.marker.chunk, saved=True)
            return "restore+finish"
        if phase == Phase.CHUNK_COMMITTED:
            self._chunks_from(step, self.marker.chunk + 1)
            return "resume+finish"
        if phase == Phase.FLUSHING:
            self._flush(step)
            return "flush"
        raise ProtocolError(f"cannot resume an rmu update from {phase.name}")

    def prepare(self) -> None:
        """After a failure: undo a torn chunk and resync the scratch parity buffer, so the
        data matches ``Q[sel]`` (call before rebuilding lost pages from it)."""
        self._host_step = None  # restored or rebuilt counters: read them again
        phase = self.marker.phase
        if phase == Phase.CHUNK_SAVED:
            if self.fused is not None:
                self.fused.restore(self.marker.chunk, self.marker.step)
            else:
                self._restore(self.chunks[self.marker.chunk])
        if self._working and phase in (
            Phase.PARITY_LOADED,
            Phase.CHUNK_SAVED,
            Phase.CHUNK_COMMITTED,
        ):
            sel = self.marker.parity_sel
            for auth, other in zip(self._working[sel], self._working[1 - sel], strict=True):
                other.tier1.copy_(auth.tier1)
            self._stale = {}

    def check_counters(self, step: int) -> None:
        """Refuse to resume when the retained step counters contradict the marker.

        Leto's AdamW: each parameter's counter is ``step`` until the chunk holding its
        element 0 commits, then ``step + 1``. The optimizer's own step (``torch`` rule,
        whose state may have been loaded with other counts): every counter less one where
        its chunk committed is the same number, and every PRESENT byte is 0 or 1. Once an
        update skipped a parameter (no gradient on any rank, ``leto.retained.presence``) or
        the state came from a checkpoint, counts may differ: each counter, less one where
        its chunk committed (and this update does not skip it), is then a whole number of
        at most ``step`` (the torch rule: of at most the largest). Rebuilt pages
        that do not match the data (parity that lagged the update) show up here first;
        raising beats resuming on wrong data.
        """
        phase, cursor = self.marker.phase, self.marker.chunk
        done = {
            Phase.GRADS_READY: 0,
            Phase.PARITY_LOADED: 0,
            Phase.CHUNK_SAVED: cursor,
            Phase.CHUNK_COMMITTED: cursor + 1,
            Phase.FLUSHING: len(self.chunks),
        }[phase]
        applied = {p.param for c in self.chunks[:done] for p in c.pieces if p.owns_step}
        applied -= self._skipped
        uneven = self.presence is not None and self.presence.counts_may_differ()
        if self._torch is not None:
            flags = self._torch.begin()
            bad = [(i, float(f)) for i, f in enumerate(flags) if f not in (0, 1)]
            values = (
                torch.stack([t for _, t in self._counters]).cpu().tolist() if self._counters else []
            )
            counted = [
                (i, float(v) - (i in applied), float(v))
                for (i, _), v in zip(self._counters, values, strict=True)
                if self._torch.slots.present[i]
            ]
            if not bad and counted:
                top = max(base for _, base, _ in counted)
                bad = [
                    (i, v)
                    for i, base, v in counted
                    if (not _whole_within(base, top) if uneven else base != counted[0][1])
                ]
        else:
            bad = [
                (i, float(t))
                for i, t in enumerate(self._step)
                if (
                    not _whole_within(float(t) - (i in applied), step)
                    if uneven
                    else float(t) != step + (i in applied)
                )
            ]
        if bad:
            raise UnrecoverableStateError(
                f"retained optimizer step counters contradict the update marker ({phase.name}, chunk "
                f"{cursor}, step {step}): parameter {bad[0][0]} has {bad[0][1]} ({len(bad)} wrong); "
                "the rebuilt state is inconsistent, restart the job from a checkpoint"
            )

    def working_groups(self) -> list[ProtectionGroup]:
        """The groups over the authoritative working parity (to rebuild lost data pages)."""
        return self._working[self.marker.parity_sel] if self._working else []

    # -- internals ---------------------------------------------------------------------------
    def _chunks_from(self, step: int, first: int, *, saved: bool = False) -> None:
        lrs = self.marker.recorded_lrs()
        if self._torch is not None:
            hypers: list[AdamWHyper] | list[float] = lrs
            self._torch.begin()  # after any restore: which parameters' state torch has created
        else:
            hypers = [
                AdamWHyper.from_group(g, self.optimizer, lr)
                for g, lr in zip(self.optimizer.param_groups, lrs, strict=True)
            ]
            if self._host_step is None or first != 0 or saved:  # a process's first, or a resume
                self._host_step = torch.stack(self._step).cpu().tolist() if self._step else []
            if self.fused is not None:
                self.fused.begin(hypers, self._group_of, self._steps_from(first), self._skipped)
        for j in range(first, len(self.chunks)):
            self._chunk(self.chunks[j], hypers, saved=saved and j == first)
        self._flush(step)

    def _steps_from(self, first: int) -> list[float]:
        """Each parameter's step count in an update that runs chunks ``first`` on: advanced
        where its counter's chunk is still to run, the host mirror's value where it has run."""
        assert self._host_step is not None
        bumped = {s: f32_add_one(s) for s in set(self._host_step)}  # a few distinct counts
        return [
            bumped[s] if self._step_owner.get(i, -1) >= first and i not in self._skipped else s
            for i, s in enumerate(self._host_step)
        ]

    def _chunk(self, chunk: Chunk, hypers: list[AdamWHyper] | list[float], *, saved: bool) -> None:
        j, last = chunk.index, chunk.index == len(self.chunks) - 1
        self.injector.point("update", at="boundary", chunk=j)
        if not saved:
            if self.fused is not None:
                self.fused.save_gaps(j)  # the kernel saves the element ranges itself
            else:
                self._save(chunk)
            self.marker.advance(Phase.CHUNK_SAVED, chunk=j)
        # a fault that may fire in this chunk emulates a kernel killed halfway from its undo image
        self._apply(chunk, hypers, keep_undo=self.injector.scheduled("update", chunk=j))
        if self.fused is not None:
            scribble = lambda: self.fused.abort(j, seed=j)  # type: ignore[union-attr]
        else:
            scribble = lambda: _scribble(self.state, chunk.spans, seed=j)
        self.injector.point("update", at="optimizer", chunk=j, on_fire=scribble)
        if last:  # the plain "update" point: the optimizer has run, nothing is committed
            self.injector.point("update", on_fire=scribble)
        sel = self.marker.parity_sel
        if self._working and self.incremental_parity:
            self._fold_parity(chunk, self._working[sel], self._working[1 - sel])
        self.marker.advance(Phase.CHUNK_COMMITTED, chunk=j, sel=1 - sel if self._working else sel)

    def _save(self, chunk: Chunk) -> None:
        pos = 0
        for off, n in chunk.spans:
            self.undo[pos : pos + n].copy_(self.state[off : off + n])
            pos += n

    def _restore(self, chunk: Chunk) -> None:
        pos = 0
        for off, n in chunk.spans:
            self.state[off : off + n].copy_(self.undo[pos : pos + n])
            pos += n

    def _apply(
        self, chunk: Chunk, hypers: list[AdamWHyper] | list[float], *, keep_undo: bool = False
    ) -> None:
        """AdamW on the chunk's pieces, one foreach call per parameter group (``torch`` rule:
        the optimizer's own step over its parameters; ``hypers`` are then the recorded lrs)."""
        skipped = self._skipped
        if self._torch is not None:
            self._torch.apply([p.param for p in chunk.pieces], hypers, skipped)  # type: ignore[arg-type]
            if chunk.installs_rng:
                self._install_rng()
            return
        owners, counters = self._step_owners(chunk, skipped)
        if owners:  # one launch for the chunk's step counters, not one per parameter
            torch._foreach_add_(counters, 1.0)
            host = self._host_step
            bumped = {s: f32_add_one(s) for s in {host[i] for i in owners}}  # a few counts
            for i in owners:
                host[i] = bumped[host[i]]
        if self.fused is not None:
            self.fused.apply(chunk.index, self.marker.step, keep_undo=keep_undo)
            if chunk.installs_rng:
                self._install_rng()
            return
        for gi, (ps, gs, ms, vs, owners) in self._piece_views(chunk, skipped).items():
            h = hypers[gi]
            assert isinstance(h, AdamWHyper)
            if h.fused:  # torch's fused kernel, as torch itself would run it
                adamw_fused_pieces(ps, gs, ms, vs, [self._step[i] for i in owners], h)
            else:
                adamw_pieces(ps, gs, ms, vs, [self._host_step[i] for i in owners], h)
        if chunk.installs_rng:
            self._install_rng()

    def _step_owners(
        self, chunk: Chunk, skipped: frozenset[int]
    ) -> tuple[list[int], list[torch.Tensor]]:
        """The parameters whose step counter the chunk advances (those of its pieces holding
        element 0, less the skipped), and their counters; built once per chunk for an
        update that skips none."""
        if not skipped and chunk.index in self._owners:
            return self._owners[chunk.index]
        owners = [p.param for p in chunk.pieces if p.owns_step and p.param not in skipped]
        found = owners, [self._step[i] for i in owners]
        if not skipped:
            self._owners[chunk.index] = found
        return found

    def _install_rng(self) -> None:
        """The next step's RNG into the state region, with this chunk: from the page-locked
        copy ``run`` was given (no wait), else from the retained host region (the copy from
        pageable memory waits for the device: a finishing update's)."""
        if self._rng_staged is not None:
            self._rng.copy_(self._rng_staged, non_blocking=True)
        else:
            self._rng.copy_(self.rng_next)

    def _piece_views(
        self, chunk: Chunk, skipped: frozenset[int] = frozenset()
    ) -> dict[int, tuple[list[Any], ...]]:
        """The chunk's pieces by parameter group: parameter, gradient, moment views and the
        parameter indices, without those of ``skipped`` parameters. Built at the chunk's
        first update and kept (the layout and the regions' addresses are fixed for the
        process): slicing a few hundred views is host time a small model's step would
        otherwise pay every update."""
        views = self._views_by_chunk.get(chunk.index)
        if skipped:
            kept: dict[int, tuple[list[Any], ...]] = {}
            for gi, lists in self._piece_views(chunk).items():
                keep = [k for k, i in enumerate(lists[4]) if i not in skipped]
                if keep:
                    kept[gi] = tuple([lst[k] for k in keep] for lst in lists)
            return kept
        if views is None:
            views = self._views_by_chunk[chunk.index] = {}
            for p in chunk.pieces:
                i, lo, hi = p.param, p.lo, p.hi
                lists = views.setdefault(self._group_of[i], ([], [], [], [], []))
                lists[0].append(self._param[i][lo:hi])
                lists[1].append(self._grad[i][lo:hi])
                lists[2].append(self._m[i][lo:hi])
                lists[3].append(self._v[i][lo:hi])
                lists[4].append(i)
        return views

    def _fold_parity(
        self, chunk: Chunk, auth: list[ProtectionGroup], spare: list[ProtectionGroup]
    ) -> None:
        """``Q[1-sel] = Q[sel] ^ RS_j(U xor C)``, written only into the spare ``Q[1-sel]``.

        The first fold into a parity range reads the authoritative buffer and writes the
        spare (out of place), so the spare needs no copy where this chunk writes; a later
        fold into the same range accumulates in the spare. ``self._stale`` holds the ranges
        where the spare still lags (those the previous chunk wrote, on the other buffer):
        the ones this chunk does not rewrite are copied before the commit. Consecutive
        chunks mostly rewrite the same whole-page ranges, so with the syndrome kernel the
        per-chunk resync of earlier versions (a copy of every range, ~40 ms per step on an
        H200) disappears; the generic kernel copies the range inside ``update_pages``.
        """
        assert self.protected is not None
        cfg, pb = self.protected.cfg, self.protected.cfg.page_bytes
        written: dict[int, list[tuple[int, int]]] = {}
        pos, first = 0, True
        for off, n in chunk.spans:
            for run in _page_runs(split_range(off, n, cfg), pb):
                g, page, k, boff, nb, roff = run
                u0 = pos + (roff - off)
                old = self.undo[u0 : u0 + k * nb]
                new = self.state[roff : roff + k * nb]
                if k > 1:
                    old, new = old.view(k, pb), new.view(k, pb)
                rng = (boff, boff + nb)
                done = written.setdefault(g, [])
                if _overlaps(rng, done):  # complete the spare on this range, then accumulate
                    for lo, hi in _subtract([rng], done):
                        self._copy_range(auth[g], spare[g], lo, hi)
                    spare[g].update_pages(spare[g].tier1, page, k, boff, old, new)
                else:
                    spare[g].update_pages(
                        spare[g].tier1, page, k, boff, old, new, parity_in=auth[g].tier1
                    )
                written[g] = _union(done, [rng])
                if first:
                    first = False
                    scratch = [gr.tier1 for gr in spare]
                    self.injector.point(
                        "update",
                        at="parity",
                        chunk=chunk.index,
                        on_fire=lambda s=scratch: [
                            _scribble(t, [(0, t.numel())], seed=7) for t in s
                        ],
                    )
            pos += n
        for g, ranges in self._stale.items():
            for lo, hi in _subtract(ranges, written.get(g, [])):
                self._copy_range(auth[g], spare[g], lo, hi)
        self._stale = written

    def _copy_range(self, src: ProtectionGroup, dst: ProtectionGroup, lo: int, hi: int) -> None:
        """Bytes ``[lo, hi)`` of every parity page, ``src`` -> ``dst``."""
        h1, pb = self.protected.cfg.tier1_parity, self.protected.cfg.page_bytes  # type: ignore[union-attr]
        dst.tier1.view(h1, pb)[:, lo:hi].copy_(src.tier1.view(h1, pb)[:, lo:hi])

    def join(self) -> None:
        """Make the current stream wait for the copy stream: the last flush's host copies
        and its IDLE marker store (a device-side wait; the host does not block)."""
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.state.device).wait_stream(self._copy_stream)

    def drain(self) -> None:
        """The last flush's host copies land (the job's last step)."""
        if self.state.is_cuda:
            self.join()
            torch.cuda.current_stream(self.state.device).synchronize()

    def _load_parity(self) -> None:
        """Q[0] <- syndromes of host tier 1 (staged in Q[1]), then Q[1] <- Q[0].

        On CUDA each group's host transfer runs on the copy stream and its conversion on the
        current stream waits for that group alone, so transfer g + 1 overlaps conversion g."""
        if not self._working:
            return
        assert self.protected is not None
        side = self._side_stream() if self.state.is_cuda else None
        arrived = []
        if side is not None:  # borrowed buffers may have been activations until now
            side.wait_stream(torch.cuda.current_stream(self.state.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for host, b in zip(self.protected.groups, self._working[1], strict=True):
                b.tier1.copy_(host.tier1, non_blocking=True)  # staged in Q[1]: one host transfer
                if side is not None:
                    arrived.append(side.record_event())
        for i, (a, b) in enumerate(zip(self._working[0], self._working[1], strict=True)):
            if side is not None:
                torch.cuda.current_stream(self.state.device).wait_event(arrived[i])
            a.syndromes_of(b.tier1, a.tier1)
            b.tier1.copy_(a.tier1)
        self._stale = {}

    def _flush(self, step: int) -> None:
        """Install the committed parity in host memory (both tiers); commit the step."""
        if self.marker.phase != Phase.FLUSHING:
            self.marker.advance(Phase.FLUSHING)
        if self.protected is not None:
            if self.incremental_parity:
                self._install_parity()
            else:
                for host in self.protected.groups:
                    host.encode_all()
        if self._copy_stream is not None and self.protected is not None and self.incremental_parity:
            with torch.cuda.stream(self._copy_stream):  # lands after the host copies (see join)
                self.marker.advance(Phase.IDLE, step + 1)
        else:
            self.marker.advance(Phase.IDLE, step + 1)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # LR schedulers check it

    def _install_parity(self) -> None:
        """Host tier 1 <- W^-1 Q[sel]; host tier 2 <- T2 of it, both computed where Q lives.

        Crash consistency (the invariant recovery relies on): in FLUSHING, Q[sel] is final
        and nothing writes it, and the flush is a pure function of Q[sel], so a kill
        anywhere in it is repaired by running it again (``resume`` -> ``_flush``). Host
        tier 1 and tier 2 may then be torn in any combination (tier 2 written while tier 1
        is half copied, or the reverse); that is harmless because the host tiers are read
        only outside ``WORKING_PHASES`` (a rebuild of model state from tier 1, of tier 1
        from tier 2), and the marker leaves FLUSHING only after both copies have landed
        (the IDLE store is ordered after them: program order on CPU, stream order on GPU,
        where the side stream is joined first). Mid-flush, lost data pages are rebuilt from
        Q[sel] and lost host parity pages are left to the rerun flush. The parity is staged in
        Q[1-sel], which is free from FLUSHING on: nothing reads it until the next step's
        load overwrites it (``prepare`` resyncs it only before FLUSHING).

        On CUDA the tier-1 copies run on a side stream while the tier-2 kernels run on the
        current one; each group's tier-2 copy waits for its kernel (an event). The side
        stream is not joined: the copies, and the IDLE store queued after them by
        :meth:`_flush`, overlap the next step's compute until :meth:`join` (before the next
        marker write). The buffers they read are recorded on the side stream, so borrowed
        ones are not handed to the next step's activations while a copy still reads them.
        On CPU the same calls run in program order.
        """
        assert self.protected is not None
        cfg = self.protected.cfg
        sel = self.marker.parity_sel
        auth, spare = self._working[sel], self._working[1 - sel]
        h2_bytes = cfg.tier2_parity * cfg.page_bytes
        cuda = self.state.is_cuda
        main = torch.cuda.current_stream(self.state.device) if cuda else None
        side = self._side_stream() if cuda else None
        for q, s in zip(auth, spare, strict=True):
            q.parity_of(q.tier1, s.tier1)  # the parity, staged in Q[1-sel]
        if side is not None:
            side.wait_stream(main)  # the staged parity is final
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for i, (host, s) in enumerate(zip(self.protected.groups, spare, strict=True)):
                src = s.tier1
                half = src.numel() // 2 // TILE_BYTES * TILE_BYTES
                host.tier1[:half].copy_(src[:half], non_blocking=True)
                if i == 0:
                    self.injector.point(
                        "update",
                        at="flush",
                        on_fire=lambda h=host, a=half: _scribble(
                            h.tier1, [(a, h.tier1.numel() - a)], seed=11
                        ),
                    )
                host.tier1[half:].copy_(src[half:], non_blocking=True)
        for host, s in zip(self.protected.groups, spare, strict=True):
            if side is not None:
                s.tier1.record_stream(side)
            if not h2_bytes:
                continue
            t2 = torch.empty(h2_bytes, dtype=torch.uint8, device=s.tier1.device)
            host.encode_tier2_of(s.tier1, t2)
            if side is not None:
                done = torch.cuda.Event()
                done.record(main)
                side.wait_event(done)
                t2.record_stream(side)  # freed only after the side stream's copy of it
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                host.tier2.copy_(t2, non_blocking=True)

    def _side_stream(self) -> torch.cuda.Stream:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.state.device)
        return self._copy_stream


def _whole_within(count: float, top: float) -> bool:
    """Whether a step counter is a whole number in ``[0, top]``."""
    return count == int(count) and 0 <= count <= top


def _page_runs(spans: list, pb: int) -> list[tuple[int, int, int, int, int, int]]:
    """Page spans as ``(group, first page, pages, byte offset, bytes per page, region
    offset)``; consecutive whole pages of one group become one multi-page run."""
    runs: list[list[int]] = []
    for s in spans:
        whole = s.offset == 0 and s.nbytes == pb
        if (
            whole
            and runs
            and runs[-1][4] == pb
            and runs[-1][0] == s.group
            and runs[-1][1] + runs[-1][2] == s.page
        ):
            runs[-1][2] += 1
        else:
            runs.append([s.group, s.page, 1, s.offset, s.nbytes, s.region_offset])
    return [tuple(r) for r in runs]  # type: ignore[misc]


def _overlaps(r: tuple[int, int], ranges: list[tuple[int, int]]) -> bool:
    return any(lo < r[1] and r[0] < hi for lo, hi in ranges)


def _union(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, merged union of half-open byte ranges."""
    out: list[list[int]] = []
    for lo, hi in sorted(a + b):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _subtract(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of the ranges ``a`` outside the ranges ``b``."""
    out: list[tuple[int, int]] = []
    for lo, hi in _union(a, []):
        cur = lo
        for blo, bhi in _union(b, []):
            if bhi <= cur or blo >= hi:
                continue
            if blo > cur:
                out.append((cur, blo))
            cur = max(cur, bhi)
        if cur < hi:
            out.append((cur, hi))
    return out


def _scribble(
    t: torch.Tensor, spans: tuple[tuple[int, int], ...] | list[tuple[int, int]], seed: int
) -> None:
    """Fill byte ranges with random bytes (what a kernel or copy killed midway leaves)."""
    gen = torch.Generator().manual_seed(seed)
    for off, n in spans:
        t[off : off + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
