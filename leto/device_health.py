"""Is the GPU still usable? The checks that separate a HOF from an FF on a GPU machine.

A trainer killed by a signal leaves usable hardware on CPU. On a GPU it may have died
*because* the device failed (an uncorrectable ECC error, a row-remap failure, a GPU that
fell off the bus): promoting a shadow onto that device would crash again or, worse,
compute on bad memory. Two checks guard in-place recovery:

* :class:`NvmlHealth`, in the agent, before it decides: NVML (``nvidia-ml-py``, which
  creates no CUDA context and costs no device memory) reads each local GPU's fatal
  counters — volatile uncorrected ECC errors, pending or failed row remaps, pages pending
  retirement — and whether the device still answers. Counters are compared with a
  baseline taken when the agent started, so a GPU with an old, already-handled error is
  not condemned. Any new fatal condition turns the HOF into an FF (group restart from the
  checkpoint).
* :func:`check_device`, in every promoted shadow, before it touches retained state: a
  small kernel with a known, exactly representable answer (an integer-valued matmul and a
  write/read pattern over 64 MiB); a wrong result or a CUDA error raises
  :class:`DeviceUnhealthyError`, which the trainer reports as fatal.

Without NVML (CPU machines, no driver) :class:`NvmlHealth` reports nothing and says so
once; the kernel check runs on any device.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from types import ModuleType
from typing import Any

from leto.errors import LetoError

logger = logging.getLogger(__name__)


class DeviceUnhealthyError(LetoError):
    """The device failed its health check: the rank must not resume on it."""


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceCounters:
    """The fatal-condition counters NVML reports for one GPU."""

    uncorrected_ecc: int = 0
    """Volatile uncorrected ECC errors (since the driver loaded)."""
    remap_pending: bool = False
    """A row remap is pending: the GPU needs a reset before the row is usable."""
    remap_failed: bool = False
    """A row remap failed: the GPU has memory it can no longer repair."""
    retired_pending: bool = False
    """Pages wait for retirement (pre-Ampere page retirement)."""


class NvmlHealth:
    """Agent-side GPU health: a baseline at start, a verdict at each failure.

    ``nvml`` is the ``pynvml`` module (injected by tests); ``indices`` the NVML indices of
    this node's GPUs (default: all of them, as ``CUDA_VISIBLE_DEVICES`` narrows).
    """

    def __init__(self, nvml: ModuleType | None = None, indices: list[int] | None = None) -> None:
        self._nvml = nvml if nvml is not None else _load_nvml()
        self.indices: list[int] = []
        self._baseline: dict[int, DeviceCounters] = {}
        if self._nvml is None:
            return
        try:
            self._nvml.nvmlInit()
            self.indices = (
                indices
                if indices is not None
                else _visible_indices(self._nvml.nvmlDeviceGetCount())
            )
            self._baseline = {i: self._read(i) for i in self.indices}
        except Exception as e:  # noqa: BLE001 - no driver, no GPUs: nothing to watch
            logger.info("NVML unavailable (%s): GPU health is not checked", e)
            self._nvml, self.indices = None, []

    @property
    def available(self) -> bool:
        return self._nvml is not None and bool(self.indices)

    def check(self) -> list[str]:
        """One line per new fatal condition on this node's GPUs (empty: healthy)."""
        problems = []
        for index in self.indices:
            before = self._baseline[index]
            try:
                now = self._read(index)
            except Exception as e:  # noqa: BLE001 - a GPU that stopped answering is the worst case
                problems.append(f"GPU {index} does not answer NVML: {e}")
                continue
            if now.uncorrected_ecc > before.uncorrected_ecc:
                problems.append(
                    f"GPU {index}: {now.uncorrected_ecc - before.uncorrected_ecc} new uncorrected ECC errors"
                )
            for name, text in (
                ("remap_pending", "row remap pending (reset needed)"),
                ("remap_failed", "row remap failed"),
                ("retired_pending", "pages pending retirement"),
            ):
                if getattr(now, name) and not getattr(before, name):
                    problems.append(f"GPU {index}: {text}")
        return problems

    def _read(self, index: int) -> DeviceCounters:
        nvml = self._nvml
        assert nvml is not None
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        nvml.nvmlDeviceGetUUID(handle)  # raises NVMLError_GPUIsLost on a GPU off the bus
        ecc = _optional(
            lambda: nvml.nvmlDeviceGetTotalEccErrors(
                handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
            ),
            0,
        )
        remap = _optional(lambda: nvml.nvmlDeviceGetRemappedRows(handle), (0, 0, 0, 0))
        retired = _optional(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle), 0)
        return DeviceCounters(
            uncorrected_ecc=int(ecc),
            remap_pending=bool(remap[2]),
            remap_failed=bool(remap[3]),
            retired_pending=bool(retired),
        )


def _optional(read: Any, default: Any) -> Any:
    """A counter the GPU does not support (ECC off, no row remapping) reads as its default."""
    try:
        return read()
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported and friends
        return default


def _load_nvml() -> ModuleType | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _visible_indices(count: int) -> list[int]:
    """NVML indices of the GPUs this node's trainers see (``CUDA_VISIBLE_DEVICES`` order)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(range(count))
    indices = [int(v) for v in visible.split(",") if v.strip().isdigit()]
    return [i for i in indices if i < count]


_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd int64: the pattern touches every bit


def _wrap64(value: int) -> int:
    """``value`` as an int64 sum wraps it."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >> 63 else value


def check_device(device: Any, pattern_bytes: int = 64 << 20, *, flip_bit: bool = False) -> float:
    """Run a small kernel with an exact answer on ``device``; returns the seconds it took.

    The matmul has small integer operands, so every product and sum is exact in fp32 on
    any device and any reduction order: the result is compared bit for bit with the
    closed form. The pattern pass writes and reads back ``pattern_bytes`` of fresh memory.
    ``flip_bit`` is the fault injector's broken device: one bit of the result flips.
    """
    import torch

    start = time.perf_counter()
    device = torch.device(device)
    n = 256
    try:
        a = (torch.arange(n * n, device=device, dtype=torch.float32) % 7).reshape(n, n)
        ones = torch.ones(n, n, device=device, dtype=torch.float32)
        got = (a @ ones)[:, 0].cpu()
        if flip_bit:
            got.view(torch.int32)[0] ^= 1
        expected = (torch.arange(n * n, dtype=torch.float32) % 7).reshape(n, n).sum(dim=1)
        words = max(pattern_bytes // 8, 1)
        probe = torch.arange(words, device=device, dtype=torch.int64).mul_(_GOLDEN)
        ok_pattern = int(probe.sum()) == _wrap64(_GOLDEN * words * (words - 1) // 2)
        ok_sum = bool(torch.equal(got, expected))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except RuntimeError as e:  # a CUDA error (Xid, illegal address) surfaces here
        raise DeviceUnhealthyError(f"device check on {device} failed: {e}") from e
    if not (ok_sum and ok_pattern):
        raise DeviceUnhealthyError(f"device check on {device} computed a wrong result")
    return time.perf_counter() - start
