"""A shadow pre-initialises at nice 19 and its promotion raises every thread back: a real
leto-run job (one CPU rank, its shadow, a SIGKILL); the digests equal the fault-free
run's. Where the kernel schedules by autogroups, the autogroup of the shadow's session is
lowered and raised with it (else its threads' nice values would rank them only against
each other). Where this process could not raise a thread back (no
CAP_SYS_NICE, a low RLIMIT_NICE) the shadow is never lowered, and the test checks that."""

from __future__ import annotations

import json
import os
from pathlib import Path

from leto.config import FaultSpec
from leto.events import Kind
from leto.priority import (
    AUTOGROUPS,
    DEFAULT_AUTOGROUP_NICE,
    LOWEST,
    SHADOW_AUTOGROUP_NICE,
    can_raise_to,
)
from tests.launcher.harness import REPO, assert_exact, fault_free_digests, run_leto

SCRIPT = str(REPO / "tests" / "launcher" / "scripts" / "nice_trace.py")


def _job(tmp_path: Path, steps: int, script_args: list[str], faults: list[FaultSpec]) -> list[dict]:
    """The traced one-rank job with ``faults``, checked digest for digest against the same job
    without them; returns the faulted job's trace records (the reference's are dropped)."""
    trace = tmp_path / "trace.jsonl"
    run = {"steps": steps, "nproc": 1, "model_args": [], "script": SCRIPT}
    script_args = ["--trace", str(trace), *script_args]
    reference = fault_free_digests(tmp_path, script_args=script_args, **run)
    trace.unlink()
    proc, events = run_leto(tmp_path, script_args=script_args, faults=faults, **run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    assert [e["kind"] for e in events].count(Kind.SHADOWS_PROMOTED) == len(faults)
    return [json.loads(line) for line in trace.read_text().splitlines()]


def test_a_shadow_waits_at_the_lowest_priority_and_is_raised_back_when_promoted(
    tmp_path,
) -> None:
    base = os.getpriority(os.PRIO_PROCESS, 0)
    fault = FaultSpec(rank=0, step=5, phase="forward", shadow_ready_steps_before=2)
    records = _job(tmp_path, 8, [], [fault])
    by_pid: dict[int, list[dict]] = {}
    for r in records:
        by_pid.setdefault(r["pid"], []).append(r)
    shadow_inits = [r for r in records if r["at"] == "init" and r["shadow"]]
    assert shadow_inits, "no shadow started"
    lowered = LOWEST if can_raise_to(base) and base < LOWEST else base
    grouped = AUTOGROUPS.exists() and AUTOGROUPS.read_text().strip() == "1"
    group = SHADOW_AUTOGROUP_NICE if lowered != base else DEFAULT_AUTOGROUP_NICE
    for r in shadow_inits:
        assert set(r["nices"]) == {lowered}, r
        # a worker leads its own session: its autogroup is its own
        assert r["autogroup"] == (group if grouped else None), r
    promoted = [
        rs
        for rs in by_pid.values()
        if rs[0]["at"] == "init" and rs[0]["shadow"] and any(r["at"] == "step" for r in rs)
    ]
    assert len(promoted) == 1, "the shadow was not promoted"
    steps = [r for r in promoted[0] if r["at"] == "step"]
    assert [r["step"] for r in steps] == [5, 6, 7]
    for r in steps:  # every thread, those the shadow started at nice 19 included
        assert set(r["nices"]) == {base}, r
        assert r["autogroup"] == (DEFAULT_AUTOGROUP_NICE if grouped else None), r


def test_a_shadow_promoted_before_it_is_ready_is_raised_at_once(tmp_path) -> None:
    """The agent raises a shadow promoted while still pre-initialising (it would raise itself
    only at its wait): the rest of its pre-initialisation and its steps run at the trainer's
    priority, every thread of it."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    records = _job(
        tmp_path,
        4,
        ["--shadow-sleep", "4", "--await-shadow-at", "1"],
        [FaultSpec(rank=0, step=1, phase="forward")],
    )
    (first,) = [r["pid"] for r in records if r["at"] == "init" and r["shadow"]][:1]
    mine = [r for r in records if r["pid"] == first]
    assert [r["at"] for r in mine][:2] == ["init", "slept"], mine
    assert [r.get("step") for r in mine[2:]] == [1, 2, 3], "the sleeping shadow was not promoted"
    if can_raise_to(base) and base < LOWEST:
        assert set(mine[0]["nices"]) == {LOWEST}, mine[0]
    for r in mine[1:]:  # raised by the agent during its sleep, before its own wait
        assert set(r["nices"]) == {base}, r
        assert r["autogroup"] in (None, DEFAULT_AUTOGROUP_NICE), r
