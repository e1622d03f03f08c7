"""The benches' own arithmetic: the GPU timeline's busy time, the goodput bench's flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_timeline import busy_us, gpu_activity, group_of
from leto import summary

REPO = Path(__file__).resolve().parents[2]


def test_busy_time_is_the_union_of_the_gpu_intervals(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_gemm", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 5, "dur": 10},  # overlaps
        {"ph": "X", "cat": "kernel", "name": "inner", "ts": 6, "dur": 2},  # inside both
        {"ph": "X", "cat": "kernel", "name": "_adamw_undo_kernel", "ts": 30, "dur": 5},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 20, "dur": 50},
    ]
    trace.write_text(json.dumps({"traceEvents": events}))
    acts = gpu_activity(trace)
    assert [a[0] for a in acts] == ["nvjet_sm90_gemm", "Memcpy DtoD", "inner", "_adamw_undo_kernel"]
    assert busy_us(acts) == 20.0  # [0, 15) and [30, 35); host-side launches are not GPU time
    assert [group_of(n) for n, _, _ in acts] == ["gemm", "copy", "other", "update"]


def test_goodput_refuses_a_fault_free_system_it_does_not_run() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench/goodput.py"),
            "--systems",
            "leto",
            "--fault-free",
            "dcp",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "goodput.py: error: --fault-free: not in --systems: dcp"
    ]


def _done(t: float, step: int, rank: int = 0, **extra) -> dict:
    return {"t": t, "kind": "step_done", "rank": rank, "step": step, "iter_s": 0.001, **extra}


def test_step_periods_span_only_consecutive_steps_of_one_run() -> None:
    """The step time of a loop that does not wait for the device at each step's end: the
    time between two steps' step_done, never across a save, a restart or a recovery."""
    events = [
        _done(1.0, 0),
        _done(1.5, 1),
        _done(1.6, 1, rank=1),  # another rank
        _done(2.0, 2),
        {"t": 2.9, "kind": "digest", "rank": 0, "step": 3, "save_s": 0.8},  # a checkpoint
        _done(3.0, 3),
        _done(3.5, 4),
        {"t": 4.0, "kind": "resumed", "rank": 0, "step": 2},  # a restart from step 2
        _done(5.0, 2),
        _done(5.4, 3),
        _done(6.0, 4, finished_in_recovery=True),  # a recovery finished step 4
        _done(7.0, 5),
        _done(7.25, 6),
    ]
    assert summary.step_periods(events) == pytest.approx([0.5, 0.5, 0.5, 0.4, 0.25])
    assert summary.step_periods(events, first_step=4) == [0.5, 0.25]
    assert summary.step_periods(events, after_t=5.0) == [0.25]


def test_steady_idle_report_names_the_host_frame_of_each_gap(tmp_path: Path) -> None:
    from bench.steady_gpu import idle_report

    trace = tmp_path / "t.json"
    events = [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 500, "dur": 1000},  # overlaps a
        {"ph": "X", "cat": "kernel", "name": "c", "ts": 4500, "dur": 500},  # 3 ms after b
        {"ph": "X", "cat": "kernel", "name": "d", "ts": 5500, "dur": 500},  # 0.5 ms after c
        {"ph": "X", "cat": "python_function", "name": "step", "ts": 0, "dur": 9000},
        {"ph": "X", "cat": "python_function", "name": "gc_pause", "ts": 1400, "dur": 2000},
    ]
    trace.write_text(json.dumps({"traceEvents": events}))
    lines = idle_report("leto", trace).splitlines()
    assert lines[0] == (
        "leto: device span 6.0 ms, busy 2.5 ms, idle 3.5 ms in 2 gaps; the longest:"
    )
    # the innermost frame, then the frames around it, innermost first
    assert lines[1].split() == [
        "3.00",
        "ms",
        "at",
        "+1.5",
        "ms:",
        "gc_pause",
        "<",
        "gc_pause",
        "<",
        "step",
    ]
    assert lines[2].split()[:6] == ["0.50", "ms", "at", "+5.0", "ms:", "step"]


def test_steady_bench_compares_the_same_training_on_the_cpu(tmp_path: Path) -> None:
    """Both loops train the same model on the same data: at --dropout 0 on the CPU (torch's
    fused AdamW in both) the parameters after the run are bit-identical."""
    out = tmp_path / "steady.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "steady_gpu.py"), "--cpu-check"]
        + ["--grad-accum", "2", "--rounds", "2", "--block", "1", "--dropout", "0"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["max_param_difference"] == 0.0
    assert len(result["rounds"]) == 2 and all(
        r["torch"] > 0 and r["leto"] > 0 for r in result["rounds"]
    )
    assert result["rounds"][0]["order"] == ["torch", "leto"]
    assert result["rounds"][1]["order"] == ["leto", "torch"]
    assert result["median_ratios"] == {"leto": result["ratio"]}  # no --other-landing
    ratios = [r["ratios"]["leto"] for r in result["rounds"]]
    assert result["spread"] == max(ratios) - min(ratios)
    assert "ratios spread" in proc.stdout


def test_first_steps_are_read_against_steady_windows_after_the_same_recovery() -> None:
    """A kill's baseline: windows of three steps after its recovery's first steps and before
    the next kill's wait for its shadow (which would hold a window for seconds)."""
    from bench.recovery_gpu import (
        KILL_SPACING,
        SHADOW_READY_BEFORE,
        STEADY_AFTER,
        first_steps_spans,
        steady_spans,
    )

    kill = 20
    wait = kill + KILL_SPACING - SHADOW_READY_BEFORE
    t, events = 0.0, []
    for step in range(kill):  # the dead trainer's steps
        t += 0.1
        events.append(_done(t, step))
    events.append({"t": t + 0.3, "kind": "resumed", "rank": 0, "step": kill})
    t += 0.3
    for step in range(kill, kill + KILL_SPACING + 2):
        t += {kill: 0.25, wait: 5.0}.get(step, 0.1 if step < kill + 8 else 0.05)
        events.append(_done(t, step))

    assert first_steps_spans(events, 0, 3) == [pytest.approx(0.45)]
    (windows,) = steady_spans(events, 0, 3, [kill])
    first = kill + STEADY_AFTER + 1
    assert len(windows) == wait - 3 - first + 1  # none holds the wait's 5 s
    assert max(windows) < 1.0
    assert windows[-1] == pytest.approx(0.15)  # the drifted steps just before the wait
    assert windows[0] == pytest.approx(0.25)  # from the sixth step on, drift and all
