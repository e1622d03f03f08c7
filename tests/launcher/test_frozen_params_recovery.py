"""A fine-tuning job's frozen base (parameters outside the optimizer) is retained: kills in
forward, backward and the update of ``examples/finetune_lora.py`` (LoRA adapters over a
frozen GPT with a tied embedding, two param groups, OneCycleLR, gradient accumulation)
recover in place, and every (rank, step) digest equals the fault-free run's. Without the
base in retained memory the promoted trainers, which build their model on the meta device,
would fail at their first forward."""

from __future__ import annotations

from pathlib import Path

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import REPO, assert_recovered, fault_free_digests, run_leto

SCRIPT = str(REPO / "examples/finetune_lora.py")
STEPS = 14
ARGS = ["--dim", "32", "--layers", "2"]


@pytest.mark.timeout(600)
def test_a_frozen_base_recovers_exactly(tmp_path: Path) -> None:
    (tmp_path / "ref").mkdir()
    kw = {"script": SCRIPT, "model_args": ARGS}
    reference = fault_free_digests(tmp_path / "ref", steps=STEPS, **kw)
    faults = [
        FaultSpec(rank=0, step=3, phase="backward"),
        FaultSpec(rank=1, step=7, phase="update"),
        FaultSpec(rank=0, step=11, phase="forward"),
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(reference, events, faults, nproc=2, resumed_at=[3, 8, 11])
    assert not [e for e in events if e["kind"] == Kind.GROUP_RESTART]
