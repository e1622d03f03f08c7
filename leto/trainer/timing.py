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

import torch

ENV_PHASE_TIMES = "LETO_PHASE_TIMES"
ENV_SYNC_DEBUG = "LETO_SYNC_DEBUG"
"""``1``: from its second step to the one before its last, an active trainer on CUDA warns
at every call that makes the host wait for the device
(``torch.cuda.set_sync_debug_mode("warn")``): what keeps an unsynchronised step from
running ahead of its kernels. The first step's own waits (lazy initialisation, reading the
retained RNG once) and the last step's (its loss, the update's last host copies) are left
out."""


def phase_times_enabled() -> bool:
    return os.environ.get(ENV_PHASE_TIMES, "0") in ("1", "host")


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
