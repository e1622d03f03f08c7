"""The fused RMU chunk: undo copy + AdamW in one Triton pass (``triton_kernels.adamw_rmu``).

A chunk's undo image is the concatenation of its byte spans (``plan.Chunk.spans``). The
fused path splits it in two:

* the *element ranges* (param / exp_avg / exp_avg_sq of every piece) are saved by the
  kernel itself, block by block, each block marking a progress flag before it writes;
* the *gaps* (everything else in the spans: step counters, the RNG slot, bytes of other
  chunks in tiles shared at a chunk's edges, alignment padding) are copied before
  CHUNK_SAVED, as the unfused path copies everything.

Each block has two progress flags: *saved* (its undo words are in) and *done* (its new
values are in); a launch skips the blocks already done with its token. Restore after a
kill at CHUNK_SAVED, the gaps from undo and then:

* where the erasure parity folds the chunk from its undo image (``parity_reads_undo``):
  every block with the saved flag, so the chunk is back to its old bytes (which the working
  parity matches, for rebuilding lost pages), and the done flags cleared, so the chunk's
  launch redoes it whole and leaves its undo image complete for the fold;
* else only the torn blocks (saved, not done). The done blocks keep their new values and
  the launch after the restore finishes the rest: the chunk rolls forward. That lets the
  kernel drop a done block's undo words from the L2 (``DISCARD`` in
  ``triton_kernels.adamw_rmu``) on CUDA, so saving them costs the device's memory almost
  nothing.

The flags (two int64 per block of the largest chunk) live at the end of the ``rmu.undo``
region, so they survive the trainer like the undo copy; they are cleared at the start of
each update, since the region may be lent to activations in between.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from leto.errors import ConfigError, ProtocolError
from leto.retained.layout import Layout
from leto.updater.adamw import AdamWHyper
from leto.updater.plan import Chunk

FLAG_BYTES = 8
GATHERED_GAP_BYTES = 4096
"""Gaps up to this size are saved and restored together, one gather and one scatter per
chunk (a model's parameters each leave a 64-byte gap: its step counter and padding); larger
ones (buffers, the RNG slot) are copied one by one."""
BLOCK = 1024
"""Elements per kernel program (``triton_kernels.adamw_rmu.BLOCK``; kept here so planning
does not import Triton)."""


def resolve_fused(setting: bool | None, device: torch.device, layout: Layout) -> bool:
    """``leto.rmu_fused`` for this trainer: None picks the kernel for float32 state on CUDA
    under Leto's AdamW (the kernel is AdamW's; other optimizers run their own step)."""
    fp32 = all(s.dtype == torch.float32 for s in layout.params)
    if setting is None:  # the kernel addresses every gradient in one region
        return (
            device.type == "cuda"
            and fp32
            and len(layout.grad_regions) == 1
            and layout.rule.kind == "adamw"
        )
    if setting and layout.rule.kind != "adamw":
        raise ConfigError(
            f"leto.rmu_fused: true is Leto's AdamW kernel, but {layout.rule.reason}; "
            "set rmu_fused: false or leave it unset"
        )
    if setting and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError(
            "leto.rmu_fused: true needs a CUDA device (or TRITON_INTERPRET=1 for tests); "
            "set rmu_fused: false or leave it unset"
        )
    return setting


def drops_undo(device: torch.device, parity_reads_undo: bool) -> bool:
    """Whether the kernel drops a done block's undo words from the L2 (``DISCARD``): on an
    NVIDIA GPU of compute capability 8.0 on (PTX ``discard``), where nothing reads the undo
    image after the chunk. Elsewhere (and in the interpreter) the image stays, which changes
    nothing the restore reads."""
    return (
        device.type == "cuda"
        and not parity_reads_undo
        and torch.version.hip is None
        and torch.cuda.get_device_capability(device) >= (8, 0)
    )


def fused_token(step: int, chunk: int) -> int:
    """The flag value of chunk ``chunk`` of step ``step``: unique over a job's history."""
    return (step << 23) + chunk + 1


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def flag_bytes(chunks: list[Chunk]) -> int:
    """Bytes of the two progress flags (saved, done) the largest chunk needs, each array
    64-byte aligned."""
    most = max(sum(_blocks(p.hi - p.lo) for p in c.pieces) for c in chunks)
    return 2 * (-(-most * FLAG_BYTES // 64) * 64)


@dataclass(frozen=True, slots=True)
class _PiecePlan:
    param: int
    n: int
    offsets: tuple[int, int, int, int, int, int, int]
    """Element offsets: param, exp_avg, exp_avg_sq in state; grad; undo param, exp_avg, exp_avg_sq."""
    flag_base: int


@dataclass(frozen=True, slots=True)
class _ChunkPlan:
    pieces: tuple[_PiecePlan, ...]
    gaps: tuple[tuple[int, int, int], ...]
    """``(state byte offset, undo byte offset, nbytes)`` of span bytes the kernel does not save."""
    blocks: int


class FusedChunks:
    """Saves, applies and restores chunks with the fused kernel."""

    def __init__(
        self,
        layout: Layout,
        chunks: list[Chunk],
        state: torch.Tensor,
        grads: torch.Tensor,
        undo: torch.Tensor,
        *,
        parity_reads_undo: bool,
    ) -> None:
        """``parity_reads_undo``: the erasure parity folds each chunk from its undo image
        (restore then takes a chunk back whole; see the module's docstring)."""
        if any(s.dtype != torch.float32 for s in layout.params):
            raise ConfigError(
                "leto.rmu_fused needs float32 parameters (master weights); set rmu_fused: false"
            )
        from triton_kernels import adamw_rmu

        if adamw_rmu.BLOCK != BLOCK:
            raise ProtocolError(
                "triton_kernels.adamw_rmu.BLOCK and leto.updater.fused.BLOCK differ"
            )
        self._launcher_for = adamw_rmu.ChunkLauncher
        self.parity_reads_undo = parity_reads_undo
        self.discard = drops_undo(state.device, parity_reads_undo)
        self.flag_nbytes = flag_bytes(chunks)
        self._undo_nbytes = max(c.undo_bytes for c in chunks)
        self.state = state
        self.state_f = _f32(state)
        self.grads_f = _f32(grads)
        self.grad_scale = None if layout.grad_scale is None else layout.grad_scale.view(grads)
        """The retained factor the kernel multiplies every gradient by (``Layout.grad_scale``),
        written by the trainer before GRADS_READY; None where an integration placed the
        gradients (they arrive clipped, and the factor is 1)."""
        self._scale = (
            torch.ones((), dtype=torch.float32, device=state.device)
            if self.grad_scale is None
            else self.grad_scale
        ).view(-1)
        self.plans = [self._plan(layout, c) for c in chunks]
        self._gaps = [_GapMoves.of(plan.gaps, state.device) for plan in self.plans]
        self.tables = [
            adamw_rmu.PieceTable.build(
                [(pc.offsets, pc.n, pc.flag_base, pc.param) for pc in plan.pieces], state.device
            )
            for plan in self.plans
        ]
        self._scalars = _StepScalars(len(layout.params), adamw_rmu.SCALAR_FIELDS, state.device)
        self._row = adamw_rmu.scalar_row
        self._skip_row = (0.0,) * 6 + (1.0, 1.0, adamw_rmu.SKIP)
        self._index: tuple[tuple[int, ...] | None, torch.Tensor] = (None, torch.empty(0))
        """The last update's row of each parameter in the scalar table, and as a tensor."""
        self.bind(undo)

    def bind(self, undo: torch.Tensor) -> None:
        """Use ``undo`` (undo image, then the progress flags at its end)."""
        data_nbytes = undo.numel() - self.flag_nbytes
        if data_nbytes < self._undo_nbytes:
            raise ProtocolError("the undo region is too small for the fused path's progress flags")
        self.undo_bytes = undo
        self.undo_f = _f32(undo[:data_nbytes])
        both = undo[data_nbytes : data_nbytes + self.flag_nbytes].view(torch.int64)
        self.flags, self.done = both.chunk(2)
        """Per block of a chunk: its undo words saved, its new values stored (the token)."""
        self._launcher = self._launcher_for(
            self.state_f,
            self.grads_f,
            self._scale,
            self.undo_f,
            self.flags,
            self.done,
            self._scalars.table,
        )

    @staticmethod
    def _plan(layout: Layout, chunk: Chunk) -> _ChunkPlan:
        starts, pos = [], 0
        for off, n in chunk.spans:
            starts.append((off, n, pos))
            pos += n

        def undo_at(x: int) -> int:
            for off, n, p in starts:
                if off <= x < off + n:
                    return p + x - off
            raise ProtocolError(f"state byte {x} is outside chunk {chunk.index}'s spans")

        pieces, covered, flag = [], [], 0
        for pc in chunk.pieces:
            i, n = pc.param, pc.hi - pc.lo
            slots = (layout.params[i], layout.optim[i]["exp_avg"], layout.optim[i]["exp_avg_sq"])
            byte = [s.offset + 4 * pc.lo for s in slots]
            covered += [(b, 4 * n) for b in byte]
            undo = [undo_at(b) for b in byte]
            g = layout.grads[i].offset + 4 * pc.lo
            offs = (*(b // 4 for b in byte), g // 4, *(u // 4 for u in undo))
            pieces.append(_PiecePlan(i, n, offs, flag))  # type: ignore[arg-type]
            flag += _blocks(n)
        gaps = []
        for off, n, p in starts:
            cursor = off
            for b, nb in sorted(c for c in covered if off <= c[0] < off + n):
                if b > cursor:
                    gaps.append((cursor, p + cursor - off, b - cursor))
                cursor = max(cursor, b + nb)
            if cursor < off + n:
                gaps.append((cursor, p + cursor - off, off + n - cursor))
        return _ChunkPlan(tuple(pieces), tuple(gaps), flag)

    def clear_flags(self) -> None:
        """Before an update's first chunk: no flag holds a token of it (the region may have
        held activations since the last update)."""
        self.flags.zero_()
        self.done.zero_()

    def save_gaps(self, j: int) -> None:
        self._gaps[j].save(self.state, self.undo_bytes)

    def begin(
        self,
        hypers: list[AdamWHyper],
        group_of: list[int],
        steps: list[float],
        skipped: frozenset[int] = frozenset(),
    ) -> None:
        """The scalars of the next update: ``steps`` are each parameter's step count in it
        (post-increment), ``group_of`` its parameter group; ``skipped`` parameters keep
        their values (``adamw_rmu.SKIP``)."""
        keys = [
            (-1, 0.0) if i in skipped else k
            for i, k in enumerate(zip(group_of, steps, strict=True))
        ]
        rows = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        values = []
        for g, s in rows:
            if g < 0:
                values.append(self._skip_row)
                continue
            h = hypers[g]
            values.append(
                self._row(
                    lr=h.lr,
                    beta1=h.beta1,
                    beta2=h.beta2,
                    eps=h.eps,
                    weight_decay=h.weight_decay,
                    decoupled=h.decoupled,
                    step=s,
                )
            )
        table = torch.tensor(values, dtype=torch.float64).to(torch.float32)
        index = tuple(rows[k] for k in keys)
        if index != self._index[0]:  # which row each parameter reads: the same most steps
            self._index = (index, torch.tensor(index, dtype=torch.int64))
        self._scalars.write(table[self._index[1]])

    def apply(self, j: int, step: int, *, keep_undo: bool = False) -> None:
        """The kernel over chunk ``j`` (one launch), with the scalars of the last :meth:`begin`
        (the launcher :meth:`bind` made checked the operands once); ``keep_undo`` leaves the
        chunk's whole undo image in place (for :meth:`abort`)."""
        discard = self.discard and not keep_undo
        self._launcher.launch(self.tables[j], fused_token(step, j), discard)

    def restore(self, j: int, step: int) -> None:
        """Undo chunk ``j`` of step ``step`` after a kill inside it: the gaps, and the element
        blocks the launch after this must redo (see the module's docstring)."""
        plan = self.plans[j]
        self._gaps[j].restore(self.state, self.undo_bytes)
        token = fused_token(step, j)
        for pc in plan.pieces:
            blocks = slice(pc.flag_base, pc.flag_base + _blocks(pc.n))
            back = self.flags[blocks] == token
            if self.parity_reads_undo:
                self.done[blocks] = 0
            else:
                back &= self.done[blocks] != token
            mask = back.repeat_interleave(BLOCK)[: pc.n]
            for k in range(3):
                dst = self.state_f[pc.offsets[k] : pc.offsets[k] + pc.n]
                src = self.undo_f[pc.offsets[4 + k] : pc.offsets[4 + k] + pc.n]
                dst.copy_(torch.where(mask, src, dst))

    def abort(self, j: int, seed: int) -> None:
        """Leave chunk ``j`` as a kernel killed halfway would (for fault injection), from a
        launch that kept its undo image: blocks past the middle never ran (old data, stale
        undo, no flags), the block before it saved its undo but its new values are torn (no
        done flag), and the blocks before that are done (where the kernel drops a done
        block's undo words, its undo image is stale too)."""
        gen = torch.Generator().manual_seed(seed)
        plan = self.plans[j]
        cut = plan.blocks // 2
        for pc in plan.pieces:
            for b in range(_blocks(pc.n)):
                f = pc.flag_base + b
                lo, hi = b * BLOCK, min(pc.n, (b + 1) * BLOCK)
                for k in range(3):
                    data = self.state_f[pc.offsets[k] + lo : pc.offsets[k] + hi]
                    undo = self.undo_f[pc.offsets[4 + k] + lo : pc.offsets[4 + k] + hi]
                    if f >= cut:
                        data.copy_(undo)
                    elif f == cut - 1:
                        data.copy_(torch.randn(hi - lo, generator=gen))
                    if f >= cut or (f < cut - 1 and not self.parity_reads_undo):
                        undo.copy_(torch.randn(hi - lo, generator=gen))
                if f >= cut:
                    self.flags[f] = 0
                if f >= cut - 1:
                    self.done[f] = 0


class _StepScalars:
    """The kernel's per-parameter scalars (``adamw_rmu.scalar_row``) on the device, written
    once per update without waiting for the device: on CUDA from one of two pinned host
    buffers, each refilled only after the copy out of it has run."""

    def __init__(self, params: int, fields: int, device: torch.device) -> None:
        self.table = torch.zeros(max(params, 1), fields, dtype=torch.float32, device=device)
        cuda = device.type == "cuda"
        self._host = (
            [torch.zeros_like(self.table, device="cpu").pin_memory() for _ in range(2)]
            if cuda
            else []
        )
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._next = 0

    def write(self, rows: torch.Tensor) -> None:
        if not self._host:
            self.table[: rows.shape[0]].copy_(rows)
            return
        k, self._next = self._next, 1 - self._next
        done = self._copied[k]
        if done is not None:
            done.synchronize()  # the copy of two updates ago: long finished
        self._host[k][: rows.shape[0]].copy_(rows)
        self.table.copy_(self._host[k], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[k] = event


@dataclass(frozen=True, slots=True)
class _GapMoves:
    """How a chunk's gaps travel between the state region and the undo image: those of at
    most ``GATHERED_GAP_BYTES`` by byte indices (one gather and one scatter), the rest as
    ``(state offset, undo offset, nbytes)`` copies."""

    state_index: torch.Tensor | None
    undo_index: torch.Tensor | None
    copies: tuple[tuple[int, int, int], ...]

    @staticmethod
    def of(gaps: tuple[tuple[int, int, int], ...], device: torch.device) -> _GapMoves:
        small = [(s, u, n) for s, u, n in gaps if n <= GATHERED_GAP_BYTES]
        copies = tuple((s, u, n) for s, u, n in gaps if n > GATHERED_GAP_BYTES)
        if not small:
            return _GapMoves(None, None, copies)
        state = torch.cat([torch.arange(s, s + n) for s, _, n in small]).to(device)
        undo = torch.cat([torch.arange(u, u + n) for _, u, n in small]).to(device)
        return _GapMoves(state, undo, copies)

    def save(self, state: torch.Tensor, undo: torch.Tensor) -> None:
        if self.state_index is not None and self.undo_index is not None:
            undo.index_copy_(0, self.undo_index, state.index_select(0, self.state_index))
        for s, u, n in self.copies:
            undo[u : u + n].copy_(state[s : s + n])

    def restore(self, state: torch.Tensor, undo: torch.Tensor) -> None:
        if self.state_index is not None and self.undo_index is not None:
            state.index_copy_(0, self.state_index, undo.index_select(0, self.undo_index))
        for s, u, n in self.copies:
            state[s : s + n].copy_(undo[u : u + n])


def _f32(t: torch.Tensor) -> torch.Tensor:
    if t.numel() % 4:
        t = t[: t.numel() // 4 * 4]
    return t.view(torch.float32)
