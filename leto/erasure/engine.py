"""Choose the page-arithmetic engine by device: the Triton kernel on CUDA, PyTorch on CPU.

Both compute ``outs[o] (^)= sum_j coef[o][j] * (srcs[j] ^ srcs_xor[j])`` in the same
bit-sliced layout, so their results are bit-identical; tests check that.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Literal

import torch

from leto.erasure.bitslice import TILE_BYTES, mac_pages, plane_masks

logger = logging.getLogger(__name__)

Backend = Literal["auto", "torch", "triton"]


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
