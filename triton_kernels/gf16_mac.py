"""Triton kernel: bit-sliced GF(2^16) multiply-accumulate of pages (encode, update, decode).

One kernel serves all three Reed-Solomon operations, because each is the same linear map
``dst[o] (^)= sum_j coef[o][j] * src[j]`` over a range of tiles:

* encode: sources are the D data pages, outputs the H parity pages;
* incremental update: one source, the delta ``old ^ new`` of a byte range of page ``j``
  (the kernel XORs the two inputs itself, so the delta is never materialised), outputs
  the same range of the H parity pages, accumulated in place;
* decode: sources are the survivors, outputs the lost pages, with the decode matrix.

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
bit matrices stacked (0 or -1 per row, precomputed on the host). That is one LOP3 per
output plane per input plane per 32 symbols: no gathers, no divergence, coalesced
128-byte plane loads, and the data is read from HBM once (the programs that share a
column block over output blocks run together and hit L2).
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

TILE_WORDS = 512
"""int32 words per 2 KiB tile (16 planes x 32 words)."""

TUNING: dict[str, int] = {"out_block": 2, "block_n": 512, "num_warps": 4}
"""Launch parameters used when a call gives none (bench/erasure_gpu.py sweeps them)."""


@triton.jit
def _gf16_mac_kernel(
    src_ptr,
    src2_ptr,
    src_off_ptr,
    mask_ptr,
    dst_ptr,
    dst_off_ptr,
    n_src,
    n_out,
    n_cols,
    HAS_SRC2: tl.constexpr,
    ACCUMULATE: tl.constexpr,
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
    acc = tl.zeros([OUT_BLOCK * 16, BLOCK_N], dtype=tl.int32)
    for j in range(n_src):
        base = tl.load(src_off_ptr + j)
        mrow = mask_ptr + j * 16 * n_rows + pid_o * OUT_BLOCK * 16 + rows
        for b in tl.static_range(16):
            x = tl.load(src_ptr + base + col_off + b * 32, mask=col_ok, other=0)
            if HAS_SRC2:
                x = x ^ tl.load(src2_ptr + base + col_off + b * 32, mask=col_ok, other=0)
            m = tl.load(mrow + b * n_rows, mask=row_ok, other=0)
            acc = acc ^ (m[:, None] & x[None, :])
    dst_base = tl.load(dst_off_ptr + out_idx, mask=row_ok, other=0)
    ptrs = dst_ptr + (dst_base + (rows % 16) * 32)[:, None] + col_off[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc = acc ^ tl.load(ptrs, mask=ok, other=0)
    tl.store(ptrs, acc, mask=ok)


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
    out_block: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> None:
    """``dst[o] (^)= sum_j coef[o][j] * (src[j] ^ src2[j])`` on ``n_tiles`` tiles.

    ``masks`` is ``leto.erasure.bitslice.plane_masks(coef)`` (int32 ``[n_src, 16,
    n_out * 16]``) on the kernel's device. ``src``/``src2``/``dst`` are flat int32 views;
    ``src_off``/``dst_off`` (int64, on the device) give the word offset of the first tile
    of each source / output range. ``src2`` (same offsets as ``src``) is XORed into the
    sources: the incremental update passes old and new contents.
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
    out_block = out_block or min(TUNING["out_block"], triton.next_power_of_2(n_out))
    block_n = block_n or TUNING["block_n"]
    num_warps = num_warps or TUNING["num_warps"]
    n_cols = n_tiles * 32
    grid = (triton.cdiv(n_cols, block_n), triton.cdiv(n_out, out_block))
    _gf16_mac_kernel[grid](
        src,
        src2 if src2 is not None else src,
        src_off,
        masks,
        dst,
        dst_off,
        n_src,
        n_out,
        n_cols,
        HAS_SRC2=src2 is not None,
        ACCUMULATE=accumulate,
        OUT_BLOCK=out_block,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
