"""Shadow levels, their device footprint, and the choice of the highest level that fits."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


class ShadowLevel(enum.IntEnum):
    """How far a shadow is pre-initialised (paper §6); each level includes the one below.

    L1: interpreter, imports, model on the meta device, PyTorch's lazy paths warmed on the
    CPU — no device memory. L2: + CUDA context on its device, cuBLAS warmed, retained
    regions mapped. L3: + the process group among the shadows (NCCL: its communicator).
    """

    L1 = 1
    L2 = 2
    L3 = 3


def footprints(l2_bytes: int, l3_bytes: int) -> dict[ShadowLevel, int]:
    """Device bytes of one shadow per level (L1 holds none)."""
    return {ShadowLevel.L1: 0, ShadowLevel.L2: l2_bytes, ShadowLevel.L3: l3_bytes}


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """One device as its active trainers reported it after a step with no shadow on it."""

    device: int
    total_bytes: int
    free_bytes: int
    """The device's free memory (the smallest of the ranks' reports)."""
    reserved_bytes: int
    """Held by the ranks' caching allocators when they reported (summed over ranks)."""
    peak_bytes: int
    """The allocators' peak reservation (summed over ranks)."""
    ranks: int
    """Active trainers on this device: a shadow each."""

    @property
    def headroom_bytes(self) -> int:
        """Free memory left with every rank at its peak: what the shadows may take."""
        return self.free_bytes - max(0, self.peak_bytes - self.reserved_bytes)


@dataclass(frozen=True, slots=True)
class LevelChoice:
    """A level and why (the ``shadow_level`` event carries these fields)."""

    level: ShadowLevel
    reason: str
    headroom_bytes: int | None = None
    """On the tightest device; None: no memory reports (CPU without emulation)."""
    free_bytes: int | None = None
    peak_bytes: int | None = None
    needed_bytes: int = 0
    """The chosen level's footprint on the tightest device, margin included."""


def choose_level(
    devices: Iterable[DeviceMemory],
    footprint: Mapping[ShadowLevel, int],
    *,
    max_level: ShadowLevel,
    margin_bytes: int,
    reason: str,
    fallback: ShadowLevel,
) -> LevelChoice:
    """The highest level up to ``max_level`` whose shadows fit every device with margin.

    ``fallback`` is the answer without reports. L1 always fits: it holds no device memory.
    """
    devices = list(devices)
    if not devices:
        return LevelChoice(level=min(fallback, max_level), reason=reason)
    for level in sorted((lv for lv in ShadowLevel if lv <= max_level), reverse=True):
        if level == ShadowLevel.L1 or all(
            d.ranks * footprint[level] + margin_bytes <= d.headroom_bytes for d in devices
        ):
            break
    tight = min(devices, key=lambda d: d.headroom_bytes - d.ranks * footprint[level])
    needed = tight.ranks * footprint[level] + (margin_bytes if footprint[level] else 0)
    return LevelChoice(
        level=level,
        reason=reason,
        headroom_bytes=tight.headroom_bytes,
        free_bytes=tight.free_bytes,
        peak_bytes=tight.peak_bytes,
        needed_bytes=needed,
    )


def aggregate(reports: Iterable[tuple[int, int, int, int, int]]) -> list[DeviceMemory]:
    """Per-rank ``(device, total, free, reserved, peak)`` reports → one entry per device."""
    by_device: dict[int, list[tuple[int, int, int, int, int]]] = {}
    for r in reports:
        by_device.setdefault(r[0], []).append(r)
    return [
        DeviceMemory(
            device=dev,
            total_bytes=max(r[1] for r in rs),
            free_bytes=min(r[2] for r in rs),
            reserved_bytes=sum(r[3] for r in rs),
            peak_bytes=sum(r[4] for r in rs),
            ranks=len(rs),
        )
        for dev, rs in sorted(by_device.items())
    ]
