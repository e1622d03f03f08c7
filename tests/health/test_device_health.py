"""GPU health verdicts. NVML is replaced by a fake module here (CPU machines have none):
the test isolates the baseline/verdict logic; the real NVML runs in `make gpu-test`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from leto.device_health import DeviceUnhealthyError, NvmlHealth, check_device


class FakeNvml(SimpleNamespace):
    """The few pynvml calls NvmlHealth makes, over per-GPU counters a test can change."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, count: int) -> None:
        super().__init__()
        self.ecc = [0] * count
        self.remap = [(0, 0, 0, 0)] * count
        self.lost: set[int] = set()
        self.no_ecc = False

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.ecc)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        if handle in self.lost:
            raise RuntimeError("GPU is lost")
        return f"GPU-{handle}"

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int:
        assert (kind, counter) == (1, 0)
        if self.no_ecc:
            raise RuntimeError("Not Supported")
        return self.ecc[handle]

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        return self.remap[handle]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        raise RuntimeError("Not Supported")  # Ampere and later retire by row remapping


def test_new_fatal_conditions_are_reported_old_ones_are_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = FakeNvml(3)
    nvml.ecc[2] = 4  # an old error, handled before this job: not a verdict
    health = NvmlHealth(nvml)
    assert health.available and health.indices == [0, 1, 2]
    assert health.check() == []
    nvml.ecc[1] = 2
    nvml.remap[0] = (0, 0, 1, 0)
    problems = health.check()
    assert problems == [
        "GPU 0: row remap pending (reset needed)",
        "GPU 1: 2 new uncorrected ECC errors",
    ]
    nvml.lost.add(2)
    assert health.check()[-1].startswith("GPU 2 does not answer NVML")


def test_visible_devices_narrow_the_watch_and_unsupported_counters_read_as_healthy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    nvml = FakeNvml(4)
    nvml.no_ecc = True
    health = NvmlHealth(nvml)
    assert health.indices == [3, 1] and health.check() == []
    nvml.remap[1] = (0, 0, 0, 1)
    assert health.check() == ["GPU 1: row remap failed"]


def test_without_nvml_nothing_is_watched() -> None:
    class Broken(FakeNvml):
        def nvmlInit(self) -> None:
            raise RuntimeError("NVML Shared Library Not Found")

    health = NvmlHealth(Broken(1))
    assert not health.available and health.check() == []


def test_device_check_passes_on_a_good_device_and_catches_a_flipped_bit() -> None:
    assert check_device("cpu", pattern_bytes=1 << 16) >= 0.0
    with pytest.raises(DeviceUnhealthyError, match="wrong result"):
        check_device("cpu", pattern_bytes=1 << 16, flip_bit=True)
