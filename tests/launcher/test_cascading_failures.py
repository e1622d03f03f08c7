"""Failures that come close together never cost the job (real leto-run jobs, 2 CPU ranks).

Each job runs with the default ``--max-restarts 0``: a group restart would fail it, so
exit 0 plus digests equal to the fault-free run's shows every failure was recovered in
place, from exactly the retained state.
"""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from leto.summary import Summary
from tests.launcher.harness import assert_exact, fault_free_digests, run_leto

STEPS = 10
ERASURE = {"erasure": {"page_bytes": 4096, "data_pages": 16, "tier1_parity": 2, "tier2_parity": 1}}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free_digests(tmp_path_factory.mktemp("ref"), steps=STEPS)


def _kinds(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


@pytest.mark.timeout(400)
def test_a_kill_in_the_promoted_trainers_first_step_promotes_the_replacements(
    tmp_path, reference
) -> None:
    """The issue's case: the promoted trainer is killed while it re-runs step 5 (its
    replacement shadows exist already, spawned at promotion, still starting)."""
    faults = [
        FaultSpec(rank=1, step=5, phase="backward"),
        FaultSpec(rank=1, step=5, phase="update"),
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(_kinds(events, Kind.FAULT_INJECTED)) == 2
    assert [e["cold"] for e in _kinds(events, Kind.SHADOWS_PROMOTED)] == [False, False]
    assert not _kinds(events, Kind.GROUP_RESTART)
    # the second failure struck the generation promoted by the first, before its first step
    failed = [e["gen"] for e in _kinds(events, Kind.FAILURE_DETECTED)]
    assert failed == [0, 1]
    # both failures were answered in place: the job, its dashboard and its summary say two
    (done,) = _kinds(events, Kind.JOB_FINISHED)
    assert (done["restarts"], done["recoveries"]) == (0, 2)
    assert Summary.of(events).restarts_and_recoveries() == (0, 2)
    assert_exact(reference, events)


@pytest.mark.timeout(400)
def test_a_kill_while_no_shadows_exist_attaches_a_cold_generation(tmp_path, reference) -> None:
    """An OOM reclaims the shadows; the same step is then killed before they are back: a
    cold generation attaches to the retained state (no group restart, no step 0)."""
    faults = [
        FaultSpec(rank=0, step=4, phase="forward", kind="oom"),
        FaultSpec(rank=0, step=4, phase="backward"),
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [e["cold"] for e in _kinds(events, Kind.SHADOWS_PROMOTED)] == [True]
    assert [e["step"] for e in _kinds(events, Kind.RESUMED)] == [4, 4]
    assert not _kinds(events, Kind.GROUP_RESTART)
    assert_exact(reference, events)


@pytest.mark.slow  # CI runs the other cascades and tests/launcher/test_erasure_recovery.py
@pytest.mark.timeout(400)
def test_a_kill_in_the_middle_of_a_page_rebuild_leaves_the_losses_to_the_successor(
    tmp_path,
) -> None:
    """Pages lost at the first recovery; the promoted trainer dies after their chunks were
    replaced by zeroed ones, before the rebuild: its successor must rebuild them again
    (resuming on the zeroed chunks would diverge from the fault-free run)."""
    (tmp_path / "ref").mkdir()
    ref = fault_free_digests(tmp_path / "ref", steps=STEPS, leto=ERASURE)
    faults = [
        FaultSpec(rank=1, step=4, phase="backward", erase_device_pages=2),
        FaultSpec(rank=1, step=4, phase="recovery", point="rebuild"),
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults, leto=ERASURE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [e["phase"] for e in _kinds(events, Kind.FAULT_INJECTED)] == ["backward", "recovery"]
    rebuilt = [e for e in _kinds(events, Kind.PAGES_REBUILT) if e["rank"] == 1]
    assert rebuilt and rebuilt[-1]["lost"]["state"]["data"] > 0  # the successor found them lost
    assert_exact(ref, events)


@pytest.mark.timeout(400)
def test_a_hang_in_the_promoted_trainers_first_step_is_found_within_the_hang_timeout(
    tmp_path, reference
) -> None:
    """The promoted (warm) trainer stops in its first step: judged by --hang-timeout, not
    by the first-step timeout a fresh start gets, and the stopped rank is the one killed."""
    faults = [
        # the shadows are ready by then: a promotion of unready ones is judged as a cold start
        FaultSpec(rank=1, step=5, phase="backward", shadow_ready_steps_before=2),
        FaultSpec(rank=1, step=5, phase="update", kind="hang"),
    ]
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        faults=faults,
        extra=["--hang-timeout", "3", "--first-step-timeout", "120"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (stopped,) = [e for e in _kinds(events, Kind.FAULT_INJECTED) if e["fault_kind"] == "hang"]
    (hang,) = _kinds(events, Kind.HANG_DETECTED)
    assert (
        hang["rank"] == 1
        and hang["gen"] == 1
        and hang["proc_state"] == "T"
        and hang["timeout_s"] == 3.0
    )
    assert hang["t"] - stopped["t"] < 10, hang["t"] - stopped["t"]
    assert len(_kinds(events, Kind.SHADOWS_PROMOTED)) == 2 and not _kinds(
        events, Kind.GROUP_RESTART
    )
    assert_exact(reference, events)
