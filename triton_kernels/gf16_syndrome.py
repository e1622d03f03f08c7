"""Triton kernel: incremental update of GF(2^16) RS *syndromes* by Horner's rule.

The updater keeps its device working parity as the syndromes of the tier-1 code
(``leto.erasure.rs.GRSCode``): ``S_p = sum_j a^(e_p j) d_j`` for ``p < H``, on the rows
``e_p = b + p`` centred on 0 (``b = leto.erasure.rs.first_row(H)``, -7 for H = 16), ``a``
the primitive element. A chunk that changes bytes ``[lo, hi)`` of the ``k`` consecutive
pages ``j0 .. j0 + k - 1`` of a group changes syndrome ``p`` by

    dS_p = a^(e_p j0) * sum_i (a^e_p)^i * (old_(j0+i) ^ new_(j0+i))
         = a^(e_p j0) * Horner_(a^e_p)(delta_(j0+k-1), ..., delta_(j0))

Why this and not the generic kernel (``gf16_mac``): there every page costs a 16x16 GF(2)
matrix product per parity page (256 AND-XOR per 32 symbols; H = 16 makes that 64 lane-ops
per changed byte and the update compute-bound beyond 2-page chunks, docs/ERASURE.md). Here
the multiplier of the Horner step is the *compile-time* constant ``a^e_p``, and in the
bit-sliced layout multiplying by ``a`` or by ``a^-1`` is a rotation of the 16 planes plus
three XORs (``x^16 = x^12 + x^3 + x + 1``). So a page costs ``sum_p (3 |e_p| + 16)`` =
448 XORs per 32 symbols for H = 16 on the rows -7 .. 8 (616 on the rows 0 .. 15; about 7
lane-ops per changed byte instead of 64), and the generic product is paid once per chunk,
for the scale ``a^(e_p j0)``: Horner over the 16 bits of that runtime constant (one
scalar per syndrome from a ``[D, 16]`` table), a rolled loop.

The same kernel encodes (``old=None``: the syndromes of the pages themselves, then
``P = W^-1 S``) and gives the survivors' syndromes for the device rebuild
(``leto.erasure.group.ProtectionGroup._rebuild_t1_by_syndromes``).

Layout of the work: each program holds 8 syndromes ("halves", 16 planes each: 128
registers of accumulators) for one column of 32 symbols per thread, and H = 16 runs as two
halves in one launch, the half being the fastest grid axis so both read a delta while it
is in L2; 4 per program (quarters) is the other choice. Two choices decide the speed
(bench/syndrome_gpu.py --sweep; the numbers are in BENCHMARKS.md):

* The parts are *balanced*. Multiplying by ``a^e`` costs ~3|e| XORs, so with syndromes in
  order the cheap parts run ahead of the expensive ones and the later ones read each delta
  from DRAM again; mirrored pairs (:func:`_part`) cost the same per part (on the rows
  -7 .. 8, 96 XORs of multiplies per page and column for either half) and read it in step.
* The parity's loads are in flight before the scale's loop (:func:`_scale_store`): all
  programs reach the epilogue together, and waiting on the loads there costs a fixed time
  per launch.

How the constant multiply compiles: the 16 planes are a tuple of 1-D ``[BLOCK]`` tensors
and :func:`_times_alpha` renames them and XORs the top plane into the feedback taps, so it
is three XORs by construction, whatever layout Triton picks (a ``[16, BLOCK]`` tensor of
planes may be spread across threads, turning every multiply into shuffles). The scale is a
rolled loop: unrolled, its mask loads make the kernel take minutes to compile.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

TUNING = {"block": 64, "num_warps": 2, "acc": 8}
"""Columns (32-symbol words) per program, warps per program (one column per thread) and
syndromes per program (8: halves; 4: quarters): the fastest shape of bench/syndrome_gpu.py
--sweep on an H200 (BENCHMARKS.md). Halves read each delta twice from L2 instead of four
times and fit in registers without spills. ``LETO_SYNDROME_TUNING=BLOCKxWARPSxACC``
overrides it."""
if os.environ.get("LETO_SYNDROME_TUNING"):
    TUNING.update(zip(TUNING, (int(v) for v in os.environ["LETO_SYNDROME_TUNING"].split("x"))))
MAX_PARITY = 16
"""Syndromes per launch: two halves of 8 accumulators, or four quarters of 4."""
_SCALE_WORDS = tl.constexpr(MAX_PARITY)
"""Constants per ``j0`` in the scale table (``a^(p j0)`` for 16 syndromes)."""


@triton.jit
def _times_alpha(x):
    """``a * x`` on 16 bit planes (a tuple of ``[BLOCK]`` words): y[i] = x[i-1], and x[15]
    (the x^16 overflow, x^16 = x^12 + x^3 + x + 1) feeds bits 0, 1, 3 and 12."""
    t = x[15]
    return (
        t,
        x[0] ^ t,
        x[1],
        x[2] ^ t,
        x[3],
        x[4],
        x[5],
        x[6],
        x[7],
        x[8],
        x[9],
        x[10],
        x[11] ^ t,
        x[12],
        x[13],
        x[14],
    )


@triton.jit
def _times_alpha_inv(x):
    """``a^-1 * x``: y[i] = x[i+1], and x[0] (the bit a division by ``x`` shifts out, made
    even by adding the polynomial first) feeds bits 15, 0, 2 and 11."""
    t = x[0]
    return (
        x[1] ^ t,
        x[2],
        x[3] ^ t,
        x[4],
        x[5],
        x[6],
        x[7],
        x[8],
        x[9],
        x[10],
        x[11],
        x[12] ^ t,
        x[13],
        x[14],
        x[15],
        t,
    )


@triton.jit
def _times_alpha_pow(x, E: tl.constexpr):
    """``a^E * x`` for a compile-time ``E`` of either sign: ``3 |E|`` XORs."""
    if E >= 0:
        for _ in tl.static_range(E):
            x = _times_alpha(x)
    else:
        for _ in tl.static_range(-E):
            x = _times_alpha_inv(x)
    return x


@triton.jit
def _xor(a, b):
    return (
        a[0] ^ b[0],
        a[1] ^ b[1],
        a[2] ^ b[2],
        a[3] ^ b[3],
        a[4] ^ b[4],
        a[5] ^ b[5],
        a[6] ^ b[6],
        a[7] ^ b[7],
        a[8] ^ b[8],
        a[9] ^ b[9],
        a[10] ^ b[10],
        a[11] ^ b[11],
        a[12] ^ b[12],
        a[13] ^ b[13],
        a[14] ^ b[14],
        a[15] ^ b[15],
    )


@triton.jit
def _load_planes(ptr, off, ok):
    """The 16 planes of a range of 32-symbol columns (plane ``b`` is 32 words after ``b - 1``)."""
    return (
        tl.load(ptr + off + 0 * 32, mask=ok, other=0),
        tl.load(ptr + off + 1 * 32, mask=ok, other=0),
        tl.load(ptr + off + 2 * 32, mask=ok, other=0),
        tl.load(ptr + off + 3 * 32, mask=ok, other=0),
        tl.load(ptr + off + 4 * 32, mask=ok, other=0),
        tl.load(ptr + off + 5 * 32, mask=ok, other=0),
        tl.load(ptr + off + 6 * 32, mask=ok, other=0),
        tl.load(ptr + off + 7 * 32, mask=ok, other=0),
        tl.load(ptr + off + 8 * 32, mask=ok, other=0),
        tl.load(ptr + off + 9 * 32, mask=ok, other=0),
        tl.load(ptr + off + 10 * 32, mask=ok, other=0),
        tl.load(ptr + off + 11 * 32, mask=ok, other=0),
        tl.load(ptr + off + 12 * 32, mask=ok, other=0),
        tl.load(ptr + off + 13 * 32, mask=ok, other=0),
        tl.load(ptr + off + 14 * 32, mask=ok, other=0),
        tl.load(ptr + off + 15 * 32, mask=ok, other=0),
    )


@triton.jit
def _fetch(new_ptr, old_ptr, page, new_stride, old_stride, off, ok, HAS_OLD: tl.constexpr):
    """Issue the loads of one page's delta and return them unreduced (``(new, old)``), so
    that the XOR, the first use, sits in a later iteration and the loads stay in flight
    across the loop's back edge."""
    x = _load_planes(new_ptr + page * new_stride, off, ok)
    if HAS_OLD:
        return (x, _load_planes(old_ptr + page * old_stride, off, ok))
    return (x, x)  # an encode: the pages themselves (one type for both branches, Triton 3.6)


@triton.jit
def _reduce(raw, HAS_OLD: tl.constexpr):
    if HAS_OLD:
        return _xor(raw[0], raw[1])
    return raw[0]


@triton.jit
def _and(a, m):
    return (
        a[0] & m,
        a[1] & m,
        a[2] & m,
        a[3] & m,
        a[4] & m,
        a[5] & m,
        a[6] & m,
        a[7] & m,
        a[8] & m,
        a[9] & m,
        a[10] & m,
        a[11] & m,
        a[12] & m,
        a[13] & m,
        a[14] & m,
        a[15] & m,
    )


@triton.jit
def _scale_store(
    acc,
    p: tl.constexpr,
    n_par,
    scale_ptr,
    q_in,
    q_out,
    q_base,
    q_stride,
    off,
    ok,
    HAS_QIN: tl.constexpr,
    B: tl.constexpr,
):
    """``q_out[p] = q_in[p] ^ c_p * acc`` for the runtime constant ``c_p = scale_ptr[p]``.

    The 16 loads of ``q_in[p]`` are issued first, so they are in flight during the multiply
    (issued after it, every program of the launch waits on them in step, a fixed cost per
    launch). The multiply is Horner over
    the bits of ``c_p`` from the top (``y = a y``, then ``y ^= acc`` where the bit is set):
    the bit is the same in every thread, so it is a branch, not a mask, ~176 XORs per
    syndrome and column; a rolled loop (the unrolled form, 256 mask loads, took minutes to
    compile)."""
    base = q_base + p * q_stride
    if p < n_par:
        if HAS_QIN:
            q = _load_planes(q_in + base, off, ok)
        if p + B == 0:  # row 0: a^0 = 1
            y = acc
        else:
            c = tl.load(scale_ptr + p)
            y = _and(acc, 0)
            for b in tl.range(0, 16, loop_unroll_factor=1):
                y = _times_alpha(y)
                if ((c >> (15 - b)) & 1) != 0:
                    y = _xor(y, acc)
        if HAS_QIN:
            y = _xor(y, q)
        for i in tl.static_range(16):
            tl.store(q_out + base + off + i * 32, y[i], mask=ok)


@triton.jit
def _part(
    new_ptr,
    old_ptr,
    new_stride,
    old_stride,
    k,
    scale_ptr,
    q_in,
    q_out,
    q_base,
    q_stride,
    n_par,
    off,
    ok,
    PART: tl.constexpr,
    BLOCK: tl.constexpr,
    MATH: tl.constexpr,
    ACC: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_QIN: tl.constexpr,
    BAL: tl.constexpr,
    B: tl.constexpr,
):
    """Syndromes ``S0 .. S(ACC-1)`` (ACC = 4 or 8) of the program's columns: Horner over the
    k pages. Part ``PART`` takes syndromes ``PART * ACC ...`` in order, or with ``BAL`` (all
    16 syndromes launched) mirrored pairs ``G*b + PART, G*b + G-1-PART`` (``G = 32 / ACC``):
    multiplying by ``a^e`` (``e = S + B``, ``B`` the code's first row) costs 3|e| XORs, so
    on the rows -7 .. 8 in order the quarters' multiplies take 66 / 18 / 30 / 78 XORs per
    page and column and the parts drift apart, the later ones reading each delta from DRAM
    again; balanced, 48 each, and they read it in step."""
    G: tl.constexpr = 32 // ACC
    if BAL:
        S0: tl.constexpr = PART
        S1: tl.constexpr = G - 1 - PART
        S2: tl.constexpr = G + PART
        S3: tl.constexpr = 2 * G - 1 - PART
        S4: tl.constexpr = 2 * G + PART
        S5: tl.constexpr = 3 * G - 1 - PART
        S6: tl.constexpr = 3 * G + PART
        S7: tl.constexpr = 4 * G - 1 - PART
    else:
        S0: tl.constexpr = PART * ACC
        S1: tl.constexpr = PART * ACC + 1
        S2: tl.constexpr = PART * ACC + 2
        S3: tl.constexpr = PART * ACC + 3
        S4: tl.constexpr = PART * ACC + 4
        S5: tl.constexpr = PART * ACC + 5
        S6: tl.constexpr = PART * ACC + 6
        S7: tl.constexpr = PART * ACC + 7
    z = tl.zeros([BLOCK], dtype=tl.int32)
    a0 = (z, z, z, z, z, z, z, z, z, z, z, z, z, z, z, z)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    # Horner from the last page, software-pipelined: page r+1's loads are issued while page r
    # folds (index clamped: a redundant load at the end).
    f = _fetch(new_ptr, old_ptr, tl.cast(k - 1, tl.int64), new_stride, old_stride, off, ok, HAS_OLD)
    for r in range(k):
        d = _reduce(f, HAS_OLD)
        f = _fetch(
            new_ptr,
            old_ptr,
            tl.cast(tl.maximum(k - 2 - r, 0), tl.int64),
            new_stride,
            old_stride,
            off,
            ok,
            HAS_OLD,
        )
        if MATH:
            a0 = _xor(_times_alpha_pow(a0, S0 + B), d)
            a1 = _xor(_times_alpha_pow(a1, S1 + B), d)
            a2 = _xor(_times_alpha_pow(a2, S2 + B), d)
            a3 = _xor(_times_alpha_pow(a3, S3 + B), d)
            if ACC == 8:
                a4 = _xor(_times_alpha_pow(a4, S4 + B), d)
                a5 = _xor(_times_alpha_pow(a5, S5 + B), d)
                a6 = _xor(_times_alpha_pow(a6, S6 + B), d)
                a7 = _xor(_times_alpha_pow(a7, S7 + B), d)
        else:  # diagnostic (bench/syndrome_gpu.py --diag): the loads and one XOR, no multiply
            a0 = _xor(a0, d)
            a1 = _xor(a1, d)
            a2 = _xor(a2, d)
            a3 = _xor(a3, d)
            if ACC == 8:
                a4 = _xor(a4, d)
                a5 = _xor(a5, d)
                a6 = _xor(a6, d)
                a7 = _xor(a7, d)
    _scale_store(a0, S0, n_par, scale_ptr, q_in, q_out, q_base, q_stride, off, ok, HAS_QIN, B)
    _scale_store(a1, S1, n_par, scale_ptr, q_in, q_out, q_base, q_stride, off, ok, HAS_QIN, B)
    _scale_store(a2, S2, n_par, scale_ptr, q_in, q_out, q_base, q_stride, off, ok, HAS_QIN, B)
    _scale_store(a3, S3, n_par, scale_ptr, q_in, q_out, q_base, q_stride, off, ok, HAS_QIN, B)
    if ACC == 8:
        _scale_store(a4, S4, n_par, scale_ptr, q_in, q_out, q_base, q_stride, off, ok, HAS_QIN, B)
        _scale_store(a5, S5, n_par, scale_ptr, q_in, q_out, q_base, q_stride, off, ok, HAS_QIN, B)
        _scale_store(a6, S6, n_par, scale_ptr, q_in, q_out, q_base, q_stride, off, ok, HAS_QIN, B)
        _scale_store(a7, S7, n_par, scale_ptr, q_in, q_out, q_base, q_stride, off, ok, HAS_QIN, B)


@triton.jit(do_not_specialize=["k", "q_base", "scale_first"])
def _syndrome_kernel(
    new_ptr,
    old_ptr,
    new_stride,
    old_stride,
    k,
    scale_ptr,
    scale_first,
    q_in,
    q_out,
    q_base,
    q_stride,
    n_par,
    n_cols,
    BLOCK: tl.constexpr,
    MATH: tl.constexpr = True,
    ACC: tl.constexpr = 8,
    HAS_OLD: tl.constexpr = True,
    HAS_QIN: tl.constexpr = True,
    BAL: tl.constexpr = False,
    B: tl.constexpr = 0,
):
    part = tl.program_id(
        0
    )  # which ACC syndromes; the fastest grid axis, so parts share deltas in L2
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    # word offset of plane 0 of each column within a page range (2 KiB tiles of 16 x 32 words)
    off = (cols // 32) * 512 + cols % 32
    scale = scale_ptr + tl.cast(scale_first, tl.int64) * _SCALE_WORDS
    if part == 0:
        _part(
            new_ptr,
            old_ptr,
            new_stride,
            old_stride,
            k,
            scale,
            q_in,
            q_out,
            q_base,
            q_stride,
            n_par,
            off,
            ok,
            0,
            BLOCK,
            MATH,
            ACC,
            HAS_OLD,
            HAS_QIN,
            BAL,
            B,
        )
    elif part == 1:
        _part(
            new_ptr,
            old_ptr,
            new_stride,
            old_stride,
            k,
            scale,
            q_in,
            q_out,
            q_base,
            q_stride,
            n_par,
            off,
            ok,
            1,
            BLOCK,
            MATH,
            ACC,
            HAS_OLD,
            HAS_QIN,
            BAL,
            B,
        )
    elif ACC == 4:
        if part == 2:
            _part(
                new_ptr,
                old_ptr,
                new_stride,
                old_stride,
                k,
                scale,
                q_in,
                q_out,
                q_base,
                q_stride,
                n_par,
                off,
                ok,
                2,
                BLOCK,
                MATH,
                ACC,
                HAS_OLD,
                HAS_QIN,
                BAL,
                B,
            )
        else:
            _part(
                new_ptr,
                old_ptr,
                new_stride,
                old_stride,
                k,
                scale,
                q_in,
                q_out,
                q_base,
                q_stride,
                n_par,
                off,
                ok,
                3,
                BLOCK,
                MATH,
                ACC,
                HAS_OLD,
                HAS_QIN,
                BAL,
                B,
            )


def syndrome_update(
    scale: torch.Tensor,
    first_row: int,
    first_page: int,
    k: int,
    new: torch.Tensor,
    new_stride: int,
    old: torch.Tensor | None,
    old_stride: int,
    q_in: torch.Tensor | None,
    q_out: torch.Tensor,
    q_base: int,
    q_stride: int,
    n_parity: int,
    n_tiles: int,
    **launch: int,
) -> object:
    """``q_out[p] = q_in[p] ^ sum_(i<k) a^(e_p (first_page + i)) (old_i ^ new_i)``,
    ``e_p = first_row + p``, ``p < n_parity``.

    Page ``i`` of the chunk starts at word ``i * new_stride`` of ``new`` (``old`` alike),
    syndrome ``p`` at word ``q_base + p * q_stride`` of ``q_in`` / ``q_out`` (the same
    tensor for an in-place update); every range is ``n_tiles`` 2 KiB tiles. ``scale`` is the
    int32 ``[D, 16]`` table ``scale[j0][p] = a^(e_p j0)`` of the code's D, on the kernel's
    device (``leto.erasure.engine.scale_table`` builds it). int32 views on one device; one
    launch. ``launch``
    may override ``block``, ``num_warps`` and ``acc`` (anything else is refused);
    ``math=False`` (diagnostic: wrong bytes) skips the multiplications to time the loads
    alone. ``old=None`` folds the pages themselves
    (an encode: the syndromes of the data), ``q_in=None`` writes ``q_out`` without reading
    it. Returns Triton's compiled-kernel handle (None under the interpreter).
    """
    if not 0 < n_parity <= MAX_PARITY:
        raise ValueError(f"the syndrome kernel takes 1..{MAX_PARITY} syndromes, got {n_parity}")
    if not 0 <= first_page < scale.shape[0] - max(k - 1, 0):
        raise IndexError(f"pages [{first_page}, +{k}) outside the scale table of {scale.shape[0]}")
    for t in (new, old, q_in, q_out):
        if t is not None and t.dtype != torch.int32:
            raise TypeError(f"page buffers must be int32 views, got {t.dtype}")
    if k == 0 or n_tiles == 0:
        return None
    unknown = set(launch) - {"block", "num_warps", "acc", "math"}
    if unknown:
        raise TypeError(f"unknown launch options of the syndrome kernel: {sorted(unknown)}")
    n_cols = n_tiles * 32
    block, warps = (
        launch.get("block", TUNING["block"]),
        launch.get("num_warps", TUNING["num_warps"]),
    )
    acc = launch.get("acc", TUNING["acc"])
    if acc not in (4, 8):
        raise ValueError(f"the syndrome kernel holds 4 or 8 accumulators per program, got {acc}")
    grid = (triton.cdiv(n_parity, acc), triton.cdiv(n_cols, block))
    return _syndrome_kernel[grid](
        new,
        new if old is None else old,
        new_stride,
        old_stride,
        k,
        scale,
        first_page,
        q_out if q_in is None else q_in,
        q_out,
        q_base,
        q_stride,
        n_parity,
        n_cols,
        BLOCK=block,
        MATH=launch.get("math", True),
        ACC=acc,
        HAS_OLD=old is not None,
        HAS_QIN=q_in is not None,
        BAL=n_parity == MAX_PARITY,
        B=first_row,
        num_warps=warps,
    )
