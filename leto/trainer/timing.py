"""Per-phase step times, a diagnostic (``LETO_PHASE_TIMES=1``).

Each boundary synchronises the device so a phase is timed to the end of its kernels: the
step runs slower with it on, and the numbers say where the time goes, not how long an
unsynchronised step takes (``bench/recovery_gpu.py --iteration-only --phase-times``).
``LETO_PHASE_TIMES=host`` times the host instead, without synchronising: how long the host
takes to queue each phase, which is what an unsynchronised step waits for when the device
runs out of queued work.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from leto.errors import ConfigError

ENV_PHASE_TIMES = "LETO_PHASE_TIMES"
ENV_PROFILE_DIR = "LETO_PROFILE_DIR"
"""A directory: each trainer process profiles its first step and a later one
(:class:`StepProfiler`) and writes their tables there."""
ENV_PROFILE_AFTER = "LETO_PROFILE_AFTER"
"""With ``LETO_PROFILE_DIR``: how many steps after its first the process profiles a steady
one (default 3; more where the shadows' warm-ups share the device for longer)."""
ENV_SYNC_DEBUG = "LETO_SYNC_DEBUG"
"""``1``: from its second step to the one before its last, an active trainer on CUDA warns
at every call that makes the host wait for the device
(``torch.cuda.set_sync_debug_mode("warn")``): what keeps an unsynchronised step from
running ahead of its kernels. The first step's own waits (lazy initialisation, reading the
retained RNG once) and the last step's (its loss, the update's last host copies) are left
out."""


def phase_times_enabled() -> bool:
    return os.environ.get(ENV_PHASE_TIMES, "0") in ("1", "host")


def profile_dir() -> str | None:
    return os.environ.get(ENV_PROFILE_DIR) or None


def profile_after() -> int:
    value = os.environ.get(ENV_PROFILE_AFTER, "3")
    try:
        after = int(value)
    except ValueError:
        after = -1
    if after < 1:
        raise ConfigError(f"{ENV_PROFILE_AFTER}={value}: must be a whole number of steps >= 1")
    return after


def sync_debug_enabled() -> bool:
    return os.environ.get(ENV_SYNC_DEBUG, "0") == "1"


def warn_on_device_waits(device: torch.device, on: bool = True) -> None:
    """Every later call that makes the host wait for ``device`` warns (``ENV_SYNC_DEBUG``);
    ``on=False`` stops it (the last step reads its loss and drains the update: on purpose)."""
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("warn" if on else "default")


class PhaseTimes:
    """Seconds per named phase of one step, for its ``step_done`` event."""

    def __init__(self, device: torch.device, started: float, enabled: bool | None = None) -> None:
        self.device = device
        self.enabled = phase_times_enabled() if enabled is None else enabled
        self.seconds: dict[str, float] = {}
        self._mark = started
        self._sync = (
            self.enabled and device.type == "cuda" and os.environ.get(ENV_PHASE_TIMES) != "host"
        )

    def mark(self, name: str) -> None:
        """The phase ``name`` ended now: the seconds since the previous boundary."""
        if not self.enabled:
            return
        if self._sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[name] = now - self._mark
        self._mark = now

    def fields(self) -> dict[str, dict[str, float]]:
        """``{"phases_s": {...}}`` when enabled, else nothing (for ``EventLog.emit``)."""
        return {"phases_s": self.seconds} if self.enabled else {}


class StepProfiler:
    """``LETO_PROFILE_DIR=dir``: a trainer process profiles (``torch.profiler``, host and device
    events) the first step it runs and the step ``steady_after`` later, and writes each one's
    tables to ``dir/rank<r>-pid<pid>-step<n>.txt``: what a fresh process's first step pays
    that a steady step does not (a promoted shadow's, after a recovery). The device is
    synchronised at both ends of a profiled step, and the profiler slows the step it records:
    compare the two tables, not a profiled step with unprofiled ones."""

    ROWS = 30

    def __init__(
        self, directory: str | Path, rank: int, device: torch.device, steady_after: int = 3
    ) -> None:
        self.directory = Path(directory)
        self.steady_after = steady_after
        self.rank = rank
        self.device = device
        self._first: int | None = None
        self._prof: torch.profiler.profile | None = None
        self._started = 0.0
        self._allocs = 0

    def begin(self, step: int) -> None:
        if self._first is None:
            self._first = step
        if step - self._first not in (0, self.steady_after):
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._sync()
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._allocs = self._device_allocs()
        self._started = time.perf_counter()

    def end(self, step: int) -> None:
        if self._prof is None:
            return
        self._sync()
        wall = time.perf_counter() - self._started
        allocs = self._device_allocs() - self._allocs
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        table = prof.key_averages()
        text = [f"step {step} (the process's {'first' if step == self._first else 'steady'})"]
        text.append(f"wall {1e3 * wall:.1f} ms, device allocations {allocs}\n")
        text.append(table.table(sort_by="self_cpu_time_total", row_limit=self.ROWS))
        if self.device.type == "cuda":
            text.append(table.table(sort_by="self_device_time_total", row_limit=self.ROWS))
        text += self._allocations(prof)
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}-pid{os.getpid()}-step{step}.txt"
        (self.directory / name).write_text("\n".join(text))

    ALLOCATIONS = ("cudaMalloc", "cudaHostAlloc", "cudaMallocHost", "cuMemAlloc_v2")
    """Driver allocations a steady step makes none of: each one's callers are listed."""

    def _allocations(self, prof: torch.profiler.profile) -> list[str]:
        out = []
        for event in prof.events():
            if event.name not in self.ALLOCATIONS:
                continue
            callers, parent = [], event.cpu_parent
            while parent is not None and len(callers) < 24:
                callers.append(parent.name)
                parent = parent.cpu_parent
            ms = event.cpu_time_total / 1e3
            out.append(f"{event.name} {ms:.2f} ms, called from: " + " < ".join(callers))
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _device_allocs(self) -> int:
        if self.device.type != "cuda":
            return 0
        return int(torch.cuda.memory_stats(self.device).get("num_device_alloc", 0))
