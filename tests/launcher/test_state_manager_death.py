"""A state manager that dies is noticed at once, said in an event and one line, and never
resumed on: the running trainers go on (their state is mapped), the job still finishes."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from leto.events import Kind, read_events
from tests.launcher.harness import GPT, GPT_ARGS, LETO_RUN, _env


def _state_manager(agent: int) -> int | None:
    with open(f"/proc/{agent}/task/{agent}/children") as f:
        children = [int(p) for p in f.read().split()]
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"leto.pool.server" in f.read():
                return pid
    return None


@pytest.mark.timeout(300)
def test_a_dead_state_manager_is_an_event_within_a_second(tmp_path) -> None:
    events_path = tmp_path / "events.jsonl"
    cmd = [
        *LETO_RUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-dashboard",
        "--events",
        str(events_path),
        GPT,
        "--steps",
        "400",
        *GPT_ARGS,
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:
            events = read_events(events_path) if events_path.exists() else []
            kinds = {e["kind"] for e in events}
            if {Kind.SHADOWS_SPAWNED, Kind.STEP_DONE} <= kinds:  # the actives hold their state
                break
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        else:
            pytest.fail("no shadows were spawned")
        sm = _state_manager(proc.pid)
        assert sm is not None
        killed_t = time.time()
        os.kill(sm, signal.SIGKILL)
        _, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    events = read_events(events_path)
    (died,) = [e for e in events if e["kind"] == Kind.STATE_MANAGER_DIED]
    assert died["how"] == "killed by SIGKILL", died
    assert died["t"] - killed_t < 1.0, died["t"] - killed_t
    assert "the state manager died (killed by SIGKILL)" in err
    assert proc.returncode == 0, err[-3000:]
    assert not [e for e in events if e["kind"] in (Kind.FAILURE_DETECTED, Kind.SHADOWS_PROMOTED)]
