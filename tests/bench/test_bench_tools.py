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
