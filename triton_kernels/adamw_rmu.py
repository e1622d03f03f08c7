"""Triton kernel: one RMU chunk in one launch — undo copy, progress flag, AdamW in place.

The unfused RMU path (``leto.updater.rmu`` with ``fused=False``) copies a chunk's bytes to
the undo buffer, then runs torch's foreach AdamW ops over it: about eight passes over
param / exp_avg / exp_avg_sq. This kernel reads param, grad, exp_avg and exp_avg_sq once
and writes the undo copy and the new values once (10 words per element instead of ~30).
It scales each gradient by a retained factor as it reads it (the clipping coefficient,
``leto.retained.layout.Layout.grad_scale``), so clipping costs the norm alone.
Its pure-PyTorch reference is ``leto.updater.adamw.adamw_pieces`` plus the undo copy.

One launch covers every piece of a chunk (a slice of one parameter), so a step costs the
host one launch per chunk, not one per parameter. What the launch needs is in two device
tables built once, at planning (:class:`PieceTable`: each piece's element offsets and
length, and the piece of each program, 4 bytes per 1024 elements), and one refreshed once
per step (:func:`scalar_rows`: each parameter's lr-, step- and group-dependent scalars).

Crash consistency. The marker says CHUNK_SAVED before the kernel starts, but the kernel
writes the undo copy as it goes, so after a kill some blocks' undo slots still hold an
older chunk. Each program therefore stores its block's undo words, then (barrier, one
``acq_rel`` atomic, barrier) sets ``flags[pid] = token``, then stores the new values, and
after them (barrier, atomic, barrier) sets ``done[pid] = token``. A block without the first
flag was never modified; one with both holds its new values; one with the first flag alone
is torn, and its undo words restore it (``leto.updater.fused.FusedChunks.restore``). A
launch skips the blocks whose ``done`` flag already holds its token, so launching a chunk
again after a restore finishes it without applying any block twice.

``DISCARD``: once a block's ``done`` flag is set its undo words are dead, so the kernel
invalidates their L2 lines (PTX ``discard.global.L2``, no write-back). They were written a
few microseconds before, and most are still in the L2, so most of the undo copy never
reaches the memory: the kernel then moves little more than torch's fused AdamW (7 words per
element) instead of 10. Only where nothing reads the undo image after the chunk (no erasure
parity to fold from it; ``leto.updater.rmu``).

The parity delta is not materialised: the GF(2^16) update kernel (``gf16_mac``) reads the
undo copy and the new state and XORs them itself.

Arithmetic. The ops and their association are those of torch's CUDA foreach AdamW
(``lerp`` with weight < 0.5 as ``m + w (g - m)``, ``addcmul`` as ``v + c (g g)``,
``addcdiv`` as ``p + s (m / d)``), with IEEE-rounded sqrt and division and scalars
computed in Python doubles and rounded to fp32 as torch's opmath does; whether the compiler
contracts a multiply-add into an FMA may still differ from torch's build, so fused and
unfused agree to a few ulps, not always bit for bit. Recovery only needs the fused path to
agree with itself, which it does: the kernel is element-wise and deterministic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.compiler import CompiledKernel
from triton.runtime.jit import mangle_type

BLOCK = 1024
"""Elements per program; also the granularity of the restore (one flag per block)."""
NUM_WARPS = 4
VECTOR = 4
"""float32 elements per 16-byte access: a chunk whose pieces' offsets and lengths are all
multiples of it is launched with ``ALIGN = VECTOR`` (vector loads and stores), any other with 1."""
PIECE_FIELDS = 10
"""A piece's row in :class:`PieceTable`: element offsets of param, exp_avg, exp_avg_sq in the
state region, of the gradient, of the undo copies of param, exp_avg, exp_avg_sq; its length;
its first program (and flag); its parameter (row of the scalar table)."""
SCALAR_FIELDS = 9
"""A parameter's row of :func:`scalar_rows`: decay, l2 weight decay, 1 - beta1, beta2,
1 - beta2, step size, sqrt of the second bias correction, eps, and the weight-decay mode
(0 none, 1 decoupled, 2 L2 in the gradient; ``SKIP``: the parameter is left unchanged)."""
SKIP = 3.0
"""The mode of a parameter this update skips (no gradient on any rank): its old values are
saved and flagged as any piece's, and nothing new is stored."""

_PF: tl.constexpr = tl.constexpr(PIECE_FIELDS)
_SF: tl.constexpr = tl.constexpr(SCALAR_FIELDS)


@triton.jit
def _publish(flag, token):
    """``*flag = token`` once every thread's stores before it are visible, and before any
    thread's memory operation after it (barrier, one ``acq_rel`` atomic, barrier)."""
    tl.debug_barrier()
    tl.atomic_xchg(flag, token, sem="acq_rel")
    tl.debug_barrier()


@triton.jit
def _discard_l2(ptrs, whole):
    """Invalidate, without write-back, the 128-byte L2 line at each of ``ptrs`` that starts a
    line and where ``whole`` (the line lies inside the block's own undo words)."""
    addr = ptrs.to(tl.int64, bitcast=True)
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred p;
        setp.ne.u32 p, $2, 0;
        @p discard.global.L2 [$1], 128;
        mov.u32 $0, 0;
        }""",
        constraints="=r,l,r",
        args=[addr, (whole & (addr % 128 == 0)).to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit(do_not_specialize=["token"])
def _adamw_chunk_kernel(
    state_ptr,
    grad_ptr,
    scale_ptr,
    undo_ptr,
    flag_ptr,
    done_ptr,
    piece_ptr,
    block_ptr,
    scalar_ptr,
    token,
    ALIGN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DISCARD: tl.constexpr,
):
    pid = tl.program_id(0)
    row = piece_ptr + tl.load(block_ptr + pid).to(tl.int64) * _PF
    p_off = tl.load(row)
    m_off = tl.load(row + 1)
    v_off = tl.load(row + 2)
    g_off = tl.load(row + 3)
    up_off = tl.load(row + 4)
    um_off = tl.load(row + 5)
    uv_off = tl.load(row + 6)
    # a block an earlier launch of this chunk finished has nothing left to do
    n = tl.load(row + 7) * (tl.load(done_ptr + pid) != token).to(tl.int64)
    first = tl.load(row + 8)
    sc = scalar_ptr + tl.load(row + 9) * _SF
    if ALIGN > 1:  # every offset and n are multiples of ALIGN (the planner checked): 16-byte
        # vector loads and stores need the compiler to know it, which it infers from these
        p_off = p_off // ALIGN * ALIGN
        m_off = m_off // ALIGN * ALIGN
        v_off = v_off // ALIGN * ALIGN
        g_off = g_off // ALIGN * ALIGN
        up_off = up_off // ALIGN * ALIGN
        um_off = um_off // ALIGN * ALIGN
        uv_off = uv_off // ALIGN * ALIGN
        n = n // ALIGN * ALIGN
    idx = (pid - first) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    ok = idx < n
    p = tl.load(state_ptr + p_off + idx, mask=ok, other=0.0)
    m = tl.load(state_ptr + m_off + idx, mask=ok, other=0.0)
    v = tl.load(state_ptr + v_off + idx, mask=ok, other=0.0)
    g = tl.load(grad_ptr + g_off + idx, mask=ok, other=0.0) * tl.load(scale_ptr)
    tl.store(undo_ptr + up_off + idx, p, mask=ok)
    tl.store(undo_ptr + um_off + idx, m, mask=ok)
    tl.store(undo_ptr + uv_off + idx, v, mask=ok)
    _publish(flag_ptr + pid, token)  # the undo words, before any new value
    mode = tl.load(sc + 8)
    if mode == 1.0:  # AdamW: decoupled decay
        p = p * tl.load(sc)
    elif mode == 2.0:  # Adam: L2 penalty in the gradient
        g = g + tl.load(sc + 1) * p
    m = m + tl.load(sc + 2) * (g - m)
    v = v * tl.load(sc + 3)
    v = v + tl.load(sc + 4) * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), tl.load(sc + 6)) + tl.load(sc + 7)
    p = p + tl.load(sc + 5) * tl.div_rn(m, denom)
    new = ok
    if mode == 3.0:  # SKIP: nothing new is stored
        new = idx < 0
    tl.store(state_ptr + m_off + idx, m, mask=new)
    tl.store(state_ptr + v_off + idx, v, mask=new)
    tl.store(state_ptr + p_off + idx, p, mask=new)
    _publish(done_ptr + pid, token)  # the new values, before the undo words are dropped
    if DISCARD:
        whole = ok & (idx + 31 < tl.minimum(n, (pid - first + 1) * BLOCK_SIZE))
        _discard_l2(undo_ptr + up_off + idx, whole)
        _discard_l2(undo_ptr + um_off + idx, whole)
        _discard_l2(undo_ptr + uv_off + idx, whole)


def num_blocks(n: int) -> int:
    """Programs (and flags) for a piece of ``n`` elements."""
    return triton.cdiv(n, BLOCK)


@dataclass(frozen=True, slots=True)
class PieceTable:
    """The pieces of one chunk as the kernel reads them, on the device."""

    pieces: torch.Tensor
    """int64 ``[pieces, PIECE_FIELDS]``."""
    blocks: torch.Tensor
    """int32 ``[programs]``: the piece each program works on."""
    align: int

    @classmethod
    def build(
        cls,
        pieces: Sequence[tuple[tuple[int, ...], int, int, int]],
        device: torch.device,
    ) -> PieceTable:
        """``pieces`` = ``(offsets, n, first_block, param)`` each (fields of ``PIECE_FIELDS``),
        with first blocks consecutive from 0."""
        rows, owner, at = [], [], 0
        for k, (offsets, n, first, param) in enumerate(pieces):
            if len(offsets) != 7 or n <= 0 or first != at:
                raise ValueError(f"piece {k}: need 7 offsets, n > 0 and first block {at}")
            rows.append([*offsets, n, first, param])
            owner += [k] * num_blocks(n)
            at += num_blocks(n)
        aligned = all(x % VECTOR == 0 for r in rows for x in r[:8])
        return cls(
            torch.tensor(rows, dtype=torch.int64).reshape(-1, PIECE_FIELDS).to(device),
            torch.tensor(owner, dtype=torch.int32).to(device),
            VECTOR if aligned else 1,
        )

    @property
    def programs(self) -> int:
        return self.blocks.numel()


def scalar_row(
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    step: float,
) -> tuple[float, ...]:
    """One parameter's row of the scalar table (``SCALAR_FIELDS``), in doubles as torch's
    foreach AdamW computes them; ``step`` is the post-increment count."""
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    mode = 0.0 if weight_decay == 0 else (1.0 if decoupled else 2.0)
    return (
        1 - lr * weight_decay,
        weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        -(lr / bc1),
        bc2**0.5,
        eps,
        mode,
    )


def check_operands(
    state: torch.Tensor,
    grads: torch.Tensor,
    scale: torch.Tensor,
    undo: torch.Tensor,
    flags: torch.Tensor,
    done: torch.Tensor,
) -> None:
    """``TypeError`` unless the operands are what :func:`adamw_chunk` launches on."""
    for name, t, dt in (
        ("state", state, torch.float32),
        ("grads", grads, torch.float32),
        ("scale", scale, torch.float32),
        ("undo", undo, torch.float32),
        ("flags", flags, torch.int64),
        ("done", done, torch.int64),
    ):
        if t.dtype != dt or t.dim() != 1:
            raise TypeError(f"{name} must be a flat {dt} view, got {t.dtype} {tuple(t.shape)}")


def adamw_chunk(
    state: torch.Tensor,
    grads: torch.Tensor,
    scale: torch.Tensor,
    undo: torch.Tensor,
    flags: torch.Tensor,
    done: torch.Tensor,
    table: PieceTable,
    scalars: torch.Tensor,
    token: int,
    discard: bool = False,
) -> object:
    """AdamW on every piece of ``table``, saving their old values first, in one launch.

    ``state``/``grads``/``undo`` are flat float32 views, ``flags`` and ``done`` flat int64
    (one per program of the chunk: undo saved, new values stored; blocks whose ``done``
    holds ``token`` are left alone), ``discard`` drops the undo words from the L2 once a
    block is done (``DISCARD`` above: nothing may read them after), ``scalars`` float32 ``[parameters, SCALAR_FIELDS]`` on the device.
    Every gradient is multiplied by the float32 scalar ``scale`` (flat, one element) as it
    is read (the clipping coefficient: torch's ``clip_grad_norm_`` multiplies the gradients
    by it in place, a pass over them that this saves; the product is the same float32
    multiply). Only the launch: a caller checks its operands once with
    :func:`check_operands` (a step launches a chunk after another over the same ones).
    Returns what Triton's JIT launch returned (the ``CompiledKernel``; None under the
    interpreter or for an empty table), which :class:`ChunkLauncher` keeps.
    """
    if table.programs == 0:
        return None
    return _adamw_chunk_kernel[(table.programs,)](
        state,
        grads,
        scale,
        undo,
        flags,
        done,
        table.pieces,
        table.blocks,
        scalars,
        token,
        ALIGN=table.align,
        BLOCK_SIZE=BLOCK,
        DISCARD=discard,
        num_warps=NUM_WARPS,
    )


class ChunkLauncher:
    """:func:`adamw_chunk` over operands fixed for many launches (a step's chunks, step after
    step), each launch after a table's first one straight through Triton's compiled kernel.

    Triton's JIT launch binds the arguments, computes their specialisation key and looks the
    kernel up on every call: tens of microseconds of host time, a step's chunks' worth of it
    on a host-bound step. Here the operands are fixed, so the specialisation of a table's
    launch changes only with the token's integer width (``mangle_type``: i32, then i64
    from step 256) and ``discard``; the compiled kernel that the JIT's launch returned is
    kept per table, width and ``discard`` and launched itself (``CompiledKernel[grid]``). Under Triton's interpreter there is
    none, and every launch goes through the JIT. Make a new launcher for new operands."""

    def __init__(
        self,
        state: torch.Tensor,
        grads: torch.Tensor,
        scale: torch.Tensor,
        undo: torch.Tensor,
        flags: torch.Tensor,
        done: torch.Tensor,
        scalars: torch.Tensor,
    ) -> None:
        check_operands(state, grads, scale, undo, flags, done)
        self._operands = (state, grads, scale, undo, flags, done)
        self._scalars = scalars
        self._compiled: dict[tuple[int, str, bool], tuple[PieceTable, Callable[..., object]]] = {}

    def launch(self, table: PieceTable, token: int, discard: bool = False) -> None:
        """The kernel over ``table``'s pieces with flag ``token`` (one launch)."""
        key = (id(table), mangle_type(token), discard)
        cached = self._compiled.get(key)
        if cached is not None and cached[0] is table:  # the table held: its id is not reused
            args = (table.pieces, table.blocks, self._scalars, token, table.align, BLOCK, discard)
            cached[1](*self._operands, *args)
            return
        compiled = adamw_chunk(*self._operands, table, self._scalars, token, discard)
        if isinstance(compiled, CompiledKernel):
            self._compiled[key] = (table, compiled[(table.programs, 1, 1)])


def warm_up(device: torch.device, launches: Iterable[tuple[int, int, bool]]) -> int:
    """Compile and load the specialisations that :func:`adamw_chunk` would launch.

    Each of ``launches`` is ``(align, token, discard)``: Triton keys a launch by its
    constexprs (``ALIGN``, from the chunk's divisibility; ``DISCARD``) and by the width of its integer argument
    (the flag token ``(step << 23) + chunk + 1`` passes 2**31 at step 256: i32 below, i64
    above). One launch per distinct key, on scratch memory of ``device``, over a one-piece
    table with nothing to do but set a scratch flag. Returns the number of launches.
    """
    scratch = torch.zeros(BLOCK, dtype=torch.float32, device=device)
    flags = torch.zeros(1, dtype=torch.int64, device=device)
    scalars = torch.zeros(SCALAR_FIELDS, dtype=torch.float32, device=device)
    scalars[6:8] = 1.0  # the denominators: masked lanes compute 0 / 1, not 0 / 0
    seen: set[tuple[object, ...]] = set()
    for align, token, discard in launches:
        key = (align, mangle_type(token), discard)
        if key in seen:
            continue
        seen.add(key)
        empty = PieceTable(
            torch.zeros(PIECE_FIELDS, dtype=torch.int64, device=device),  # n = 0: all masked
            torch.zeros(1, dtype=torch.int32, device=device),
            align,
        )
        check_operands(scratch, scratch, scratch[:1], scratch, flags, flags)
        adamw_chunk(
            scratch, scratch, scratch[:1], scratch, flags, flags, empty, scalars, token, discard
        )
    return len(seen)
