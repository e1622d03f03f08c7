"""One event schema for everything that happens in a Leto job.

Every process (agent, trainers) appends JSON lines to the same file, opened with
``O_APPEND`` so each line lands whole even when processes write at once or are killed
mid-run. The dashboard, the recovery summary, the benchmarks and the tests all read this
one stream. Each event: ``{"t": unix_time_s, "kind": ..., "src": ..., <fields>}``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Any

ENV_EVENTS_FILE = "LETO_EVENTS_FILE"


class Kind(str, Enum):
    """Event kinds. Agent-side first, then trainer-side."""

    AGENT_STARTED = "agent_started"
    WORKERS_STARTED = "workers_started"
    SHADOWS_SPAWNED = "shadows_spawned"
    SHADOW_RECLAIMED = "shadow_reclaimed"
    SHADOW_LEVEL = "shadow_level"
    SHADOW_DIED = "shadow_died"
    SHADOWS_GIVEN_UP = "shadows_given_up"
    STATE_MANAGER_DIED = "state_manager_died"
    """The node's state manager is gone (how it ended): in-place recovery is lost."""
    FAILURE_DETECTED = "failure_detected"
    EPOCH = "epoch"
    ACTIVES_STOPPED = "actives_stopped"
    SHADOWS_PROMOTED = "shadows_promoted"
    RECOVERY_DONE = "recovery_done"
    GROUP_RESTART = "group_restart"
    JOB_FINISHED = "job_finished"
    METRICS_SERVING = "metrics_serving"
    TRAINER_STARTED = "trainer_started"
    SHADOW_READY = "shadow_ready"
    KERNELS_WARMED = "kernels_warmed"
    PROMOTED = "promoted"
    ATTACHED = "attached"
    RESUMED = "resumed"
    STEP_DONE = "step_done"
    MODEL_WARMED = "model_warmed"
    FIRST_ITERATION = "first_iteration"
    """A promoted trainer's first iteration, by phase (reported by the training script)."""
    DIGEST = "digest"
    FAULT_INJECTED = "fault_injected"
    OOM_RETRY = "oom_retry"
    HANG_DETECTED = "hang_detected"
    DEVICE_UNHEALTHY = "device_unhealthy"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    CHECKPOINT_FAILED = "checkpoint_failed"
    """A checkpoint could not be written (rank, step, error): training goes on."""
    PAGES_ERASED = "pages_erased"
    PAGES_REBUILT = "pages_rebuilt"
    UNRECOVERABLE = "unrecoverable_state"


class EventLog:
    """Appends events to a JSON-lines file (or nowhere, when ``path`` is None)."""

    def __init__(self, path: str | os.PathLike[str] | None, source: str) -> None:
        self.path = None if path is None else Path(path)
        self.source = source
        self._fd = (
            None
            if self.path is None
            else os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        )

    @classmethod
    def from_env(cls, source: str) -> EventLog:
        return cls(os.environ.get(ENV_EVENTS_FILE) or None, source)

    def emit(self, kind: Kind, **fields: Any) -> dict[str, Any]:
        event = {"t": time.time(), "kind": kind.value, "src": self.source, **fields}
        if self._fd is not None:
            os.write(self._fd, (json.dumps(event, separators=(",", ":")) + "\n").encode())
        return event

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All complete events in ``path`` (a line cut short by a kill is skipped)."""
    return list(iter_events(path))


def iter_events(path: str | os.PathLike[str], offset: int = 0) -> Iterator[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            for line in f:
                if line.endswith(b"\n"):
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError:
                        continue
    except FileNotFoundError:
        return


_TAIL_READ_BYTES = 1 << 18


class EventTail:
    """Reads the events appended to a file since the last call (the dashboard, the metrics).

    Only complete lines are taken; a line still being written waits for the next call, and
    one that does not parse (cut short by a kill) is skipped.
    """

    def __init__(self, path: str | os.PathLike[str], offset: int = 0) -> None:
        self.path = Path(path)
        self.offset = offset

    def new_events(self) -> Iterator[dict[str, Any]]:
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - closed below, also on a generator exit
        except FileNotFoundError:
            return
        with f:
            while True:
                f.seek(self.offset)
                data = f.read(_TAIL_READ_BYTES)
                end = data.rfind(b"\n") + 1
                if not end:
                    if len(data) == _TAIL_READ_BYTES:  # no event is this long: skip it
                        self.offset += len(data)
                        continue
                    return  # nothing, or one line still being written
                self.offset += end
                for line in data[:end].splitlines():
                    try:
                        yield json.loads(line)
                    except ValueError:
                        continue
