"""The forward replay in a real job: each level-3 shadow runs its model's first step on a
scratch copy (``preinit.replay_forward: true``; on CPU it is off unless asked) before it
is ready, and the job with a kill recovers bit-identically to the fault-free run. With
the blocks compiled, the replay compiles the model's graphs and the promoted trainer's
first step compiles none."""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from leto.preinit.replay import NAME
from tests.launcher.harness import (
    GPT_ARGS,
    assert_recovered,
    fault_free_digests,
    resume_steps,
    run_leto,
)

STEPS = 8
LETO = {"preinit": {"replay_forward": True}}
FAULTS = [FaultSpec(rank=1, step=5, phase="forward", shadow_ready_steps_before=2)]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_shadows_replay_the_first_step_and_the_job_recovers_exactly(tmp_path, compiled) -> None:
    model = [*GPT_ARGS, "--compile"] if compiled else GPT_ARGS
    (tmp_path / "ref").mkdir()
    reference = fault_free_digests(tmp_path / "ref", steps=STEPS, leto=LETO, model_args=model)
    proc, events = run_leto(tmp_path, steps=STEPS, faults=FAULTS, leto=LETO, model_args=model)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(reference, events, FAULTS, nproc=2, resumed_at=resume_steps(FAULTS))
    promoted = [(e["rank"], e["gen"]) for e in events if e["kind"] == Kind.PROMOTED]
    assert sorted(promoted) == [(0, 1), (1, 1)]
    replays = {
        (e["rank"], e["gen"]): e
        for e in events
        if e["kind"] == Kind.MODEL_WARMED and e["name"] == NAME
    }
    ready = {(e["rank"], e["gen"]): e["t"] for e in events if e["kind"] == Kind.SHADOW_READY}
    for key in promoted:
        event = replays[key]
        assert event["ran"] and event["reason"] == "ok", event
        assert event["t"] < ready[key], "the replay runs before the shadow is ready"
        assert (event["compiled_graphs"] > 0) == compiled, event
    if compiled:  # the promoted trainers' first steps ran the replay's graphs
        at = {e["rank"]: e["t"] for e in events if e["kind"] == Kind.PROMOTED}
        firsts = {}
        for e in events:
            if e["kind"] == Kind.STEP_DONE and e["t"] > at[e["rank"]]:
                firsts.setdefault(e["rank"], e)
        assert sorted(firsts) == [0, 1]
        assert all("compiled_graphs" not in e for e in firsts.values()), firsts
