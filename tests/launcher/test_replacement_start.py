"""A replacement shadow starts its device after its promoted predecessor's first step.

Replacements are spawned at the promotion (forked warm, ready again seconds later), so on a
GPU their CUDA context and warm-ups would share the device with the step the promoted trainer
re-runs, the one a recovery's time ends with. A real leto-run job (2 CPU ranks, gloo, a kill
in forward) whose promoted trainer's first step takes half a second: the replacement's trainer
starts after that step, and every digest equals the fault-free run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import assert_recovered, fault_free_run, resume_steps, run_leto

SCRIPT = str(Path(__file__).parent / "scripts" / "slow_first_step.py")
FAULTS = [FaultSpec(rank=1, step=5, phase="forward")]
STEPS = 8


@pytest.mark.timeout(300)
def test_a_replacement_starts_after_its_predecessors_first_step(tmp_path) -> None:
    (tmp_path / "ref").mkdir()
    ref, _ = fault_free_run(tmp_path / "ref", steps=STEPS, script=SCRIPT, model_args=[])
    proc, events = run_leto(tmp_path, steps=STEPS, faults=FAULTS, script=SCRIPT, model_args=[])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(ref, events, FAULTS, nproc=2, resumed_at=resume_steps(FAULTS))
    promoted = next(e for e in events if e["kind"] == Kind.PROMOTED and e["rank"] == 1)
    first = next(
        e
        for e in events
        if e["kind"] == Kind.STEP_DONE and e["rank"] == 1 and e["t"] > promoted["t"]
    )
    replacement = next(
        e
        for e in events
        if e["kind"] == Kind.TRAINER_STARTED
        and e["rank"] == 1
        and e["role"] == "shadow"
        and e["gen"] == promoted["gen"] + 1
    )
    assert first["iter_s"] > 0.45  # the slow step this tests against
    assert replacement["device_wait_s"] > 0.2  # the event says what it waited
    assert replacement["t"] >= first["t"], (
        f"the replacement started {first['t'] - replacement['t']:.3f} s before its "
        "predecessor's first step ended"
    )
