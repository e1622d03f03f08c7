"""Per-phase step times, a diagnostic (``LETO_PHASE_TIMES=1``).

Each boundary synchronises the device so a phase is timed to the end of its kernels: the
step runs slower with it on, and the numbers say where the time goes, not how long an
unsynchronised step takes (``bench/recovery_gpu.py --iteration-only --phase-times``).
"""

from __future__ import annotations

import os
import time

import torch

ENV_PHASE_TIMES = "LETO_PHASE_TIMES"


def phase_times_enabled() -> bool:
    return os.environ.get(ENV_PHASE_TIMES, "0") == "1"


class PhaseTimes:
    """Seconds per named phase of one step, for its ``step_done`` event."""

    def __init__(self, device: torch.device, started: float, enabled: bool | None = None) -> None:
        self.device = device
        self.enabled = phase_times_enabled() if enabled is None else enabled
        self.seconds: dict[str, float] = {}
        self._mark = started

    def mark(self, name: str) -> None:
        """The phase ``name`` ended now: the seconds since the previous boundary."""
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[name] = now - self._mark
        self._mark = now

    def fields(self) -> dict[str, dict[str, float]]:
        """``{"phases_s": {...}}`` when enabled, else nothing (for ``EventLog.emit``)."""
        return {"phases_s": self.seconds} if self.enabled else {}
