"""Kills while the host runs ahead of the device: a job whose kernels take far longer than
their launches (examples/train_scheduled.py with 8192-wide layers and batches), killed in
forward, where the host has queued the previous step's update and begun the next while the
device is still on the previous step. The marker a successor reads is the one that landed,
a step behind the host; the stateful objects' record of that step must still be retained
(``Marker.wait_landed``). Bit-identical with the fault-free run. The CPU twins:
tests/trainer/test_records_outlive_marker.py, tests/updater/test_marker_ordering.py."""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import REPO, assert_exact, fault_free_digests, run_leto

SCRIPT = str(REPO / "examples" / "train_scheduled.py")
ARGS = ["--scheduler", "onecycle", "--hidden", "8192", "--batch", "8192"]


@pytest.mark.timeout(1200)
def test_kills_while_the_host_runs_ahead_recover_bit_identically(tmp_path) -> None:
    steps = 14
    (tmp_path / "ref").mkdir()
    reference = fault_free_digests(
        tmp_path / "ref", steps=steps, nproc=1, script=SCRIPT, model_args=ARGS, timeout_s=550
    )
    faults = [FaultSpec(rank=0, step=s, phase="forward") for s in (3, 7, 11)]
    proc, events = run_leto(
        tmp_path, steps=steps, nproc=1, faults=faults, script=SCRIPT, model_args=ARGS, timeout_s=550
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = [(e["step"], e["extras"]) for e in events if e["kind"] == Kind.RESUMED]
    assert len(resumed) == len(faults), resumed
    assert_exact(reference, events)
