"""One event schema for everything that happens in a Leto job.

Every process (agent, trainers) appends JSON lines to the same file, opened with
``O_APPEND`` so each line lands whole even when processes write at once or are killed
mid-run. The dashboard, the recovery summary, the benchmarks and the tests all read this
one stream. Each event: ``{"t": unix_time_s, "kind": ..., "src": ..., "schema_version": 1,
<fields>}``; :data:`SCHEMA` lists every kind's fields with their types and units
(``docs/EVENTS.md`` describes them) and :func:`validate` checks an event against it.
"""

from __future__ import annotations

import json
import os
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

ENV_EVENTS_FILE = "LETO_EVENTS_FILE"
SCHEMA_VERSION = 1
"""Written into every event; raised when a field changes meaning, type or name."""


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
    PROGRESS = "progress"
    """Plain mode's progress line (printed by the dashboard, not stored in the file)."""


Writer = Literal["agent", "trainer", "dashboard"]
Unit = Literal["", "s", "ms", "unix s", "bytes"]
"""``s``, ``ms``: a duration; ``unix s``: a time, seconds since the epoch; ``bytes``."""


@dataclass(frozen=True, slots=True)
class Field:
    """One field of an event: its type (a Python type expression over JSON values: ``float``
    takes any number, ``None`` is null) and unit; an optional field may be left out."""

    type: Any
    unit: Unit = ""
    required: bool = True


@dataclass(frozen=True, slots=True)
class EventSpec:
    """What one kind of event holds besides :data:`COMMON`; no other field is allowed."""

    writer: Writer
    fields: dict[str, Field]


def _opt(type_: Any, unit: Unit = "") -> Field:
    return Field(type_, unit, required=False)


COMMON: dict[str, Field] = {
    "t": Field(float, "unix s"),
    "kind": Field(str),
    "src": Field(str),
    "schema_version": Field(int),
}
"""Fields of every event (:meth:`EventLog.emit` writes them)."""

_RANK, _STEP, _GEN, _LEVEL = Field(int), Field(int), Field(int), Field(int)

SCHEMA: dict[Kind, EventSpec] = {
    Kind.AGENT_STARTED: EventSpec("agent", {"entrypoint": Field(str), "nproc": Field(int)}),
    Kind.WORKERS_STARTED: EventSpec(
        "agent",
        {
            "restart": Field(int),
            "pids": Field(list[int]),
            "ranks": Field(list[int]),
            "warm": Field(bool),
        },
    ),
    Kind.SHADOWS_SPAWNED: EventSpec(
        "agent",
        {
            "gen": _GEN,
            "pids": Field(list[int]),
            "ranks": Field(list[int]),
            "level": _LEVEL,
            "launch": Field(int),
        },
    ),
    Kind.SHADOW_RECLAIMED: EventSpec(
        "agent",
        {
            "gen": _GEN,
            "level": _LEVEL,
            "ranks": Field(list[int]),
            "pids": Field(list[int]),
            "reclaim_s": Field(float, "s"),
            "reclaims": Field(int),
        },
    ),
    Kind.SHADOW_LEVEL: EventSpec(
        "agent",
        {
            "gen": _GEN,
            "level": _LEVEL,
            "reason": Field(str),
            "headroom_bytes": Field(int | None, "bytes"),
            "free_bytes": Field(int | None, "bytes"),
            "peak_bytes": Field(int | None, "bytes"),
            "needed_bytes": Field(int, "bytes"),
        },
    ),
    Kind.SHADOW_DIED: EventSpec(
        "agent",
        {
            "gen": _GEN,
            "rank": _RANK,
            "level": _LEVEL,
            "pid": Field(int),
            "signal": Field(int | None),
            "exitcode": Field(int | None),
            "deaths": Field(int),
        },
    ),
    Kind.SHADOWS_GIVEN_UP: EventSpec(
        "agent",
        {
            "gen": _GEN,
            "rank": _RANK,
            "level": _LEVEL,
            "deaths": Field(int),
            "reason": Field(str),
        },
    ),
    Kind.STATE_MANAGER_DIED: EventSpec("agent", {"how": Field(str), "gen": _GEN}),
    Kind.FAILURE_DETECTED: EventSpec(
        "agent",
        {
            "ranks": Field(list[int]),
            "exit_codes": Field(list[int]),
            "root_ranks": Field(list[int]),
            "gen": _GEN,
            "detected_t": Field(float, "unix s"),
            "failure": Field(str),
            "in_a_row": Field(int),
        },
    ),
    Kind.EPOCH: EventSpec(
        "agent",
        {
            "epoch": Field(int),
            "action": Field(str),
            "failure": Field(str),
            "node": Field(int),
            "remote": Field(bool),
            "cold": Field(bool),
            "reason": Field(str),
            "detected_t": Field(float, "unix s"),
            "root_ranks": Field(list[int]),
        },
    ),
    Kind.ACTIVES_STOPPED: EventSpec("agent", {"gen": _GEN, "stop_s": Field(float, "s")}),
    Kind.SHADOWS_PROMOTED: EventSpec(
        "agent",
        {
            "gen": _GEN,
            "epoch": Field(int),
            "promote_t": Field(float, "unix s"),
            "node": Field(int),
            "cold": Field(bool),
        },
    ),
    Kind.RECOVERY_DONE: EventSpec(
        "agent",
        {
            "gen": _GEN,
            "epoch": Field(int),
            "detected_t": Field(float, "unix s"),
            "stopped_t": Field(float, "unix s"),
            "cold": Field(bool),
            "done_t": Field(float, "unix s"),
            "phases_s": Field(dict[str, float], "s"),
            "total_s": Field(float | None, "s"),
        },
    ),
    Kind.GROUP_RESTART: EventSpec(
        "agent", {"restart": Field(int), "reason": Field(str), "recoveries": Field(int)}
    ),
    Kind.JOB_FINISHED: EventSpec(
        "agent",
        {
            "ok": Field(bool),
            "recoveries": Field(int),
            "restarts": Field(int),
            "error": _opt(str),
        },
    ),
    Kind.METRICS_SERVING: EventSpec(
        "agent", {"port": Field(int), "addr": Field(str), "url": Field(str)}
    ),
    Kind.TRAINER_STARTED: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "gen": _GEN,
            "role": Field(str),
            "pid": Field(int),
            "before_init_s": Field(float, "s"),
            "store_s": Field(float, "s"),
            "context_s": Field(float, "s"),
            "device_wait_s": _opt(float, "s"),
            "deterministic": Field(bool),
        },
    ),
    Kind.SHADOW_READY: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "gen": _GEN,
            "level": _LEVEL,
            "init_s": Field(float, "s"),
        },
    ),
    Kind.KERNELS_WARMED: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "gen": _GEN,
            "level": _LEVEL,
            "ran": Field(bool),
            "reason": _opt(str),
            "calls": _opt(dict[str, int]),
            "seconds": _opt(float, "s"),
        },
    ),
    Kind.PROMOTED: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "gen": _GEN,
            "level": _LEVEL,
            "device_check_s": Field(float, "s"),
            "group_built": Field(bool),
        },
    ),
    Kind.RESUMED: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "step": _STEP,
            "action": Field(str),
            "gen": _opt(int),
            "points": _opt(list[list[int]]),
            "attach_s": _opt(float, "s"),
            "decide_s": _opt(float, "s"),
            "mapped_ahead_step": _opt(int | None),
            "extras": _opt(str),
            "buffers_restored": _opt(bool),
            "load_s": _opt(float, "s"),
        },
    ),
    Kind.STEP_DONE: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "step": _STEP,
            "iter_s": Field(float, "s"),
            "total": _opt(int | None),
            "loss": _opt(float | None),
            "prev_loss": _opt(float),
            "finished_in_recovery": _opt(bool),
            "phases_s": _opt(dict[str, float], "s"),
            "device_peak_bytes": _opt(int, "bytes"),
            "lent_bytes": _opt(int, "bytes"),
            "attempt": _opt(int),
            "compiled_graphs": _opt(int),
        },
    ),
    Kind.MODEL_WARMED: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "gen": _GEN,
            "level": _LEVEL,
            "name": Field(str),
            "ran": Field(bool),
            "reason": Field(str),
            "warm_s": Field(float, "s"),
            "transient_bytes": Field(int, "bytes"),
            "peak_bytes": Field(int, "bytes"),
            "kept_bytes": Field(int, "bytes"),
            "compiled_graphs": Field(int),
        },
    ),
    Kind.FIRST_ITERATION: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "step": _STEP,
            "compiled_graphs": Field(int),
            "phases_s": Field(dict[str, float], "s"),
        },
    ),
    Kind.DIGEST: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "step": _STEP,
            "digest": Field(str),
            "save_s": _opt(float, "s"),
            "wait_s": _opt(float, "s"),
        },
    ),
    Kind.FAULT_INJECTED: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "step": _STEP,
            "phase": Field(str),
            "fault": _opt(int),
            "point": _opt(str | None),
            "chunk": _opt(int | None),
            "fault_kind": _opt(str),
        },
    ),
    Kind.OOM_RETRY: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "step": _STEP,
            "reclaimed_level": Field(int),
            "reaped_s": Field(float, "s"),
            "wait_s": Field(float, "s"),
            "freed_bytes": Field(int, "bytes"),
        },
    ),
    Kind.HANG_DETECTED: EventSpec(
        "agent",
        {
            "rank": _RANK,
            "gen": _GEN,
            "idle_s": Field(float, "s"),
            "timeout_s": Field(float, "s"),
            "proc_state": Field(str),
        },
    ),
    Kind.DEVICE_UNHEALTHY: EventSpec("agent", {"problems": Field(list[str])}),
    Kind.CHECKPOINT_SAVED: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "step": _STEP,
            "cost_s": Field(float, "s"),
            "interval_steps": Field(int | None),
        },
    ),
    Kind.CHECKPOINT_LOADED: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "step": _STEP,
            "load_s": Field(float, "s"),
            "gen": _GEN,
            "restart": Field(int),
        },
    ),
    Kind.CHECKPOINT_FAILED: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "step": _STEP,
            "error": Field(str),
            "dir": Field(str),
        },
    ),
    Kind.PAGES_ERASED: EventSpec(
        "agent",
        {
            "rank": _RANK,
            "region": Field(str),
            "pages": Field(list[int]),
            "fault": Field(int),
        },
    ),
    Kind.PAGES_REBUILT: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "gen": _GEN,
            "lost": Field(dict[str, dict[str, int]]),
            "rebuild_s": Field(float, "s"),
            "localize_s": Field(float, "s"),
            "phase": Field(str),
        },
    ),
    Kind.UNRECOVERABLE: EventSpec(
        "trainer",
        {
            "rank": _RANK,
            "region": Field(str),
            "error": Field(str),
            "lost": _opt(dict[str, int]),
        },
    ),
    Kind.PROGRESS: EventSpec(
        "dashboard",
        {
            "step": _STEP,
            "total": Field(int | None),
            "percent": _opt(float),
            "elapsed_s": Field(float | None, "s"),
            "eta_s": Field(float | None, "s"),
            "iter_ms": Field(float | None, "ms"),
            "loss": Field(float | None),
        },
    ),
}
"""Every kind's fields besides :data:`COMMON` (``docs/EVENTS.md`` says who writes each, when)."""


def validate(event: dict[str, Any]) -> list[str]:
    """What is wrong with ``event`` against :data:`SCHEMA` (an empty list: nothing)."""
    try:
        spec = SCHEMA[Kind(event.get("kind"))]
    except ValueError:
        return [f"unknown kind {event.get('kind')!r}"]
    fields = {**COMMON, **spec.fields}
    problems = [f"{event['kind']}: unknown field {name!r}" for name in event if name not in fields]
    for name, field in fields.items():
        if name not in event:
            if field.required:
                problems.append(f"{event['kind']}: missing field {name!r}")
        elif not conforms(event[name], field.type):
            problems.append(
                f"{event['kind']}.{name}: {event[name]!r} is not {type_name(field.type)}"
            )
    return problems


def conforms(value: Any, type_: Any) -> bool:
    """Whether a JSON value is of ``type_`` (``float`` takes ints; ``bool`` is no number)."""
    origin, args = get_origin(type_), get_args(type_)
    if origin in (Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if type_ is None or type_ is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items()
        )
    if isinstance(value, bool):
        return type_ is bool
    if type_ is float:
        return isinstance(value, (int, float))
    return isinstance(value, type_)


def type_name(type_: Any) -> str:
    """How ``docs/EVENTS.md`` spells a field's type: ``int``, ``float | None``, ``list[int]``."""
    return type_.__name__ if isinstance(type_, type) else str(type_)


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
        event = {
            "t": time.time(),
            "kind": kind.value,
            "src": self.source,
            "schema_version": SCHEMA_VERSION,
            **fields,
        }
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


_BACK_READ_BYTES = 1 << 16


def last_event(
    path: str | os.PathLike[str],
    match: Callable[[dict[str, Any]], bool],
    within_bytes: int = 1 << 22,
) -> dict[str, Any] | None:
    """The newest complete event in the last ``within_bytes`` of ``path`` that ``match``
    accepts (read backwards, block by block: what was just written is found at once)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return None
    with f:
        pos = f.seek(0, os.SEEK_END)
        floor, head = max(0, pos - within_bytes), b""
        while pos > floor:
            start = max(floor, pos - _BACK_READ_BYTES)
            f.seek(start)
            lines = (f.read(pos - start) + head).split(b"\n")
            pos = start
            head = lines.pop(0) if pos > floor else b""  # the start of a line the next block ends
            for line in reversed(lines):
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # the line being written, or one cut short by a kill
                if isinstance(event, dict) and match(event):
                    return event
    return None


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
