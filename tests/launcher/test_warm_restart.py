"""Warm restarts: a plain torchrun script's group restart starts its workers from the fork
server, and computes exactly what a cold (torchrun-style) restart computes."""

from __future__ import annotations

import json
import sys

import pytest

from leto.events import Kind, read_events
from tests.launcher.harness import REPO
from tests.launcher.test_torchrun_compat import _leto_run

DDP = str(REPO / "examples" / "plain_ddp.py")


@pytest.mark.timeout(300)
def test_warm_restart_equals_cold_restart(tmp_path) -> None:
    results = {}
    for mode, flags in (("warm", []), ("cold", ["--no-warm-restarts"])):
        run_dir = tmp_path / mode
        run_dir.mkdir()
        proc = _leto_run(
            run_dir,
            *flags,
            "--max-restarts",
            "1",
            DDP,
            "--steps",
            "6",
            "--kill-at-step",
            "2",
            "--out",
            str(run_dir / "out.json"),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[mode] = json.loads((run_dir / "out.json").read_text())
        started = [
            e for e in read_events(run_dir / "events.jsonl") if e["kind"] == Kind.WORKERS_STARTED
        ]
        assert [(e["restart"], e["warm"]) for e in started] == [
            (0, mode == "warm"),
            (1, mode == "warm"),
        ]
    assert results["warm"] == results["cold"]
    assert results["warm"]["attempt"] == 1


@pytest.mark.timeout(120)
def test_a_command_line_the_server_cannot_run_starts_cold_and_says_so(tmp_path) -> None:
    """``--no-python`` with interpreter flags: torch's Popen starts the workers, and the
    ``workers_started`` event says they are not warm."""
    out = tmp_path / "out.json"
    proc = _leto_run(
        tmp_path,
        "--no-python",
        sys.executable,
        "-X",
        "utf8",
        DDP,
        "--steps",
        "2",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["attempt"] == 0
    started = [
        e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == Kind.WORKERS_STARTED
    ]
    assert [e["warm"] for e in started] == [False]
