"""Exact in-place recovery on a GPU: retained state in CUDA VMM memory, shadows with a
CUDA context and their own communicator; digests equal the fault-free run at every step.

One rank with NCCL, and two ranks sharing the GPU with gloo (NCCL refuses two ranks on
one device). First the demo GPT at a size that keeps the test short (a kill in every
phase), then a GPT of 1.1 B parameters (bf16 compute, fp32 master weights and AdamW
state, deterministic kernels) with kills at random ranks, steps and phases (seeded by
``LETO_GPU_SEED``; the schedule is printed).
"""

from __future__ import annotations

import os
import random

import pytest

from leto.config import PHASES, FaultSpec
from leto.events import Kind
from tests.launcher.harness import (
    assert_recovered,
    fault_free_digests,
    resume_steps,
    run_leto,
)

STEPS = 16
MODEL = ["--dim", "256", "--layers", "4", "--heads", "8", "--seq", "128", "--batch", "8", "--bf16"]


def run_against_fault_free(
    tmp_path, nproc: int, model: list[str], steps: int, faults: list[FaultSpec]
) -> list[dict]:
    """A fault-free run, then the same job with ``faults``: every per-step digest of the
    second equals the first's, each fault fired as scheduled and was recovered in place,
    and every rank resumed where the fault's phase says (:func:`assert_recovered`)."""
    reference = fault_free_digests(
        tmp_path, steps=steps, nproc=nproc, model_args=model, timeout_s=550
    )
    proc, events = run_leto(
        tmp_path, steps=steps, nproc=nproc, model_args=model, faults=faults, timeout_s=550
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(reference, events, faults, nproc=nproc, resumed_at=resume_steps(faults))
    assert len([e for e in events if e["kind"] == Kind.SHADOWS_PROMOTED]) == len(faults)
    return events


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("nproc", [1, 2])
def test_gpu_kills_in_every_phase_recover_bit_identically(tmp_path, nproc: int) -> None:
    faults = [
        FaultSpec(rank=0, step=3, phase="forward"),
        FaultSpec(rank=nproc - 1, step=7, phase="backward"),
        FaultSpec(rank=0, step=11, phase="update"),
    ]
    run_against_fault_free(tmp_path, nproc, MODEL, STEPS, faults)


GPT_1B = [
    "--vocab",
    "32000",
    "--dim",
    "2048",
    "--layers",
    "20",
    "--heads",
    "16",
    "--seq",
    "512",
    "--batch",
    "4",
    "--bf16",
]


def random_kills(seed: int, nproc: int, steps: int, count: int) -> list[FaultSpec]:
    """``count`` kills at random ranks and phases, at least two steps apart (so each finds the
    shadow generation spawned after the previous recovery)."""
    rng = random.Random(seed)
    kill_steps = sorted(rng.sample(range(2, steps - 1, 2), count))
    return [
        FaultSpec(rank=rng.randrange(nproc), step=s, phase=rng.choice(PHASES)) for s in kill_steps
    ]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("nproc", [1, 2])
def test_gpu_1b_random_kills_recover_bit_identically(tmp_path, nproc: int) -> None:
    steps = 12
    faults = random_kills(int(os.environ.get("LETO_GPU_SEED", "0")) + nproc, nproc, steps, count=3)
    print("kills:", [(f.rank, f.step, f.phase) for f in faults])
    run_against_fault_free(tmp_path, nproc, GPT_1B, steps, faults)
