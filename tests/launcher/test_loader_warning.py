"""A plain ``DataLoader`` that Leto does not retain restarts from its first batch after a
recovery, and the job then trains on other data than a run without failures. A real
leto-run job (2 CPU ranks, gloo, a kill in forward): every trainer names the loader in a
warning at its first steps, the promoted ones with the step they resumed at,
and the digests after the recovery differ from the fault-free run's (what the warning is
about). ``tests/trainer/test_loaders.py`` covers which loaders count as retained."""

from __future__ import annotations

from pathlib import Path

import pytest

from leto.config import FaultSpec
from tests.launcher.harness import digests, fault_free_run, run_leto

SCRIPT = str(Path(__file__).parent / "scripts" / "plain_loader.py")
FAULTS = [FaultSpec(rank=1, step=4, phase="forward")]
STEPS = 6
WARNING = "a DataLoader over TensorDataset (SequentialSampler) is not retained by leto"


@pytest.mark.timeout(300)
def test_an_unretained_loader_is_named_before_and_after_a_recovery(tmp_path) -> None:
    (tmp_path / "ref").mkdir()
    ref, _ = fault_free_run(tmp_path / "ref", steps=STEPS, script=SCRIPT, model_args=[])
    proc, events = run_leto(tmp_path, steps=STEPS, faults=FAULTS, script=SCRIPT, model_args=[])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: {WARNING}: after a recovery" in proc.stderr, proc.stderr[-3000:]
    assert f"rank 1: {WARNING}: this trainer resumed at step 4" in proc.stderr
    got = digests(events)
    assert all(got[(r, s)] == ref[(r, s)] for r in (0, 1) for s in range(1, 5))
    assert got[(1, STEPS)] != ref[(1, STEPS)], "the restarted loader changed nothing"
