"""Exact in-place recovery on a GPU: retained state in CUDA VMM memory, shadows with a
CUDA context and their own communicator; digests equal the fault-free run at every step.

One rank with NCCL, and two ranks sharing the GPU with gloo (NCCL refuses two ranks on
one device). The model is the demo GPT at a size that keeps the test short; the >= 1B
run is bench/recovery_gpu.py.
"""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from tests.launcher.harness import digests, run_leto

STEPS = 16
MODEL = ["--dim", "256", "--layers", "4", "--heads", "8", "--seq", "128", "--batch", "8", "--bf16"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("nproc", [1, 2])
def test_gpu_kills_in_every_phase_recover_bit_identically(tmp_path, nproc: int) -> None:
    ref_proc, ref_events = run_leto(tmp_path, steps=STEPS, nproc=nproc, model_args=MODEL, timeout_s=600)
    assert ref_proc.returncode == 0, ref_proc.stderr[-3000:]
    reference = digests(ref_events)
    assert len(reference) == nproc * STEPS and all(len(v) == 1 for v in reference.values())
    faults = [
        FaultSpec(rank=0, step=3, phase="forward"),
        FaultSpec(rank=nproc - 1, step=7, phase="backward"),
        FaultSpec(rank=0, step=11, phase="update"),
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, nproc=nproc, model_args=MODEL, faults=faults, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = digests(events)
    assert set(got) == set(reference)
    for key, values in got.items():
        assert values == reference[key], f"rank {key[0]} step {key[1]} diverged"
    assert len([e for e in events if e["kind"] == "shadows_promoted"]) == len(faults)

