"""In-place recovery is bit-identical to a run that never failed.

Real leto-run jobs: 2 CPU ranks on gloo, active + shadow trainers, a state manager, real
SIGKILLs at random (step, rank, phase) points, several per run. Every rank reports a
digest of its whole retained state (parameters, buffers, AdamW state, RNG) at every
committed step; each must equal the fault-free run's for the same (rank, step).
Set LETO_SOAK=N to run N random schedules instead of the CI handful.
"""

from __future__ import annotations

import os

import pytest

from leto.events import Kind
from tests.launcher.harness import (
    assert_exact,
    assert_recovered,
    fault_free_digests,
    random_schedule,
    resume_steps,
    run_leto,
)

STEPS = 24
SCHEDULES = int(os.environ.get("LETO_SOAK", "1"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], set[str]]:
    return fault_free_digests(tmp_path_factory.mktemp("ref"), steps=STEPS)


def _assert_exact(ref: dict, events: list[dict], faults: list) -> None:
    assert_exact(ref, events)
    injected = [e for e in events if e["kind"] == Kind.FAULT_INJECTED]
    assert len(injected) == len(faults), injected
    promoted = [e for e in events if e["kind"] == Kind.SHADOWS_PROMOTED]
    assert len(promoted) == len(faults)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", range(SCHEDULES))
def test_random_kills_recover_bit_identically(tmp_path, reference, seed: int) -> None:
    faults = random_schedule(seed, STEPS, count=2, min_gap=6)
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(reference, events, faults, nproc=2, resumed_at=resume_steps(faults))
    promoted = [e for e in events if e["kind"] == Kind.SHADOWS_PROMOTED]
    assert len(promoted) == len(faults)


@pytest.mark.timeout(600)
def test_every_phase_on_both_ranks(tmp_path, reference) -> None:
    """One kill in each phase, alternating ranks, in one run (covers rerun and finish paths)."""
    from leto.config import FaultSpec

    faults = [
        FaultSpec(rank=0, step=3, phase="forward"),
        FaultSpec(rank=1, step=8, phase="backward"),
        FaultSpec(rank=0, step=13, phase="sync"),
        FaultSpec(rank=1, step=18, phase="update"),
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_exact(reference, events, faults)
    actions = {e["action"] for e in events if e["kind"] == Kind.RESUMED}
    assert {"rerun", "restore+finish"} <= actions, actions


@pytest.mark.timeout(600)
def test_level1_shadows_build_their_group_after_promotion(tmp_path, reference) -> None:
    """L1 shadows (imports and model only, no process group) recover exactly too."""
    from leto.config import FaultSpec

    faults = [
        FaultSpec(rank=1, step=5, phase="update"),
        FaultSpec(rank=0, step=14, phase="backward"),
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults, extra=["--shadow-level", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_exact(reference, events, faults)
    assert {e["level"] for e in events if e["kind"] == Kind.SHADOW_READY} == {1}
