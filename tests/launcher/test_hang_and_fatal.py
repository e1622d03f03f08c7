"""Hangs are found by the heartbeat and recovered in place; fatal failures take the
checkpoint path. Real leto-run jobs, 2 CPU ranks; digests equal the fault-free run's."""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from leto.summary import Summary
from tests.launcher.harness import assert_exact, fault_free_digests, run_leto

STEPS = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], set[str]]:
    return fault_free_digests(tmp_path_factory.mktemp("ref"), steps=STEPS)


@pytest.mark.timeout(240)
def test_sigstopped_trainer_is_killed_within_timeout_and_recovered_exactly(
    tmp_path, reference
) -> None:
    timeout_s = 3.0
    faults = [FaultSpec(rank=1, step=7, phase="backward", kind="hang")]
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        faults=faults,
        extra=["--hang-timeout", str(timeout_s), "--first-step-timeout", "60"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    (stopped,) = [e for e in events if e["kind"] == Kind.FAULT_INJECTED]
    (hang,) = [e for e in events if e["kind"] == Kind.HANG_DETECTED]
    assert hang["timeout_s"] == timeout_s
    # The stopped rank is blamed as soon as its peer (waiting for it) is past the timeout,
    # even if it beat a moment after that peer's last beat.
    assert hang["rank"] == 1 and hang["proc_state"] == "T", hang
    # Found within the timeout (plus polling and a loaded machine's slack), not earlier or later.
    assert timeout_s - 1.0 <= hang["t"] - stopped["t"] <= timeout_s + 2.0, hang["t"] - stopped["t"]
    (epoch,) = [e for e in events if e["kind"] == Kind.EPOCH]
    assert (epoch["action"], epoch["failure"]) == ("in_place", "hof")
    assert not [e for e in events if e["kind"] == Kind.GROUP_RESTART]


@pytest.mark.timeout(240)
def test_fatal_failure_restarts_from_the_checkpoint_bit_identically(tmp_path, reference) -> None:
    faults = [FaultSpec(rank=1, step=10, phase="forward", kind="fatal")]
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        faults=faults,
        extra=[
            "--max-restarts",
            "1",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--checkpoint-every",
            "4",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    (epoch,) = [e for e in events if e["kind"] == Kind.EPOCH]
    assert (epoch["action"], epoch["failure"]) == ("restart", "ff")
    (restart,) = [e for e in events if e["kind"] == Kind.GROUP_RESTART]
    assert restart["restart"] == 1 and "ff" in restart["reason"]
    assert not [e for e in events if e["kind"] == Kind.SHADOWS_PROMOTED], (
        "an FF is never recovered in place"
    )
    loaded = [e for e in events if e["kind"] == Kind.CHECKPOINT_LOADED]
    assert {e["rank"] for e in loaded} == {0, 1} and len({e["step"] for e in loaded}) == 1
    step = loaded[0]["step"]
    assert step in (4, 8), step
    # The restarted run re-did the steps after the checkpoint: digests of both attempts agree.
    redone = [e for e in events if e["kind"] == Kind.DIGEST and e["step"] == step + 1]
    assert len(redone) >= 4, redone  # 2 ranks x (first attempt + after restart)
    (done,) = [e for e in events if e["kind"] == Kind.JOB_FINISHED]
    assert (done["restarts"], done["recoveries"]) == (1, 0)


@pytest.mark.timeout(240)
def test_broken_device_found_by_the_promoted_shadow_takes_the_checkpoint_path(
    tmp_path, reference
) -> None:
    """Emulated: a rank dies with its device (SIGKILL) and the device is left computing
    wrong — the injector flips one bit of the promoted shadow's device-check result, as a
    bad memory cell would. The shadow must refuse to resume (fatal), and the job restarts
    from the checkpoint, bit-identically."""
    faults = [FaultSpec(rank=1, step=9, phase="backward", kind="device")]
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        faults=faults,
        extra=[
            "--max-restarts",
            "1",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--checkpoint-every",
            "4",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    assert "DeviceUnhealthyError" in proc.stderr
    failures = [e for e in events if e["kind"] == Kind.FAILURE_DETECTED]
    assert [f["failure"] for f in failures] == ["hof", "ff"], (
        failures
    )  # the kill, then the bad device
    (restart,) = [e for e in events if e["kind"] == Kind.GROUP_RESTART]
    assert "ff" in restart["reason"]
    loaded = [e for e in events if e["kind"] == Kind.CHECKPOINT_LOADED]
    assert {e["rank"] for e in loaded} == {0, 1} and loaded[0]["step"] in (
        4,
        8,
    )  # 8 may still be in flight
    (done,) = [e for e in events if e["kind"] == Kind.JOB_FINISHED]
    assert (done["restarts"], done["recoveries"]) == (1, 0)
    # the promotion the restart answered is no recovery on the dashboard either
    assert Summary.of(events).restarts_and_recoveries() == (1, 0)
