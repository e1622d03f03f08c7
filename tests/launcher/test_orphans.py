"""Nothing of a job outlives its agent, and a job leaves no directories behind.

A process manager above leto-run (systemd, a container's init, a job scheduler's shim) is
often a child subreaper: when the agent is SIGKILLed its orphans are re-parented to it, not
to init. Real leto-run jobs under a Python parent that is a subreaper; each job gets a
TMPDIR of its own, so other jobs on the machine do not blur the before/after comparison.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leto.events import Kind
from leto.lifetime import sweep_leftovers
from tests.launcher.harness import GPT, LETO_RUN, _env, run_leto

_SUBREAPER = r"""
import ctypes, json, os, signal, subprocess, sys, time
from leto.events import Kind, read_events

assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
cmd, events, log, moment = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
sig = signal.Signals[sys.argv[5]]
me = os.getpid()


def family():
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [me]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").replace("\0", " ").strip()
    except OSError:
        return "?"


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


agent = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
deadline = time.monotonic() + 240
while True:
    ready = {e["rank"] for e in read_events(events) if e["kind"] == Kind.SHADOW_READY}
    if moment == Kind.SHADOWS_SPAWNED and any(e["kind"] == moment for e in read_events(events)):
        ready = {0, 1}  # the shadows are starting: no death signal asked for yet
    if ready >= {0, 1} or agent.poll() is not None or time.monotonic() > deadline:
        break
    time.sleep(0.1)
before = [(pid, cmdline(pid)) for pid in family()]
os.kill(agent.pid, sig)
agent.wait(timeout=60)
t_kill = time.monotonic()
left = family()
while left and time.monotonic() - t_kill < 5.0:
    time.sleep(0.05)
    reap()
    left = family()
result = {
    "ready": sorted(ready), "before": before, "gone_s": time.monotonic() - t_kill,
    "left": [(pid, cmdline(pid)) for pid in left],
}
for pid in left:  # leave nothing to the machine, whatever the verdict
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
time.sleep(0.5)
reap()
print(json.dumps(result))
"""


def _leto_entries(*dirs: Path) -> set[str]:
    return {
        str(d / name)
        for d in dirs
        if d.is_dir()
        for name in os.listdir(d)
        if name.startswith("leto-")
    }


def _own_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))  # where the job's tempfile directories go
    return tmpdir


_TINY = [
    "--vocab",
    "64",
    "--dim",
    "16",
    "--layers",
    "1",
    "--seq",
    "8",
    "--batch",
    "2",
    "--heads",
    "2",
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("moment", "sig"),
    [
        (Kind.SHADOWS_SPAWNED, "SIGKILL"),
        (Kind.SHADOW_READY, "SIGKILL"),
        pytest.param(Kind.SHADOW_READY, "SIGTERM", marks=pytest.mark.slow),
    ],  # CI time: SIGKILL is the harder case
)
def test_an_agent_killed_under_a_subreaper_leaves_nothing(
    tmp_path, monkeypatch, moment, sig
) -> None:
    """SIGKILL the agent while its shadows start (before any asked for a death signal) or
    once they wait for promotion, or SIGTERM it: within 5 s of its end no process of the
    job is left, nor any directory."""
    tmpdir = _own_tmp(tmp_path, monkeypatch)
    shm_before = _leto_entries(Path("/dev/shm"))
    events, log = tmp_path / "events.jsonl", tmp_path / "agent.log"
    cmd = [*LETO_RUN, "--standalone", "--nproc-per-node", "2", "--no-dashboard"]
    cmd += ["--events", str(events), GPT, "--steps", "100000", *_TINY]
    script = tmp_path / "subreaper.py"
    script.write_text(_SUBREAPER)
    argv = [sys.executable, str(script), json.dumps(cmd), str(events), str(log), moment, sig]
    proc = subprocess.run(
        argv, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=280, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ready"] == [0, 1], log.read_text()[-3000:]
    # The agent, its state manager and fork server, 2 actives, 2 shadows.
    assert len(result["before"]) >= 7, result["before"]
    left = result["left"]
    assert left == [], f"outlived the agent by {result['gone_s']:.1f} s: {left}"
    assert _leto_entries(tmpdir) == set(), "directories left behind by the killed agent"
    assert _leto_entries(Path("/dev/shm")) - shm_before == set()


@pytest.mark.timeout(300)
def test_a_finished_job_leaves_no_directory_and_sweeps_a_dead_one(tmp_path, monkeypatch) -> None:
    tmpdir = _own_tmp(tmp_path, monkeypatch)
    shm_before = _leto_entries(Path("/dev/shm"))
    stale = _dead_state_manager_dir(tmpdir)
    # Long enough for the shadows, at a lowered priority, to become ready before it ends.
    proc, events = run_leto(tmp_path, steps=1000, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Shadows ran, so every kind of file the agent makes was made.
    assert any(e["kind"] == Kind.SHADOW_READY for e in events)
    assert not stale.exists(), "the dead agent's state-manager directory was not swept"
    assert _leto_entries(tmpdir) == set()
    assert _leto_entries(Path("/dev/shm")) - shm_before == set()


def _dead_state_manager_dir(tmpdir: Path) -> Path:
    """What a state manager killed with its agent (both SIGKILLed) leaves: its socket
    directory, the socket bound by nobody (connect: refused)."""
    stale = tmpdir / "leto-sm-deadbeef"
    stale.mkdir(mode=0o700)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(str(stale / "state-manager.sock"))
    sock.close()
    return stale


def test_the_sweep_removes_only_dead_directories(tmp_path) -> None:
    stale = _dead_state_manager_dir(tmp_path)
    live = tmp_path / "leto-sm-alive"
    live.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(live / "state-manager.sock"))
    listener.listen(1)
    starting = tmp_path / "leto-sm-starting"  # made a moment ago, its server not bound yet
    starting.mkdir(mode=0o700)
    old_empty = tmp_path / "leto-sm-empty"
    old_empty.mkdir(mode=0o700)
    os.utime(old_empty, (time.time() - 3600, time.time() - 3600))
    other = tmp_path / "leto-events-1.jsonl"  # a file: never touched
    other.write_text("")
    try:
        removed = sweep_leftovers(tmp_path)
        assert sorted(removed) == sorted([str(stale), str(old_empty)])
        assert live.exists() and starting.exists() and other.exists()
    finally:
        listener.close()


_CHECK = "from leto.lifetime import die_with_agent; die_with_agent(); print('alive')"


@pytest.mark.parametrize("command", [["-c", _CHECK], ["-m", "leto.pool.server", "sm.sock"]])
def test_a_process_whose_agent_is_already_gone_exits_at_once(tmp_path, command) -> None:
    """Started for an agent that is not among its ancestors (it died, the process was
    re-parented): it exits instead of waiting for a death signal that will never come."""
    stranger = subprocess.Popen(["sleep", "60"])  # alive, and no ancestor of the process
    try:
        env = {**_env(), "LETO_AGENT_PID": str(stranger.pid)}
        proc = subprocess.run(
            [sys.executable, *command],
            cwd=tmp_path,
            env=env,
            timeout=60,
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        stranger.kill()
        stranger.wait()
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr[-2000:]
    assert not (tmp_path / "sm.sock").exists()


def test_a_process_under_its_agent_goes_on(tmp_path) -> None:
    env = {**_env(), "LETO_AGENT_PID": str(os.getpid())}  # this test: the parent
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK],
        cwd=tmp_path,
        env=env,
        timeout=60,
        capture_output=True,
        text=True,
        check=False,
    )
    assert (proc.returncode, proc.stdout.strip()) == (0, "alive"), proc.stderr[-2000:]
