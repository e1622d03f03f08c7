"""A Hugging Face job: ``transformers``' ``LlamaForCausalLM`` with its cosine warm-up
schedule (``examples/train_hf_llama.py``) recovers in place, bit-identically to the
fault-free run, from kills in the forward pass and in the update."""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from tests.launcher.harness import (
    REPO,
    assert_recovered,
    fault_free_digests,
    resume_steps,
    run_leto,
)

SCRIPT = str(REPO / "examples" / "train_hf_llama.py")
# attention dropout draws from the retained RNG; the schedule's LR is retained with each step
MODEL = ["--dim", "32", "--layers", "2", "--heads", "4", "--seq", "16", "--dropout", "0.1"]
STEPS = 9
FAULTS = [
    FaultSpec(rank=0, step=3, phase="forward", shadow_ready_steps_before=1),
    FaultSpec(rank=1, step=7, phase="update", shadow_ready_steps_before=1),
]


@pytest.mark.timeout(400)
def test_hf_llama_recovers_exactly(tmp_path) -> None:
    run = {"script": SCRIPT, "model_args": MODEL}
    (tmp_path / "ref").mkdir()
    reference = fault_free_digests(tmp_path / "ref", steps=STEPS, **run)
    proc, events = run_leto(tmp_path, steps=STEPS, faults=FAULTS, **run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(reference, events, FAULTS, nproc=2, resumed_at=resume_steps(FAULTS))
