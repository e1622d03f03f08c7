"""The dashboard lives in the agent for the whole job: it keeps aggregates, not events.

Events go the agent's way (``EventLog`` appends to the file, the dashboard tails it); the
summary it prints is checked on a small hand-made recovery.
"""

from __future__ import annotations

import io
import json
import tracemalloc
from pathlib import Path

from rich.console import Console

from leto.events import EventLog, Kind
from leto_run.dashboard import Dashboard


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=200), out


def _recovery(log: EventLog, gen: int, step: int) -> None:
    log.emit(Kind.FAULT_INJECTED, rank=1, step=step, phase="forward")
    log.emit(Kind.FAILURE_DETECTED, gen=gen - 1, ranks=[1], failure="hof")
    log.emit(Kind.ACTIVES_STOPPED, gen=gen - 1, stop_s=0.01)
    log.emit(Kind.SHADOWS_PROMOTED, gen=gen, epoch=gen, node=0)
    for rank in (0, 1):
        log.emit(Kind.PROMOTED, rank=rank, gen=gen, level=3)
        log.emit(Kind.RESUMED, rank=rank, gen=gen, step=step)


def test_memory_stays_flat_over_50k_step_events(tmp_path: Path) -> None:
    """40k more events (and 200 more recoveries) after the first 10k: the retained memory
    grows by less than 2 MiB (an event kept costs ~0.6 KiB: 40k would be ~24 MiB)."""
    path = tmp_path / "events.jsonl"
    trainers = [EventLog(path, "trainer0"), EventLog(path, "trainer1")]
    agent = EventLog(path, "agent")
    console, _ = _console()
    dashboard = Dashboard(str(path), enabled=False, console=console)
    gen = 0

    def emit(first: int, last: int) -> None:
        nonlocal gen
        for i in range(first, last):
            rank, step = i % 2, i // 2
            trainers[rank].emit(
                Kind.STEP_DONE, rank=rank, step=step, iter_s=0.01, loss=2.0 + 1e-6 * step
            )
            if i % 200 == 199:
                gen += 1
                _recovery(agent, gen, step + 1)
            if i % 1000 == 999:
                dashboard.poll()

    tracemalloc.start()
    try:
        emit(0, 10_000)
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        emit(10_000, 50_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < 2 << 20, f"grew by {(peak - base) / 2**20:.1f} MiB"
    assert dashboard.ranks[1].step == 24_999
    assert dashboard.summary.restarts_and_recoveries() == (0, 250)  # counted, all of them
    assert len(dashboard.summary.recoveries()) == 100  # the table shows the latest ones
    assert dashboard.summary.recoveries()[-1].gen == 250


def test_the_summary_of_a_recovery(tmp_path: Path, capsys) -> None:
    """One kill at step 4 of rank 1, answered in place; times chosen so every phase is a
    round number of milliseconds."""
    path = tmp_path / "events.jsonl"
    path.write_text('{"t": 1.0, "kind": "group_restart", "src": "agent", "restart": 1}\n')
    offset = path.stat().st_size  # an earlier job's events in a reused file are not counted
    lines = []

    def ev(t: float, kind: str, src: str = "agent", **fields) -> None:
        lines.append({"t": t, "kind": kind, "src": src, **fields})

    for step in (1, 2, 3):
        for rank in (0, 1):
            ev(
                100.0 + 0.1 * step,
                Kind.STEP_DONE.value,
                f"trainer{rank}",
                rank=rank,
                step=step,
                iter_s=0.1,
            )
    ev(100.40, Kind.FAULT_INJECTED.value, "trainer1", rank=1, step=4, phase="backward")
    ev(100.46, Kind.FAILURE_DETECTED.value, gen=0, ranks=[1], failure="hof", detected_t=100.45)
    ev(100.50, Kind.ACTIVES_STOPPED.value, gen=0, stop_s=0.05)
    ev(100.555, Kind.PROMOTED.value, "trainer0", rank=0, gen=1, level=3)  # before the agent's line
    ev(100.551, Kind.SHADOWS_PROMOTED.value, gen=1, epoch=1, promote_t=100.55, node=0)
    ev(100.56, Kind.PROMOTED.value, "trainer1", rank=1, gen=1, level=3)
    ev(100.58, Kind.RESUMED.value, "trainer0", rank=0, gen=1, step=4)
    ev(100.60, Kind.RESUMED.value, "trainer1", rank=1, gen=1, step=4)
    ev(100.70, Kind.STEP_DONE.value, "trainer0", rank=0, step=4, iter_s=0.1)
    ev(100.72, Kind.STEP_DONE.value, "trainer1", rank=1, step=4, iter_s=0.1)
    with path.open("a") as f:
        f.writelines(json.dumps(e) + "\n" for e in lines)
    console, out = _console()
    dashboard = Dashboard(str(path), enabled=False, console=console, offset=offset)
    dashboard.stop()
    text = out.getvalue()
    assert "detect 50, stop 50, promote 50, wake 10, attach+decide 40, first step 120" in text, text
    assert "│ 320 " in text, text
    # Rank 0: 0.4 s of steps between 100.0 and 100.7.
    assert f"ETTR {0.4 / 0.7 * 100:.1f} % · in-place recoveries 1 · group restarts 0" in text, text
    plain = capsys.readouterr().err
    assert Kind.FAILURE_DETECTED in plain and Kind.SHADOWS_PROMOTED in plain
    assert Kind.GROUP_RESTART not in plain
