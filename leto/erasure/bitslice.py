"""The bit-sliced symbol layout and the CPU (pure PyTorch) page arithmetic.

Layout. A page is cut into tiles of ``TILE_BYTES`` = 2 KiB. A tile is 16 *planes* of 32
little-endian 32-bit words (plane ``b`` = words ``32 b .. 32 b + 31`` of the tile) and
holds 1024 symbols of GF(2^16): symbol ``(c, l)`` (word column ``c``, bit lane ``l``) has
bit ``b`` equal to bit ``l`` of word ``c`` of plane ``b``. This is a fixed bijection
between page bytes and symbols, so the Reed-Solomon code over the symbols stays MDS;
what it buys is that multiplying by a constant ``k`` becomes whole-word XORs: output
plane ``i`` is the XOR of the input planes selected by row ``i`` of the 16x16 GF(2)
matrix of ``k`` (:func:`leto.erasure.gf16.bitmatrix_rows`). The Triton kernels use the
same layout, so CPU and GPU parity are bit-identical.

CPU engine. :func:`mac_pages` computes ``out[o] (^)= sum_j coef[o][j] * src[j]`` over a
range of tiles. Per source it builds, for each group of 4 input planes, the 16 XOR
combinations of those planes ("four Russians" tables, shared by all outputs), then every
output plane is the XOR of 4 table entries picked by the nibbles of its matrix row. That
is about 4 gathers per output plane instead of 8 conditional XORs, vectorised by torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from leto.erasure.config import TILE_BYTES
from leto.erasure.gf16 import EXP, LOG, bitmatrix_rows_np

logger = logging.getLogger(__name__)

PLANES = 16
WORDS_PER_PLANE = 32
SYMBOLS_PER_TILE = 1024

_BLOCK_TILES = 32
"""Tiles processed per step: bounds the gather scratch (n_out * 8 KiB per tile)."""


def _tiles(x: torch.Tensor) -> torch.Tensor:
    """View a uint8 page range as int64 ``[tiles, 16 planes, 16 words]`` (two columns a word)."""
    if x.dtype != torch.uint8 or x.dim() != 1:
        raise TypeError(f"expected a flat uint8 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if x.numel() % TILE_BYTES:
        raise ValueError(
            f"{x.numel()} bytes is not a multiple of the {TILE_BYTES}-byte tile; "
            "pad the page range to whole tiles"
        )
    return x.view(torch.int64).view(-1, PLANES, WORDS_PER_PLANE // 2)


def to_symbols(x: torch.Tensor) -> torch.Tensor:
    """Decode a uint8 page range into its GF(2^16) symbols (int64, in symbol order)."""
    words = _tiles(x).view(torch.int32).view(-1, PLANES, WORDS_PER_PLANE).to(torch.int64)
    words &= 0xFFFFFFFF
    lanes = torch.arange(32, dtype=torch.int64, device=x.device)
    bits = (words.unsqueeze(-1) >> lanes) & 1  # [tiles, plane, column, lane]
    weights = (1 << torch.arange(PLANES, dtype=torch.int64, device=x.device)).view(1, PLANES, 1, 1)
    return (bits * weights).sum(dim=1).reshape(-1)


def from_symbols(sym: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_symbols`: pack symbols (any int dtype) back into page bytes."""
    s = sym.to(torch.int64).view(-1, WORDS_PER_PLANE, 32)  # [tiles, column, lane]
    planes = torch.arange(PLANES, dtype=torch.int64, device=sym.device).view(1, PLANES, 1, 1)
    bits = (s.unsqueeze(1) >> planes) & 1  # [tiles, plane, column, lane]
    words = (bits << torch.arange(32, dtype=torch.int64, device=sym.device)).sum(dim=-1)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.reshape(-1).view(torch.uint8)


@lru_cache(maxsize=64)
def _gather_index(coef: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Per source ``j``: indices into its 64-entry table for every (output, plane, nibble).

    Shape ``[n_src, n_out * 16 * 4]``; entry ``(o, i, g)`` is ``16 g + nibble g`` of row
    ``i`` of the bit matrix of ``coef[o][j]``.
    """
    n_src = len(coef[0])
    rows = bitmatrix_rows_np(np.array(coef, dtype=np.int64))
    nib = (rows[..., None] >> (4 * np.arange(4))) & 0xF  # [n_out, n_src, 16, 4]
    idx = torch.from_numpy(nib + 16 * np.arange(4)).permute(1, 0, 2, 3).contiguous()
    return idx.view(n_src, -1)


def _tables(x: torch.Tensor) -> torch.Tensor:
    """Four-Russians tables of ``x`` ``[nt, 16, 16]``: ``[nt, 64, 16]``, entry ``16 g + m``
    is the XOR of planes ``4 g + k`` for the bits ``k`` of ``m``."""
    nt = x.shape[0]
    xg = x.view(nt, 4, 4, -1)
    t = torch.empty(nt, 4, 16, x.shape[-1], dtype=x.dtype, device=x.device)
    t[:, :, 0] = 0
    for k in range(4):
        torch.bitwise_xor(t[:, :, : 1 << k], xg[:, :, k : k + 1], out=t[:, :, 1 << k : 2 << k])
    return t.view(nt, 64, -1)


def mac_pages(
    coef: Sequence[Sequence[int]],
    srcs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    *,
    accumulate: bool,
    srcs_xor: Sequence[torch.Tensor] | None = None,
) -> None:
    """``outs[o] (^)= sum_j coef[o][j] * (srcs[j] ^ srcs_xor[j])`` over GF(2^16), in place.

    All tensors are flat uint8 tensors of one length (a multiple of ``TILE_BYTES``), in the
    bit-sliced layout; the product runs on the sources' device (the CPU in production, a
    GPU in the tests that compare engines there) and lands in outputs on any device.
    ``accumulate=False`` overwrites ``outs``. ``srcs_xor`` (optional) is XORed into each
    source first: the incremental update passes the old and new contents of a range and
    multiplies their difference.
    """
    key = tuple(tuple(int(v) for v in row) for row in coef)
    n_out = len(key)
    if n_out != len(outs) or any(len(row) != len(srcs) for row in key):
        raise ValueError(
            f"coef is {n_out}x{len(key[0]) if key else 0}, "
            f"got {len(outs)} outputs and {len(srcs)} sources"
        )
    src_t = [_tiles(s) for s in srcs]
    xor_t = [_tiles(s) for s in srcs_xor] if srcs_xor is not None else None
    out_t = [_tiles(o) for o in outs]
    if not out_t:
        return
    n_tiles = out_t[0].shape[0]
    if any(t.shape[0] != n_tiles for t in src_t + out_t + (xor_t or [])):
        raise ValueError("all page ranges passed to mac_pages must have the same length")
    dev = src_t[0].device if src_t else out_t[0].device  # outputs may live elsewhere (host tiers)
    idx = _gather_index(key).to(dev) if src_t else None
    for t0 in range(0, n_tiles, _BLOCK_TILES):
        t1 = min(t0 + _BLOCK_TILES, n_tiles)
        acc = torch.zeros(
            t1 - t0, n_out, PLANES, WORDS_PER_PLANE // 2, dtype=torch.int64, device=dev
        )
        for j, s in enumerate(src_t):
            x = s[t0:t1]
            if xor_t is not None:
                x = x ^ xor_t[j][t0:t1]
            g = _tables(x).index_select(1, idx[j]).view(t1 - t0, n_out, PLANES, 4, -1)
            acc ^= g[:, :, :, 0] ^ g[:, :, :, 1] ^ g[:, :, :, 2] ^ g[:, :, :, 3]
        for o, out in enumerate(out_t):
            part = acc[:, o].to(out.device)
            if accumulate:
                out[t0:t1] ^= part
            else:
                out[t0:t1] = part


def plane_masks_tensor(coef: torch.Tensor) -> torch.Tensor:
    """:func:`plane_masks` of an int64 ``[n_out, n_src]`` tensor, computed on its device.

    Used on the GPU for decode matrices, which change with every erasure pattern: the
    masks of a 16 x 1024 matrix are 16 MiB, cheaper to build there than to upload.
    """
    exp = EXP.to(coef.device)
    log = LOG.to(coef.device)
    b = torch.arange(PLANES, device=coef.device)
    c = coef.to(torch.int64)[..., None]
    cols = torch.where(c == 0, 0, exp[log[c] + b])  # c * x^b: [n_out, n_src, b]
    bits = (cols[..., None, :] >> b[:, None]) & 1  # [n_out, n_src, i, b]
    n_out, n_src = coef.shape
    masks = -bits.permute(1, 3, 0, 2).reshape(n_src, PLANES, n_out * PLANES)
    return masks.to(torch.int32).contiguous()


@lru_cache(maxsize=64)
def _plane_masks(coef: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    return plane_masks_tensor(torch.tensor(coef, dtype=torch.int64))


def plane_masks(coef: Sequence[Sequence[int]]) -> torch.Tensor:
    """The coefficient matrix as the GPU kernel consumes it: int32 ``[n_src, 16, n_out*16]``.

    Entry ``(j, b, 16 o + i)`` is -1 if input plane ``b`` contributes to output plane ``i``
    of ``coef[o][j] * src[j]`` and 0 otherwise (a ready-made AND mask). Cached per matrix.
    """
    return _plane_masks(tuple(tuple(int(v) for v in row) for row in coef))
