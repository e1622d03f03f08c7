"""Choose the page-arithmetic engine by device: the Triton kernels on CUDA, PyTorch on CPU.

Both compute ``outs[o] (^)= sum_j coef[o][j] * (srcs[j] ^ srcs_xor[j])`` in the same
bit-sliced layout, so their results are bit-identical; tests check that. This is the one
module of the library that imports ``triton_kernels`` (lazily: CPU-only hosts need no
Triton); the kernels take every table they use (masks, scale constants) as arguments,
built here from :mod:`leto.erasure.gf16` and :mod:`leto.erasure.bitslice`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import lru_cache
from typing import Literal

import numpy as np
import torch

from leto.erasure.bitslice import TILE_BYTES, mac_pages, plane_masks
from leto.erasure.gf16 import EXP_NP, ORDER

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]

SYNDROME_KERNEL = os.environ.get("LETO_SYNDROME_KERNEL", "1") == "1"
"""Fold syndrome-form chunks on CUDA with the Horner kernel (``triton_kernels.gf16_syndrome``)
instead of the generic kernel on the syndrome matrix (same bytes, several times faster from
2 pages on; BENCHMARKS.md, the syndrome fold). ``LETO_SYNDROME_KERNEL=0`` selects the generic
kernel (bench/syndrome_gpu.py compares both)."""
SYNDROME_MIN_PAGES = 2
"""Runs of fewer pages go to the generic kernel, which is faster for a single page; from
2 pages the Horner kernel is faster (BENCHMARKS.md, short runs)."""
SYNDROME_MAX_PARITY = 16
"""Syndromes one launch of the Horner kernel folds (its ``MAX_PARITY``)."""


def _word_offsets(ts: Sequence[torch.Tensor], base: torch.Tensor) -> torch.Tensor:
    """int64 word offsets of each tensor's first byte relative to ``base`` (may be negative)."""
    offs = []
    for t in ts:
        delta = t.data_ptr() - base.data_ptr()
        if delta % 4:
            raise ValueError("page ranges must be 4-byte aligned for the Triton engine")
        offs.append(delta // 4)
    return torch.tensor(offs, dtype=torch.int64, device=base.device)


def resolve_backend(backend: Backend, device: torch.device) -> Literal["torch", "triton"]:
    """``auto`` picks Triton for CUDA tensors and PyTorch otherwise; ``triton`` on CPU
    tensors means the interpreter (``TRITON_INTERPRET=1``) and falls back to PyTorch
    without it (host-side tier-2 parity on a GPU machine)."""
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "torch"
    return backend


def syndrome_kernel_applies(
    backend: Backend, device: torch.device, n_parity: int, pages: int | None = None
) -> bool:
    """The Horner kernel serves a fold of ``pages`` pages (None: any run) into ``n_parity``
    syndromes on ``device``."""
    return (
        SYNDROME_KERNEL
        and resolve_backend(backend, device) == "triton"
        and n_parity <= SYNDROME_MAX_PARITY
        and (pages is None or pages >= SYNDROME_MIN_PAGES)
    )


@lru_cache(maxsize=8)
def _scale_np(data_pages: int, first_row: int) -> np.ndarray:
    """``[D, 16]`` int32: ``a^((first_row + p) j0)`` for every first page ``j0`` and
    syndrome ``p``."""
    j0 = np.arange(data_pages, dtype=np.int64)[:, None]
    e = first_row + np.arange(SYNDROME_MAX_PARITY, dtype=np.int64)[None, :]
    return EXP_NP[(j0 * e) % (ORDER - 1)].astype(np.int32)


_DEVICE_SCALES: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def scale_table(data_pages: int, first_row: int, device: torch.device) -> torch.Tensor:
    """The Horner kernel's scale constants for a code of ``data_pages`` data pages whose
    syndrome 0 is row ``first_row`` (``leto.erasure.rs.first_row``), on ``device`` (built
    once per shape): row ``j0`` holds ``a^((first_row + p) j0)`` for ``p < 16``."""
    key = (data_pages, first_row, torch.device(device))
    if key not in _DEVICE_SCALES:
        _DEVICE_SCALES[key] = (
            torch.from_numpy(_scale_np(data_pages, first_row)).to(device).contiguous()
        )
    return _DEVICE_SCALES[key]


def syndrome_fold(
    data_pages: int,
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
) -> None:
    """``q_out[p] = q_in[p] ^ sum_(i<k) a^(e_p (first_page + i)) (old_i ^ new_i)``,
    ``e_p = first_row + p``, by the Horner kernel
    (``triton_kernels.gf16_syndrome.syndrome_update``, which documents the arguments), with
    the scale table of a code of ``data_pages`` data pages."""
    from triton_kernels.gf16_syndrome import syndrome_update

    syndrome_update(
        scale_table(data_pages, first_row, q_out.device),
        first_row,
        first_page,
        k,
        new,
        new_stride,
        old,
        old_stride,
        q_in,
        q_out,
        q_base,
        q_stride,
        n_parity,
        n_tiles,
    )


def mac_strided(
    masks: torch.Tensor,
    first_page: int,
    k: int,
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
) -> None:
    """The generic kernel on pages addressed as ``base + i * stride``
    (``triton_kernels.gf16_mac.gf16_mac_strided``): one launch, no host work."""
    from triton_kernels.gf16_mac import gf16_mac_strided

    gf16_mac_strided(
        masks,
        first_page,
        k,
        src,
        src_stride,
        dst,
        dst_base,
        dst_stride,
        n_tiles,
        accumulate=accumulate,
        src2=src2,
        src2_stride=src2_stride,
    )


def mac_words(
    masks: torch.Tensor,
    src: torch.Tensor,
    src_off: torch.Tensor,
    dst: torch.Tensor,
    dst_off: torch.Tensor,
    n_tiles: int,
    *,
    accumulate: bool,
) -> None:
    """The generic kernel on pages given by int64 word offsets into ``src`` / ``dst``
    (``triton_kernels.gf16_mac.gf16_mac``; the device rebuild's plans)."""
    from triton_kernels.gf16_mac import gf16_mac

    gf16_mac(masks, src, src_off, dst, dst_off, n_tiles, accumulate=accumulate)


def mac(
    coef: Sequence[Sequence[int]],
    srcs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    *,
    accumulate: bool,
    srcs_xor: Sequence[torch.Tensor] | None = None,
    backend: Backend = "auto",
    masks: torch.Tensor | None = None,
) -> None:
    """Apply a coefficient matrix to page ranges (flat uint8 tensors of one length).

    ``masks`` may carry ``plane_masks(coef)`` already on the device (the protection group
    keeps its encode matrix there, so the per-chunk update does no host work).
    """
    if not outs:
        return
    device = outs[0].device
    if resolve_backend(backend, device) == "torch":
        mac_pages(coef, srcs, outs, accumulate=accumulate, srcs_xor=srcs_xor)
        return
    from triton_kernels.gf16_mac import gf16_mac  # imported lazily: CPU-only hosts need no triton

    nbytes = outs[0].numel()
    if nbytes % TILE_BYTES:
        raise ValueError(f"{nbytes} bytes is not a whole number of {TILE_BYTES}-byte tiles")
    if not srcs:
        if not accumulate:
            for o in outs:
                o.zero_()
        return
    if srcs_xor is not None:
        want = [s.data_ptr() - srcs[0].data_ptr() for s in srcs]
        have = [s.data_ptr() - srcs_xor[0].data_ptr() for s in srcs_xor]
        if want != have:  # the kernel shares one offset table between the two inputs
            srcs = [s ^ x for s, x in zip(srcs, srcs_xor, strict=True)]
            srcs_xor = None
    if masks is None:
        masks = plane_masks(coef).to(device, non_blocking=True)
    src_base, dst_base = srcs[0], outs[0]
    gf16_mac(
        masks,
        _flat_words(src_base, srcs),
        _word_offsets(srcs, src_base),
        _flat_words(dst_base, outs),
        _word_offsets(outs, dst_base),
        nbytes // TILE_BYTES,
        accumulate=accumulate,
        src2=_flat_words(srcs_xor[0], srcs_xor) if srcs_xor is not None else None,
    )


def _flat_words(base: torch.Tensor, members: Sequence[torch.Tensor]) -> torch.Tensor:
    """An int32 view starting at ``base``; the kernel reaches ``members`` by offset from it."""
    if base.data_ptr() % 4:
        raise ValueError("page ranges must be 4-byte aligned for the Triton engine")
    if len({m.device for m in members} | {base.device}) != 1:
        raise ValueError("all page ranges of one call must live on one device")
    n = base.numel() - base.numel() % 4
    return base[:n].view(torch.int32)
