"""Triton kernel: bit-sliced GF(2^16) multiply-accumulate of pages (encode, update, decode).

One kernel serves all three Reed-Solomon operations, because each is the same linear map
``dst[o] (^)= sum_j coef[o][j] * src[j]`` over a range of tiles:

* encode: sources are the D data pages, outputs the H parity pages;
* incremental update: sources are the deltas ``old ^ new`` of the same byte range of k
  consecutive data pages (the kernel XORs the two inputs itself, so the delta is never
  materialised), outputs the same range of the H parity pages, accumulated in place. The
  H parity accumulators stay in registers across the k sources, so a chunk of k pages
  reads and writes each parity word once;
* decode: sources are the survivors, outputs the lost pages, with the decode matrix.

Addressing. Sources and outputs are reached either through an int64 table of word offsets
(``SRC_TABLE`` / ``DST_TABLE``: encode and decode, whose survivors are irregular) or as
``base + i * stride`` from scalar arguments (the per-chunk update: no table, no host-side
tensor per call, so a call is one launch and nothing else).

Why bit-slicing (the choice is recorded here as the design asks; numbers in
docs/ERASURE.md). Per data symbol the code must do H multiply-accumulates by per-page
constants. Table techniques do one or more *gathers* per multiply: log/antilog needs a
64K-entry table (128 KiB, too big to replicate per warp, so gathers go to L1/L2 at about
one lane per cycle), and ISA-L's nibble split needs 4 gathers per multiply from 16-entry
tables; a straightforward nibble-gather kernel was measured at only 125 GB/s on an H200.
In the bit-sliced layout (leto.erasure.bitslice: a 2 KiB tile is 16 planes of 32 words,
bit ``b`` of 1024 symbols per plane) a multiplication by a constant is a 16x16 GF(2)
matrix applied to whole 32-bit words: output plane ``i`` is the XOR of the input planes
that row ``i`` selects. The kernel keeps ``OUT_BLOCK * 16`` output planes as one
``[rows, BLOCK_N]`` int32 accumulator and, for each input plane ``b``, does
``acc ^= mask[:, None] & x_b[None, :]`` where ``mask`` is the column ``b`` of all the
bit matrices stacked (0 or -1 per row, precomputed once per matrix: the protection group
caches the encode masks on the device). That is one LOP3 per output plane per input
plane per 32 symbols: no gathers, no divergence, coalesced 128-byte plane loads.
``PREFETCH`` software-pipelines the sources (the 16 planes of source j + 1 are loaded
while source j is multiplied) to hide HBM latency behind the LOP3 stream.

The ceiling (docs/ERASURE.md): 256 LOP3 lane-ops per 32 symbols per parity page, so an
update of k pages costs 16 * 256 / 64 = 64 lane-ops per delta byte, about 16.7 T lane-ops/s
on an H200; it is memory-bound only while the parity traffic (2 * H pages per chunk)
dominates, i.e. for chunks of a few pages.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

TILE_WORDS = 512
"""int32 words per 2 KiB tile (16 planes x 32 words)."""

TUNING: dict[str, dict[str, int]] = {
    "1": {"out_block": 1, "block_n": 256, "num_warps": 2, "prefetch": 1},
    "few": {"out_block": 2, "block_n": 128, "num_warps": 1, "prefetch": 1},
    "mid": {"out_block": 2, "block_n": 128, "num_warps": 1, "prefetch": 1},
    "many": {"out_block": 2, "block_n": 128, "num_warps": 1, "prefetch": 0},
}
"""Launch parameters by number of sources (:func:`bucket`): the best of the sweep of
bench/erasure_gpu.py on an H200, 2026-11-30 (docs/ERASURE.md has the table)."""


def bucket(n_src: int) -> str:
    """Tuning bucket of a launch with ``n_src`` sources."""
    if n_src <= 1:
        return "1"
    if n_src <= 12:
        return "few"
    if n_src <= 128:
        return "mid"
    return "many"


@triton.jit
def _ld(ptr, ptr2, base, base2, col_off, ok, b: tl.constexpr, HAS_SRC2: tl.constexpr):
    """Input plane ``b`` of one source (XOR of the two inputs for an update)."""
    x = tl.load(ptr + base + col_off + b * 32, mask=ok, other=0)
    if HAS_SRC2:
        x = x ^ tl.load(ptr2 + base2 + col_off + b * 32, mask=ok, other=0)
    return x


@triton.jit
def _mac(acc, x, mrow, b: tl.constexpr, n_rows, row_ok):
    """``acc ^= mask_b & x``: one AND-XOR (LOP3) per output plane per word."""
    m = tl.load(mrow + b * n_rows, mask=row_ok, other=0)
    return acc ^ (m[:, None] & x[None, :])


@triton.jit
def _src_base(off_ptr, stride, j, SRC_TABLE: tl.constexpr):
    if SRC_TABLE:
        base = tl.load(off_ptr + j)
    else:
        base = tl.cast(j, tl.int64) * stride
    return base


@triton.jit(do_not_specialize=["mask_first", "dst_base", "n_src"])
def _gf16_mac_kernel(
    src_ptr,
    src2_ptr,
    src_off_ptr,
    src_stride,
    src2_stride,
    mask_ptr,
    mask_first,
    dst_ptr,
    dst_off_ptr,
    dst_stride,
    dst_base,
    n_src,
    n_out,
    n_cols,
    HAS_SRC2: tl.constexpr,
    SRC_TABLE: tl.constexpr,
    DST_TABLE: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    PREFETCH: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_o = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    # word offset of plane 0 of each column, relative to the start of a page range
    col_off = (cols // 32) * 512 + (cols % 32)
    rows = tl.arange(0, OUT_BLOCK * 16)
    out_idx = pid_o * OUT_BLOCK + rows // 16
    row_ok = out_idx < n_out
    n_rows = n_out * 16
    mbase = mask_ptr + tl.cast(mask_first, tl.int64) * 16 * n_rows + pid_o * OUT_BLOCK * 16 + rows
    if DST_TABLE:
        dbase = tl.load(dst_off_ptr + out_idx, mask=row_ok, other=0)
    else:
        dbase = dst_base + tl.cast(out_idx, tl.int64) * dst_stride
    ptrs = dst_ptr + (dbase + (rows % 16) * 32)[:, None] + col_off[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        # start from the parity itself: its load is issued before the source loads, so
        # for short chunks (k = 1) the read-modify-write overlaps the multiply
        acc = tl.load(ptrs, mask=ok, other=0)
    else:
        acc = tl.zeros([OUT_BLOCK * 16, BLOCK_N], dtype=tl.int32)
    if PREFETCH:
        # Software pipeline over sources: the 16 planes of source j + 1 are loaded while
        # source j is multiplied, so HBM latency hides behind 16 x OUT_BLOCK*16 LOP3s.
        if SRC_TABLE:
            b0 = tl.load(src_off_ptr)
            c0 = b0
        else:
            b0 = 0
            c0 = 0
        ok0 = col_ok & ((cols * 0 + n_src) > 0)
        x0 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 0, HAS_SRC2)
        x1 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 1, HAS_SRC2)
        x2 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 2, HAS_SRC2)
        x3 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 3, HAS_SRC2)
        x4 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 4, HAS_SRC2)
        x5 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 5, HAS_SRC2)
        x6 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 6, HAS_SRC2)
        x7 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 7, HAS_SRC2)
        x8 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 8, HAS_SRC2)
        x9 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 9, HAS_SRC2)
        x10 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 10, HAS_SRC2)
        x11 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 11, HAS_SRC2)
        x12 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 12, HAS_SRC2)
        x13 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 13, HAS_SRC2)
        x14 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 14, HAS_SRC2)
        x15 = _ld(src_ptr, src2_ptr, b0, c0, col_off, ok0, 15, HAS_SRC2)
        for j in range(n_src):
            mrow = mbase + tl.cast(j, tl.int64) * 16 * n_rows
            jn = j + 1
            okn = col_ok & ((cols * 0 + jn) < n_src)
            if SRC_TABLE:
                bn = tl.load(src_off_ptr + tl.minimum(jn, n_src - 1))  # clamped: unused at the end
                cn = bn
            else:
                bn = tl.cast(jn, tl.int64) * src_stride
                cn = tl.cast(jn, tl.int64) * src2_stride
            acc = _mac(acc, x0, mrow, 0, n_rows, row_ok)
            x0 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 0, HAS_SRC2)
            acc = _mac(acc, x1, mrow, 1, n_rows, row_ok)
            x1 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 1, HAS_SRC2)
            acc = _mac(acc, x2, mrow, 2, n_rows, row_ok)
            x2 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 2, HAS_SRC2)
            acc = _mac(acc, x3, mrow, 3, n_rows, row_ok)
            x3 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 3, HAS_SRC2)
            acc = _mac(acc, x4, mrow, 4, n_rows, row_ok)
            x4 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 4, HAS_SRC2)
            acc = _mac(acc, x5, mrow, 5, n_rows, row_ok)
            x5 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 5, HAS_SRC2)
            acc = _mac(acc, x6, mrow, 6, n_rows, row_ok)
            x6 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 6, HAS_SRC2)
            acc = _mac(acc, x7, mrow, 7, n_rows, row_ok)
            x7 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 7, HAS_SRC2)
            acc = _mac(acc, x8, mrow, 8, n_rows, row_ok)
            x8 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 8, HAS_SRC2)
            acc = _mac(acc, x9, mrow, 9, n_rows, row_ok)
            x9 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 9, HAS_SRC2)
            acc = _mac(acc, x10, mrow, 10, n_rows, row_ok)
            x10 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 10, HAS_SRC2)
            acc = _mac(acc, x11, mrow, 11, n_rows, row_ok)
            x11 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 11, HAS_SRC2)
            acc = _mac(acc, x12, mrow, 12, n_rows, row_ok)
            x12 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 12, HAS_SRC2)
            acc = _mac(acc, x13, mrow, 13, n_rows, row_ok)
            x13 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 13, HAS_SRC2)
            acc = _mac(acc, x14, mrow, 14, n_rows, row_ok)
            x14 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 14, HAS_SRC2)
            acc = _mac(acc, x15, mrow, 15, n_rows, row_ok)
            x15 = _ld(src_ptr, src2_ptr, bn, cn, col_off, okn, 15, HAS_SRC2)
    else:
        for j in range(n_src):
            mrow = mbase + tl.cast(j, tl.int64) * 16 * n_rows
            base = _src_base(src_off_ptr, src_stride, j, SRC_TABLE)
            base2 = base if SRC_TABLE else tl.cast(j, tl.int64) * src2_stride
            for b in tl.static_range(16):
                x = _ld(src_ptr, src2_ptr, base, base2, col_off, col_ok, b, HAS_SRC2)
                acc = _mac(acc, x, mrow, b, n_rows, row_ok)
    tl.store(ptrs, acc, mask=ok)


def _params(n_src: int, n_out: int, kw: dict) -> tuple[int, int, int, int]:
    t = TUNING[bucket(n_src)]
    ob = kw.get("out_block") or t["out_block"]
    ob = min(ob, triton.next_power_of_2(n_out))
    bn = kw.get("block_n") or t["block_n"]
    nw = kw.get("num_warps") or t["num_warps"]
    pf = kw.get("prefetch")
    pf = t["prefetch"] if pf is None else pf
    return ob, bn, nw, int(bool(pf))


def gf16_mac(
    masks: torch.Tensor,
    src: torch.Tensor,
    src_off: torch.Tensor,
    dst: torch.Tensor,
    dst_off: torch.Tensor,
    n_tiles: int,
    *,
    accumulate: bool,
    src2: torch.Tensor | None = None,
    **launch: int,
) -> object:
    """``dst[o] (^)= sum_j coef[o][j] * (src[j] ^ src2[j])`` on ``n_tiles`` tiles.

    ``masks`` is ``leto.erasure.bitslice.plane_masks(coef)`` (int32 ``[n_src, 16,
    n_out * 16]``) on the kernel's device. ``src``/``src2``/``dst`` are flat int32 views;
    ``src_off``/``dst_off`` (int64, on the device) give the word offset of the first tile
    of each source / output range. ``src2`` (same offsets as ``src``) is XORed into the
    sources: the incremental update passes old and new contents. ``launch`` may override
    ``out_block``, ``block_n``, ``num_warps``, ``prefetch``. Returns Triton's handle of
    the compiled kernel (``n_regs``, ``n_spills``), or None under the interpreter.
    """
    n_src, planes, n_rows = masks.shape
    n_out = n_rows // 16
    if planes != 16 or n_rows % 16 or src_off.numel() != n_src or dst_off.numel() != n_out:
        raise ValueError("masks, src_off and dst_off do not describe one coefficient matrix")
    for t in (src, dst) + ((src2,) if src2 is not None else ()):
        if t.dtype != torch.int32:
            raise TypeError(f"page buffers must be int32 views, got {t.dtype}")
    for name, t in (("masks", masks), ("src_off", src_off), ("dst_off", dst_off)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel indexes it flat)")
    ob, bn, nw, pf = _params(n_src, n_out, launch)
    n_cols = n_tiles * 32
    grid = (triton.cdiv(n_cols, bn), triton.cdiv(n_out, ob))
    return _gf16_mac_kernel[grid](
        src,
        src2 if src2 is not None else src,
        src_off,
        0,
        0,
        masks,
        0,
        dst,
        dst_off,
        0,
        0,
        n_src,
        n_out,
        n_cols,
        HAS_SRC2=src2 is not None,
        SRC_TABLE=True,
        DST_TABLE=True,
        ACCUMULATE=accumulate,
        PREFETCH=pf,
        OUT_BLOCK=ob,
        BLOCK_N=bn,
        num_warps=nw,
    )


def gf16_mac_strided(
    masks: torch.Tensor,
    mask_first: int,
    n_src: int,
    src: torch.Tensor,
    src_stride: int,
    dst: torch.Tensor,
    dst_base: int,
    dst_stride: int,
    n_tiles: int,
    *,
    accumulate: bool,
    src2: torch.Tensor | None = None,
    src2_stride: int = 0,
    **launch: int,
) -> object:
    """The per-chunk form: sources ``j < n_src`` start at word ``j * src_stride`` of
    ``src`` (and ``j * src2_stride`` of ``src2``) and use the masks of matrix column
    ``mask_first + j`` of ``masks`` (``[N, 16, n_out * 16]``, e.g. the whole encode
    matrix); output ``o`` starts at word ``dst_base + o * dst_stride`` of ``dst``.

    All int32 views on one device. No tensor is built and nothing is copied: one launch.
    """
    n_out = masks.shape[2] // 16
    ob, bn, nw, pf = _params(n_src, n_out, launch)
    n_cols = n_tiles * 32
    grid = (triton.cdiv(n_cols, bn), triton.cdiv(n_out, ob))
    return _gf16_mac_kernel[grid](
        src,
        src2 if src2 is not None else src,
        src,
        src_stride,
        src2_stride,
        masks,
        mask_first,
        dst,
        dst,
        dst_stride,
        dst_base,
        n_src,
        n_out,
        n_cols,
        HAS_SRC2=src2 is not None,
        SRC_TABLE=False,
        DST_TABLE=False,
        ACCUMULATE=accumulate,
        PREFETCH=pf,
        OUT_BLOCK=ob,
        BLOCK_N=bn,
        num_warps=nw,
    )
