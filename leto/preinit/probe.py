"""What an active trainer knows about its device's memory, read after each committed step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from leto.preinit.config import PreinitConfig


@dataclass(frozen=True, slots=True)
class MemoryReading:
    device: int
    total_bytes: int
    free_bytes: int
    """Free on the whole device (every process counted: other trainers, shadows)."""
    reserved_bytes: int
    """Held by this process's caching allocator now."""
    peak_bytes: int
    """The most it ever held (a caching allocator keeps a peak's blocks reserved)."""

    def words(self) -> tuple[int, int, int, int, int]:
        return (
            self.device,
            self.total_bytes,
            self.free_bytes,
            self.reserved_bytes,
            self.peak_bytes,
        )


class MemoryProbe(Protocol):
    def read(self) -> MemoryReading: ...

    def free_bytes(self) -> int: ...

    def demand(self, nbytes: int) -> None: ...


def reserved_bytes(device: torch.device) -> tuple[int, int]:
    """The caching allocator's reserved bytes on ``device``, now and at their peak: one read
    of its statistics, as nested as the allocator keeps them (``torch.cuda.memory_stats``
    flattens the whole tree, which a trainer reading it every step would pay for)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    reserved = stats.get("reserved_bytes", {}).get("all", {})
    return int(reserved.get("current", 0)), int(reserved.get("peak", 0))


class CudaProbe:
    """The real device: ``cudaMemGetInfo`` and the caching allocator's statistics.

    Only active trainers read it (they hold a CUDA context anyway); the agent never
    creates one.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def read(self) -> MemoryReading:
        free, total = torch.cuda.mem_get_info(self.device)
        reserved, peak = reserved_bytes(self.device)
        return MemoryReading(
            device=self.device.index or 0,
            total_bytes=total,
            free_bytes=free,
            reserved_bytes=reserved,
            peak_bytes=peak,
        )

    def free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def demand(self, nbytes: int) -> None:
        """Real allocations make their own demand."""


class EmulatedProbe:
    """CPU runs (tests, demos): a device of ``total_bytes`` per rank, used by this trainer only.

    The trainer holds ``trainer_bytes``; ``demand`` records a transient activation peak (an
    injected ``oom`` fault's ``oom_bytes``), which, as with a caching allocator, stays
    reserved in this process.
    """

    def __init__(self, device: int, total_bytes: int, trainer_bytes: int) -> None:
        self.device, self.total_bytes, self._peak = device, total_bytes, trainer_bytes
        self.trainer_bytes = trainer_bytes

    def read(self) -> MemoryReading:
        return MemoryReading(
            device=self.device,
            total_bytes=self.total_bytes,
            free_bytes=self.free_bytes(),
            reserved_bytes=self._peak,
            peak_bytes=self._peak,
        )

    def free_bytes(self) -> int:
        return self.total_bytes - self._peak

    def demand(self, nbytes: int) -> None:
        self._peak = max(self._peak, min(self.total_bytes, self.trainer_bytes + nbytes))


def probe_for(device: torch.device, local_rank: int, config: PreinitConfig) -> MemoryProbe | None:
    """The real probe on a GPU, the emulated one when configured on CPU, else none."""
    if device.type == "cuda":
        return CudaProbe(device)
    if config.emulated_device_bytes:
        return EmulatedProbe(
            local_rank, config.emulated_device_bytes, config.emulated_trainer_bytes
        )
    return None
