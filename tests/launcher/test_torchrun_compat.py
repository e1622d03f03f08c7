"""A plain torchrun script runs unchanged under leto-run, with torchrun's restart semantics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from leto.events import Kind, read_events
from tests.launcher.harness import LETO_RUN, REPO, _env

DDP = str(REPO / "examples" / "plain_ddp.py")


def _leto_run(tmp, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        *LETO_RUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-dashboard",
        "--events",
        str(tmp / "events.jsonl"),
        *args,
    ]
    return subprocess.run(
        cmd, check=False, cwd=tmp, capture_output=True, text=True, timeout=240, env=_env()
    )


@pytest.mark.timeout(300)
def test_plain_ddp_group_restart_like_torchrun(tmp_path) -> None:
    """SIGKILL of a worker restarts the whole group (attempt 1) and the job completes."""
    proc = _leto_run(
        tmp_path,
        "--max-restarts",
        "1",
        DDP,
        "--steps",
        "6",
        "--kill-at-step",
        "2",
        "--out",
        str(tmp_path / "out.json"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["attempt"] == 1
    events = read_events(tmp_path / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert Kind.SHADOWS_SPAWNED not in kinds, "a script without the leto API must never get shadows"
    assert [e["restart"] for e in events if e["kind"] == Kind.WORKERS_STARTED] == [0, 1]


@pytest.mark.timeout(300)
def test_plain_ddp_without_restarts_fails_like_torchrun(tmp_path) -> None:
    proc = _leto_run(tmp_path, "--max-restarts", "0", DDP, "--steps", "6", "--kill-at-step", "2")
    assert proc.returncode == 1
    assert "examples/plain_ddp.py FAILED" in proc.stderr or "plain_ddp.py FAILED" in proc.stderr


def _descendants(root: int) -> set[int]:
    """Every live descendant of ``root`` (trainers, shadows, state manager), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(300)
def test_ctrl_c_leaves_nothing_behind(tmp_path) -> None:
    """SIGINT to leto-run mid-run: every trainer, shadow and the state manager are gone,
    and no socket directory outlives the job (memfd regions die with their last fd)."""
    events = tmp_path / "events.jsonl"
    cmd = [
        *LETO_RUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-dashboard",
        "--events",
        str(events),
        str(REPO / "examples" / "train_gpt.py"),
        "--steps",
        "100000",
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
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # steady state: actives training, shadows ready
        kinds = [e["kind"] for e in read_events(events)]
        if kinds.count(Kind.SHADOW_READY) == 2 and Kind.STEP_DONE in kinds:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("job never reached steady state")
    family = _descendants(proc.pid)
    assert len(family) >= 5, f"expected 2 actives, 2 shadows and a state manager, got {family}"
    sm_dirs = set()  # this job's state-manager socket directory, from its command line
    for pid in family:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode().split("\0")
        if "leto.pool.server" in argv:
            sm_dirs.add(os.path.dirname(argv[argv.index("leto.pool.server") + 1]))
    assert len(sm_dirs) == 1, sm_dirs
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    time.sleep(0.5)
    assert [p for p in family if _alive(p)] == [], "processes outlived leto-run"
    assert not any(os.path.exists(d) for d in sm_dirs), (
        "the state manager's socket directory leaked"
    )
