"""A model compiled whole (``torch.compile(model)``, as a Hugging Face or plain PyTorch user
compiles it) under leto-run: every leaf is inside the compiled region, so Leto's hooks sit
on the compiled wrapper (``leto.compiled.hook_sites``); a kill in the forward and one inside
the update recover, and every digest equals the fault-free run's. Blocks compiled one by
one under ``fully_shard`` are tests/launcher/test_fsdp2_recovery.py -k compiled."""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from tests.launcher.harness import assert_recovered, fault_free_run, resume_steps, run_leto

MODEL = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--compile", "model"]
FAULTS = [
    FaultSpec(rank=1, step=2, phase="forward"),
    FaultSpec(rank=0, step=4, phase="update"),
]


@pytest.mark.timeout(400)
def test_a_model_compiled_whole_recovers_exactly(tmp_path) -> None:
    (tmp_path / "ref").mkdir()
    ref, _ = fault_free_run(tmp_path / "ref", steps=6, model_args=MODEL, timeout_s=300)
    proc, events = run_leto(tmp_path, steps=6, faults=FAULTS, model_args=MODEL, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(ref, events, FAULTS, nproc=2, resumed_at=resume_steps(FAULTS))
