"""A protection group: D data pages with H1 tier-1 and H2 tier-2 parity pages (paper Fig. 4).

The group does not own memory: the data is a view of retained state (device or host) and
the parity tensors live in state-manager host memory; the caller passes all of them in.
Tier 1 is a generalised RS code over the data pages (:class:`leto.erasure.rs.GRSCode`),
tier 2 a Cauchy RS code over the tier-1 pages. A group built with ``syndromes=True``
holds the tier-1 *syndromes* instead of the parity (the updater's device working copy:
cheaper to update, see rs.py); :meth:`syndromes_of` / :meth:`parity_of` convert. Arithmetic
runs where the data is, on the kernels :mod:`leto.erasure.engine` chooses (Triton on CUDA,
PyTorch on CPU); tier 2 always runs where the parity is. No persistent parity lives on the
device: device scratch is allocated per call and freed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from leto.erasure.bitslice import TILE_BYTES, plane_masks, plane_masks_tensor
from leto.erasure.config import ErasureConfig
from leto.erasure.engine import (
    Backend,
    mac,
    mac_strided,
    mac_words,
    resolve_backend,
    syndrome_fold,
    syndrome_kernel_applies,
)
from leto.erasure.gf16 import mat_mul
from leto.erasure.rs import CauchyCode, DecodePlan, GRSCode, SyndromeDecode

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RebuildReport:
    """What :meth:`ProtectionGroup.rebuild` did."""

    data_pages: tuple[int, ...]
    tier1_pages: tuple[int, ...]
    tier2_pages: tuple[int, ...]
    tier2_reencoded: bool
    """Tier 2 could not rebuild the lost tier-1 pages (too many tier-2-code erasures), so
    tier 1 rebuilt them from the data and tier 2 was re-encoded."""
    seconds: float
    plan_seconds: float = 0.0
    """Of ``seconds``, the host-side planning (matrix inversion and composition)."""


def _check_flat(name: str, t: torch.Tensor, nbytes: int | None = None) -> None:
    if t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise TypeError(
            f"{name} must be a contiguous flat uint8 tensor, got {t.dtype} {tuple(t.shape)}"
        )
    if nbytes is not None and t.numel() != nbytes:
        raise ValueError(f"{name} has {t.numel()} bytes, expected {nbytes}")


class ProtectionGroup:
    """Encode, incrementally update and rebuild one group's two parity tiers.

    ``data`` holds the group's present pages (a multiple of ``page_bytes``, at most
    ``data_pages`` pages; a short last group is padded with logical zero pages).
    ``tier1`` is ``tier1_parity * page_bytes`` bytes, ``tier2`` ``tier2_parity *
    page_bytes``, both on one device (host memory in production).
    """

    def __init__(
        self,
        config: ErasureConfig,
        data: torch.Tensor,
        tier1: torch.Tensor,
        tier2: torch.Tensor,
        *,
        backend: Backend = "auto",
        syndromes: bool = False,
    ) -> None:
        pb = config.page_bytes
        _check_flat("data", data)
        _check_flat("tier1", tier1, config.tier1_parity * pb)
        _check_flat("tier2", tier2, config.tier2_parity * pb)
        if data.numel() % pb or not 0 < data.numel() // pb <= config.data_pages:
            raise ValueError(
                f"data has {data.numel()} bytes: need 1..{config.data_pages} "
                f"whole pages of {pb} bytes"
            )
        if tier1.device != tier2.device:
            raise ValueError("tier1 and tier2 parity must live on one device")
        self.config = config
        self.data, self.tier1, self.tier2 = data, tier1, tier2
        self.num_pages = data.numel() // pb
        self.backend = backend
        self.grs = GRSCode(config.data_pages, config.tier1_parity)
        self.syndromes = syndromes
        self.code1 = self.grs.syndromes() if syndromes else self.grs
        self.code2 = CauchyCode(config.tier1_parity, config.tier2_parity)
        self._c1 = self.code1.coef(range(self.num_pages))
        self._c2 = self.code2.coef()
        c21 = mat_mul(
            np.array(self._c2, dtype=np.int64).reshape(-1, config.tier1_parity),
            self.grs.matrix[:, : self.num_pages],
        )
        self._c21 = tuple(tuple(int(v) for v in row) for row in c21)
        self._masks: dict[str, torch.Tensor] = {}

    # -- page views ---------------------------------------------------------------
    def data_page(self, j: int) -> torch.Tensor:
        pb = self.config.page_bytes
        return self.data[j * pb : (j + 1) * pb]

    def tier1_page(self, p: int) -> torch.Tensor:
        pb = self.config.page_bytes
        return self.tier1[p * pb : (p + 1) * pb]

    def tier2_page(self, q: int) -> torch.Tensor:
        pb = self.config.page_bytes
        return self.tier2[q * pb : (q + 1) * pb]

    def _on_device(self) -> bool:
        return resolve_backend(self.backend, self.data.device) == "triton"

    def _device_masks(self, name: str, coef: tuple[tuple[int, ...], ...]) -> torch.Tensor:
        """Kernel masks for a fixed matrix, uploaded once (``[n_src, 16, n_out * 16]``)."""
        if name not in self._masks:
            self._masks[name] = plane_masks(coef).to(self.data.device)
        return self._masks[name]

    # -- encode ---------------------------------------------------------------------
    def encode_all(self) -> None:
        """Compute both tiers from scratch (allocation time, the gradients of every step,
        after a snapshot). On the device path both tiers are computed where the data lives
        and copied to the tiers' memory once."""
        t1 = self._encode_tier1_by_syndromes()
        if t1 is None:
            self.encode_tier1()
            self.encode_tier2()
            return
        pb, h2 = self.config.page_bytes, self.config.tier2_parity
        t2 = torch.empty(h2 * pb, dtype=torch.uint8, device=t1.device)
        self.encode_tier2_of(t1, t2)
        self.tier1.copy_(t1, non_blocking=True)
        self.tier2.copy_(t2, non_blocking=True)
        if t1.is_cuda and not self.tier1.is_cuda:  # the host tiers are final on return
            torch.cuda.current_stream(t1.device).synchronize()

    def _encode_tier1_by_syndromes(self) -> torch.Tensor | None:
        """Tier 1 of the data on its device (a new buffer) by the Horner kernel: syndromes
        ``S = V d`` of all pages in one launch, then ``P = W^-1 S`` (a syndrome-form group
        keeps S): cheaper than the generic kernel's product. None where the kernel does not
        apply (:func:`leto.erasure.engine.syndrome_kernel_applies`)."""
        h1, pb = self.config.tier1_parity, self.config.page_bytes
        dev = self.data.device
        if not syndrome_kernel_applies(self.backend, dev, h1, self.num_pages):
            return None
        s = torch.empty(h1 * pb, dtype=torch.uint8, device=dev)
        syndrome_fold(
            self.config.data_pages,
            self.grs.first_row,
            0,
            self.num_pages,
            self.data.view(torch.int32),
            pb // 4,
            None,
            pb // 4,
            None,
            s.view(torch.int32),
            0,
            pb // 4,
            h1,
            pb // TILE_BYTES,
        )
        if self.syndromes:
            return s
        p = torch.empty_like(s)
        self.parity_of(s, p)
        return p

    def encode_tier1(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tier-1 parity of the current data, into ``out`` (default: ``self.tier1``)."""
        out = self.tier1 if out is None else out
        h1 = self.config.tier1_parity
        t1 = self._encode_tier1_by_syndromes()
        if t1 is not None:
            out.copy_(t1)
            return out
        srcs = [self.data_page(j) for j in range(self.num_pages)]
        if self._on_device() and out.device != self.data.device:
            scratch = torch.empty(out.numel(), dtype=torch.uint8, device=self.data.device)
            self._mac_t1(srcs, scratch)
            out.copy_(scratch)
        else:
            self._mac_t1(srcs, out)
        logger.debug("encoded tier 1", extra={"pages": self.num_pages, "parity": h1})
        return out

    def _mac_t1(self, srcs: list[torch.Tensor], out: torch.Tensor) -> None:
        pb = self.config.page_bytes
        outs = [out[p * pb : (p + 1) * pb] for p in range(self.config.tier1_parity)]
        masks = self._device_masks("c1", self._c1) if out.is_cuda else None
        mac(self._c1, srcs, outs, accumulate=False, backend=self.backend, masks=masks)

    def encode_tier2(self) -> None:
        """Tier-2 parity over the tier-1 pages (runs where the parity lives)."""
        self.encode_tier2_of(self.tier1, self.tier2)

    def encode_tier2_of(self, tier1: torch.Tensor, out: torch.Tensor) -> None:
        """Tier-2 parity of ``tier1`` (this group's tier 1 or a copy of it, e.g. the
        updater's working parity on the device) into ``out``, where both live: the Triton
        kernel on CUDA, PyTorch on CPU. The bytes equal :meth:`encode_tier2` of the same
        tier 1 (the engines are bit-identical)."""
        pb, h1, h2 = self.config.page_bytes, self.config.tier1_parity, self.config.tier2_parity
        if h2 == 0:
            return
        _check_flat("tier1", tier1, h1 * pb)
        _check_flat("out", out, h2 * pb)
        if tier1.device != out.device:
            raise ValueError("tier1 and out must live on one device")
        masks = (
            self._device_masks("c2", self._c2)
            if out.device == self.data.device and out.is_cuda
            else None
        )
        mac(
            self._c2,
            [tier1[p * pb : (p + 1) * pb] for p in range(h1)],
            [out[q * pb : (q + 1) * pb] for q in range(h2)],
            accumulate=False,
            backend=self.backend,
            masks=masks,
        )

    def syndromes_of(self, parity: torch.Tensor, out: torch.Tensor) -> None:
        """``out = W parity``: the tier-1 syndromes of a tier-1 parity buffer (16 pages in,
        16 out, on the device both live on)."""
        self._convert("to_syndromes", self.grs.to_syndromes, parity, out)

    def parity_of(self, syndromes: torch.Tensor, out: torch.Tensor) -> None:
        """``out = W^-1 syndromes``: the tier-1 parity of a syndrome buffer."""
        self._convert("from_syndromes", self.grs.from_syndromes, syndromes, out)

    def _convert(self, name: str, m: np.ndarray, src: torch.Tensor, out: torch.Tensor) -> None:
        pb, h1 = self.config.page_bytes, self.config.tier1_parity
        _check_flat("src", src, h1 * pb)
        _check_flat("out", out, h1 * pb)
        if src.device != out.device or src.data_ptr() == out.data_ptr():
            raise ValueError("conversion needs distinct buffers on one device")
        coef = tuple(tuple(int(v) for v in row) for row in m)
        masks = self._device_masks(name, coef) if out.is_cuda and self._on_device() else None
        mac(
            coef,
            [src[p * pb : (p + 1) * pb] for p in range(h1)],
            [out[p * pb : (p + 1) * pb] for p in range(h1)],
            accumulate=False,
            backend=self.backend,
            masks=masks,
        )

    # -- incremental update ----------------------------------------------------------
    def _check_range(
        self, page_index: int, byte_offset: int, old: torch.Tensor, new: torch.Tensor
    ) -> None:
        _check_flat("old", old)
        _check_flat("new", new)
        n = old.numel()
        if new.numel() != n or old.device != new.device:
            raise ValueError("old and new must have the same size and device")
        if not 0 <= page_index < self.num_pages:
            raise IndexError(f"page {page_index} not in group of {self.num_pages} pages")
        if byte_offset % TILE_BYTES or n % TILE_BYTES:
            raise ValueError(
                f"update range [{byte_offset}, +{n}) must be aligned to "
                f"{TILE_BYTES}-byte tiles; align chunk boundaries to 2 KiB"
            )
        if byte_offset < 0 or byte_offset + n > self.config.page_bytes:
            raise ValueError(f"update range [{byte_offset}, +{n}) leaves the page")

    def update(
        self, page_index: int, byte_offset: int, old: torch.Tensor, new: torch.Tensor
    ) -> None:
        """Fold the change ``old -> new`` of bytes ``[byte_offset, +len)`` of data page
        ``page_index`` into both parity tiers, in place.

        ``parity_p ^= c[p][j] * (old ^ new)`` on tier 1 and the composed coefficients on
        tier 2. The data itself is not touched (the optimizer already wrote ``new``).
        """
        self._check_range(page_index, byte_offset, old, new)
        pb, n = self.config.page_bytes, old.numel()
        h1, h2 = self.config.tier1_parity, self.config.tier2_parity
        col = [(row[page_index],) for row in self._c1] + [(row[page_index],) for row in self._c21]
        dests = [self.tier1[p * pb + byte_offset : p * pb + byte_offset + n] for p in range(h1)]
        dests += [self.tier2[q * pb + byte_offset : q * pb + byte_offset + n] for q in range(h2)]
        if old.device == self.tier1.device:
            mac(col, [new], dests, accumulate=True, srcs_xor=[old], backend=self.backend)
            return
        scratch = torch.empty((h1 + h2) * n, dtype=torch.uint8, device=old.device)
        outs = [scratch[k * n : (k + 1) * n] for k in range(h1 + h2)]
        mac(col, [new], outs, accumulate=False, srcs_xor=[old], backend=self.backend)
        host = scratch.cpu() if self.tier1.device.type == "cpu" else scratch.to(self.tier1.device)
        for k, d in enumerate(dests):
            d ^= host[k * n : (k + 1) * n]

    def update_into(
        self,
        parity: torch.Tensor,
        page_index: int,
        byte_offset: int,
        old: torch.Tensor,
        new: torch.Tensor,
    ) -> None:
        """Like :meth:`update` but for tier 1 only, accumulated into ``parity`` (a scratch
        copy of tier 1 on the data's device, ``tier1_parity * page_bytes`` bytes).

        This is the updater's per-chunk path; after the group it calls
        :meth:`commit_tier1` with the same buffer.
        """
        self._check_range(page_index, byte_offset, old, new)
        _check_flat("parity", parity, self.tier1.numel())
        pb, n = self.config.page_bytes, old.numel()
        h1 = self.config.tier1_parity
        dests = [parity[p * pb + byte_offset : p * pb + byte_offset + n] for p in range(h1)]
        masks = None
        if parity.is_cuda and self._on_device():
            masks = self._device_masks("c1", self._c1)[page_index : page_index + 1]
        col = [(row[page_index],) for row in self._c1]
        mac(col, [new], dests, accumulate=True, srcs_xor=[old], backend=self.backend, masks=masks)

    def update_pages(
        self,
        parity: torch.Tensor,
        first_page: int,
        k: int,
        byte_offset: int,
        old: torch.Tensor,
        new: torch.Tensor,
        *,
        parity_in: torch.Tensor | None = None,
    ) -> None:
        """:meth:`update_into` for a chunk of ``k`` consecutive pages, in one launch.

        Bytes ``[byte_offset, +n)`` of data pages ``first_page .. first_page + k - 1``
        changed from ``old`` to ``new``. ``old``/``new`` are either flat uint8 tensors of
        ``k * n`` bytes (page ``first_page + i`` at ``[i * n, (i + 1) * n)``) or ``[k, n]``
        uint8 views with unit inner stride (e.g. ``data.view(D, page_bytes)[j0:j0 + k,
        lo:hi]``). ``parity`` is the tier-1 scratch of :meth:`update_into`; the range of
        every parity page is read and written once. On CUDA the call does no host-side
        work beyond argument checks: the encode masks are cached on the device (built at
        the first call), offsets are scalars, and the kernel is launched once, so it can
        also be captured in a CUDA graph. :meth:`commit_tier1` refreshes tier 2 after.

        ``parity_in`` (same shape as ``parity``): read the range's old parity from it
        instead, i.e. ``parity = parity_in ^ delta`` on the range (out of place; the
        updater's double buffer). The syndrome kernel does that in its one pass; the other
        paths copy the range first.
        """
        pb, h1 = self.config.page_bytes, self.config.tier1_parity
        o2, n2 = self._chunk_view("old", old, k), self._chunk_view("new", new, k)
        n = o2.shape[1]
        if new.device != old.device or n2.shape[1] != n:
            raise ValueError("old and new must have the same shape and device")
        if not (0 <= first_page and first_page + k <= self.num_pages):
            raise IndexError(f"pages [{first_page}, +{k}) not in group of {self.num_pages}")
        if byte_offset % TILE_BYTES or n % TILE_BYTES or byte_offset < 0 or byte_offset + n > pb:
            raise ValueError(
                f"update range [{byte_offset}, +{n}) must be whole "
                f"{TILE_BYTES}-byte tiles inside the page"
            )
        if parity.dtype != torch.uint8 or parity.numel() != h1 * pb:
            raise ValueError(f"parity must be {h1 * pb} uint8 bytes")
        if parity_in is not None and (
            parity_in.shape != parity.shape or parity_in.device != parity.device
        ):
            raise ValueError("parity_in must match parity in size and device")
        if n == 0 or k == 0:
            if parity_in is not None:
                parity.view(h1, pb)[:, byte_offset : byte_offset + n].copy_(
                    parity_in.view(h1, pb)[:, byte_offset : byte_offset + n]
                )
            return
        if (
            self.syndromes
            and parity.device == old.device == new.device
            and syndrome_kernel_applies(self.backend, self.data.device, h1, k)
        ):
            q = parity.view(torch.int32)
            syndrome_fold(
                self.config.data_pages,
                self.grs.first_row,
                first_page,
                k,
                n2.view(torch.int32),
                n2.stride(0) // 4,
                o2.view(torch.int32),
                o2.stride(0) // 4,
                q if parity_in is None else parity_in.view(torch.int32),
                q,
                byte_offset // 4,
                pb // 4,
                h1,
                n // TILE_BYTES,
            )
            return
        if parity_in is not None:
            parity.view(h1, pb)[:, byte_offset : byte_offset + n].copy_(
                parity_in.view(h1, pb)[:, byte_offset : byte_offset + n]
            )
        if self._on_device() and parity.device == old.device == new.device:
            masks = self._device_masks("c1", self._c1)
            mac_strided(
                masks,
                first_page,
                k,
                n2.view(torch.int32),
                n2.stride(0) // 4,
                parity.view(torch.int32),
                byte_offset // 4,
                pb // 4,
                n // TILE_BYTES,
                accumulate=True,
                src2=o2.view(torch.int32),
                src2_stride=o2.stride(0) // 4,
            )
            return
        coef = [row[first_page : first_page + k] for row in self._c1]
        dests = [parity[p * pb + byte_offset : p * pb + byte_offset + n] for p in range(h1)]
        mac(
            coef,
            [n2[i] for i in range(k)],
            dests,
            accumulate=True,
            srcs_xor=[o2[i] for i in range(k)],
            backend="torch",
        )

    @staticmethod
    def _chunk_view(name: str, t: torch.Tensor, k: int) -> torch.Tensor:
        """``t`` as a ``[k, n]`` uint8 view (see :meth:`update_pages`)."""
        if t.dtype != torch.uint8:
            raise TypeError(f"{name} must be uint8, got {t.dtype}")
        if t.dim() == 1:
            if k <= 0 or t.numel() % k or not t.is_contiguous():
                raise ValueError(f"{name}: {t.numel()} contiguous bytes are not {k} equal rows")
            t = t.view(k, -1)
        if t.dim() != 2 or t.shape[0] != k or (t.shape[1] > 1 and t.stride(1) != 1):
            raise ValueError(
                f"{name} must be [k, n] with unit inner stride, got "
                f"{tuple(t.shape)} strides {t.stride()}"
            )
        if t.stride(0) % 4 or t.data_ptr() % 4:
            raise ValueError(f"{name} rows must be 4-byte aligned")
        return t

    def commit_tier1(self, parity: torch.Tensor) -> None:
        """Install a tier-1 buffer kept current by :meth:`update_into` and refresh tier 2."""
        _check_flat("parity", parity, self.tier1.numel())
        self.tier1.copy_(parity)
        self.encode_tier2()

    # -- rebuild -----------------------------------------------------------------
    def rebuild(
        self,
        lost_data_pages: Iterable[int] = (),
        lost_tier1_pages: Iterable[int] = (),
        lost_tier2_pages: Iterable[int] = (),
    ) -> RebuildReport:
        """Rebuild lost pages in place: tier 2 first, then tier 1 (paper §4.2).

        The lost pages' memory must already be usable (remapped); its contents are
        ignored. Tier-1 pages that tier 2 cannot restore count as erasures of the tier-1
        code, which rebuilds them from the data when it can. Raises
        :class:`UnrecoverableStateError`, touching nothing, when the erasures exceed
        what the two codes can repair together.
        """
        t0 = time.perf_counter()
        ld = sorted(set(lost_data_pages))
        l1 = sorted(set(lost_tier1_pages))
        l2 = sorted(set(lost_tier2_pages))
        h2 = self.config.tier2_parity
        h1 = self.config.tier1_parity
        if any(not 0 <= p < h1 for p in l1) or any(not 0 <= q < h2 for q in l2):
            raise ValueError(
                f"lost parity pages out of range: tier1 {l1} (of {h1}), tier2 {l2} (of {h2})"
            )
        via_tier2 = bool(l1 or l2) and len(l1) + len(l2) <= h2
        t1_erasures = [] if via_tier2 else l1
        # Plan everything before writing anything: failure must leave the state untouched.
        if (ld or t1_erasures) and self._syndrome_kernel_applies():
            plan1: DecodePlan | SyndromeDecode = self.code1.syndrome_decode(
                ld, t1_erasures, present_data=self.num_pages
            )
        else:
            plan1 = self.code1.decode_plan(ld, t1_erasures, present_data=self.num_pages)
        plan2 = self.code2.decode_plan(l1, l2) if via_tier2 else None
        t_plan = time.perf_counter() - t0
        if plan2 is not None:
            self._run_plan(plan2, self.tier1_page, self.tier2_page)
        if isinstance(plan1, SyndromeDecode):
            self._rebuild_t1_by_syndromes(plan1)
        elif plan1.outputs:
            self._run_plan_t1(plan1)
        reencode = not via_tier2 and bool(l1 or l2) and h2 > 0
        if reencode:
            self.encode_tier2()
        report = RebuildReport(
            tuple(ld), tuple(l1), tuple(l2), reencode, time.perf_counter() - t0, t_plan
        )
        logger.info(
            "rebuilt pages", extra={"data": ld, "tier1": l1, "tier2": l2, "seconds": report.seconds}
        )
        return report

    def _tier1_to_device(self, pages: Sequence[int], out: torch.Tensor) -> torch.cuda.Stream | None:
        """Start copying tier-1 ``pages`` into consecutive pages of the device buffer ``out``
        (host -> device, async when tier 1 is pinned) on a side stream, so the copies overlap
        the kernel that reads the data; the caller waits on the returned stream (None: the
        copies were synchronous, or there were none)."""
        pb, dev = self.config.page_bytes, out.device
        side = torch.cuda.Stream(device=dev) if dev.type == "cuda" and pages else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(dev))
            out.record_stream(side)
        with torch.cuda.stream(side) if side is not None else _nullctx():
            for k, q in enumerate(pages):
                out[k * pb : (k + 1) * pb].copy_(self.tier1_page(q), non_blocking=True)
        return side

    def _words_from_data(self, t: torch.Tensor) -> int:
        """``t``'s start in int32 words from the data's (the kernels address scratch that way)."""
        return (t.data_ptr() - self.data.data_ptr()) // 4

    def _syndrome_kernel_applies(self) -> bool:
        """The Horner kernel serves this group's tier 1 (the device engine, H1 <= 16)."""
        return syndrome_kernel_applies(self.backend, self.data.device, self.config.tier1_parity)

    def _rebuild_t1_by_syndromes(self, plan: SyndromeDecode) -> None:
        """Rebuild tier-1 erasures on the device through syndromes (:class:`SyndromeDecode`).

        The lost data pages are zeroed; the Horner kernel folds every data page into the
        first ``e`` syndromes ``R`` (one launch over the group) while
        the surviving parity pages it needs travel to the device on a side stream; a small
        product adds them to ``R``, and ``c = M^-1 R`` writes the lost data pages in place
        and the lost tier-1 pages through scratch. Against the one-pass plan of
        :meth:`_run_plan_t1` (a 16 x 1008 composition on the host, then a product reading
        every surviving page with 16 outputs) this reads the data once with ~10 XORs per
        byte instead of 64, and plans one ``e x e`` inverse."""
        pb, dev, e = self.config.page_bytes, self.data.device, plan.rows
        pw, n_tiles = pb // 4, pb // TILE_BYTES
        lost_data = [r.index for r in plan.outputs if r.kind == "data"]
        lost_par = [r.index for r in plan.outputs if r.kind == "parity"]
        for j in lost_data:
            self.data_page(j).zero_()  # a remapped page's contents are not trusted
        n_in = len(plan.parity_sources)
        buf = torch.empty((e + n_in + max(len(lost_par), 1)) * pb, dtype=torch.uint8, device=dev)
        syn, par_in, par_out = buf[: e * pb], buf[e * pb : (e + n_in) * pb], buf[(e + n_in) * pb :]
        side = self._tier1_to_device(plan.parity_sources, par_in)
        base = self.data.view(torch.int32)
        syndrome_fold(
            self.config.data_pages,
            self.grs.first_row,
            0,
            self.num_pages,
            base,
            pw,
            None,
            pw,
            None,
            syn.view(torch.int32),
            0,
            pw,
            e,
            n_tiles,
        )
        if side is not None:
            torch.cuda.current_stream(dev).wait_stream(side)

        def offsets(
            t: torch.Tensor, n: int
        ) -> list[int]:  # pages of t, in words from the data's start
            return [self._words_from_data(t) + k * pw for k in range(n)]

        syn_off = torch.tensor(offsets(syn, e), dtype=torch.int64, device=dev)
        if n_in:
            mac_words(
                plane_masks_tensor(torch.from_numpy(plan.parity_coef).to(dev)),
                base,
                torch.tensor(offsets(par_in, n_in), dtype=torch.int64, device=dev),
                base,
                syn_off,
                n_tiles,
                accumulate=True,
            )
        dst = [j * pw for j in lost_data] + offsets(par_out, len(lost_par))
        mac_words(
            plane_masks_tensor(torch.from_numpy(plan.inverse).to(dev)),
            base,
            syn_off,
            base,
            torch.tensor(dst, dtype=torch.int64, device=dev),
            n_tiles,
            accumulate=False,
        )
        for k, q in enumerate(lost_par):
            self.tier1_page(q).copy_(par_out[k * pb : (k + 1) * pb])

    def _run_plan(
        self,
        plan: DecodePlan,
        data_page: Callable[[int], torch.Tensor],
        parity_page: Callable[[int], torch.Tensor],
    ) -> None:
        srcs = [(data_page if r.kind == "data" else parity_page)(r.index) for r in plan.sources]
        outs = [(data_page if r.kind == "data" else parity_page)(r.index) for r in plan.outputs]
        mac(plan.coef, srcs, outs, accumulate=False, backend=self.backend)

    def _run_plan_t1(self, plan: DecodePlan) -> None:
        if not self._on_device():
            self._run_plan(plan, self.data_page, self.tier1_page)
            return
        # Kernel path (data on the GPU, tier 1 usually on the host). Lost data pages are
        # written in place by one launch over the surviving data pages (offset tables,
        # masks built on the device from the plan's matrix); meanwhile the parity pages it
        # needs travel host -> device on a side stream (async when tier 1 is pinned), and a
        # second, small launch folds them in. Lost tier-1 pages go through device scratch.
        pb, dev = self.config.page_bytes, self.data.device
        pw = pb // 4
        base = self.data.view(torch.int32)
        nd = sum(1 for r in plan.sources if r.kind == "data")
        used = [r.index for r in plan.sources[nd:]]
        lost_par = [r.index for r in plan.outputs if r.kind == "parity"]
        par_in = torch.empty(max(len(used), 1) * pb, dtype=torch.uint8, device=dev)
        par_out = torch.empty(max(len(lost_par), 1) * pb, dtype=torch.uint8, device=dev)
        side = self._tier1_to_device(used, par_in)
        matrix = plan.matrix if plan.matrix is not None else np.array(plan.coef, np.int64)
        masks = plane_masks_tensor(torch.from_numpy(matrix).to(dev))  # [n_src, 16, n_out*16]
        rel = self._words_from_data

        dst, kp = [], 0
        for r in plan.outputs:
            if r.kind == "data":
                dst.append(r.index * pw)
            else:
                dst.append(rel(par_out) + kp * pw)
                kp += 1
        src = np.array(
            [r.index * pw for r in plan.sources[:nd]]
            + [rel(par_in) + k * pw for k in range(len(used))],
            dtype=np.int64,
        )
        offs = torch.from_numpy(np.concatenate([src, np.array(dst, dtype=np.int64)]))
        offs = offs.to(dev)
        src_off, dst_off = offs[: len(src)], offs[len(src) :]
        n_tiles = pb // TILE_BYTES
        if nd:
            mac_words(masks[:nd], base, src_off[:nd], base, dst_off, n_tiles, accumulate=False)
        else:
            for r in plan.outputs:
                if r.kind == "data":
                    self.data_page(r.index).zero_()
            par_out.zero_()
        if used:
            if side is not None:
                torch.cuda.current_stream(dev).wait_stream(side)
            mac_words(masks[nd:], base, src_off[nd:], base, dst_off, n_tiles, accumulate=True)
        for k, p in enumerate(lost_par):
            self.tier1_page(p).copy_(par_out[k * pb : (k + 1) * pb])


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
