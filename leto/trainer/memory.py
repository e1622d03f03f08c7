"""Retained regions of one rank as torch tensors: device tier on the model's device.

CPU (and machines without a CUDA driver): every region is a memfd from the state manager,
mapped and wrapped with ``torch.frombuffer`` (zero copy). GPU: device regions are CUDA VMM
allocations (see ``leto.pool.cuda_vmm``) created by the first trainer, deposited with the
state manager and imported by successors; host regions stay memfds, page-locked with
``cudaHostRegister`` so device-to-host copies run at full speed.
"""

from __future__ import annotations

import hashlib
import os

import torch

from leto.errors import PoolError
from leto.pool import cuda_vmm
from leto.pool.client import PoolClient

_DIGEST_CHUNK = 1 << 26  # int64 words per chunk of the on-device digest


class RegionMemory:
    """Allocates or reattaches this rank's regions and keeps their mappings alive."""

    def __init__(self, pool: PoolClient, rank: int, device: torch.device) -> None:
        self.pool, self.rank, self.device = pool, rank, device
        self.cuda = device.type == "cuda"
        if self.cuda and not cuda_vmm.available():
            raise PoolError("the model is on CUDA but the CUDA driver API is unavailable")
        self._keep: list[object] = []

    def device_region(self, name: str, nbytes: int) -> tuple[torch.Tensor, bool]:
        """(uint8 tensor on the model's device, True when it was already retained)."""
        if not self.cuda:
            return self.host_region(name, nbytes, tier="device")
        index = self.device.index or 0
        requested, nbytes = nbytes, cuda_vmm.round_up(nbytes, index)
        found = self.pool.fetch(self.rank, name)
        existing = found is not None
        fd = found[2] if existing else cuda_vmm.create(nbytes, index)
        try:
            if existing:
                spec, backing, _ = found
                if backing != "cuda" or spec.nbytes != nbytes:
                    raise PoolError(
                        f"reattach of rank {self.rank} region {name!r} does not match: retained "
                        f"{spec.nbytes} B {backing}, asked {nbytes} B cuda"
                    )
            else:
                self.pool.deposit(self.rank, name, nbytes, fd)
            mapping = cuda_vmm.map_fd(fd, nbytes, index)
        finally:
            os.close(fd)  # the state manager holds the allocation; the mapping holds this view
        self._keep.append(mapping)
        tensor = torch.as_tensor(mapping, device=self.device)
        if not existing:
            tensor.zero_()  # cuMemCreate memory is uninitialised; padding must digest the same
        return tensor[:requested], existing  # the allocation is rounded up to the VMM granularity

    def host_region(self, name: str, nbytes: int, tier: str = "host") -> tuple[torch.Tensor, bool]:
        region = self.pool.alloc(self.rank, name, nbytes, "uint8", tier)  # type: ignore[arg-type]
        self._keep.append(region)
        tensor = torch.frombuffer(region.buffer, dtype=torch.uint8)
        if self.cuda and tier == "host" and nbytes >= 1 << 20:
            torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
        return tensor, region.existing

    def fence(self) -> None:
        """Wait for queued device work: a marker written after it then tells the truth."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def digest(self, region: torch.Tensor) -> str:
        """A digest of a region's bytes (blake2b on CPU; two wrapping int64 sums on GPU)."""
        if not region.is_cuda:
            return hashlib.blake2b(region.numpy().tobytes(), digest_size=16).hexdigest()
        words = region[: region.numel() // 8 * 8].view(torch.int64)
        plain = torch.zeros((), dtype=torch.int64, device=region.device)
        weighted = torch.zeros((), dtype=torch.int64, device=region.device)
        for start in range(0, words.numel(), _DIGEST_CHUNK):
            chunk = words[start : start + _DIGEST_CHUNK]
            weights = torch.arange(start, start + chunk.numel(), device=region.device, dtype=torch.int64) * 2 + 1
            plain += chunk.sum()
            weighted += (chunk * weights).sum()
        return f"{int(plain) & (2**64 - 1):016x}{int(weighted) & (2**64 - 1):016x}"
