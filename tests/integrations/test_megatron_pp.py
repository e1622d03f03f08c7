"""Megatron-Core pipeline parallelism under leto-run (gloo, CPU): exact in-place recovery.

Real jobs: examples/megatron_gpt.py ``--pipeline-model-parallel-size 2`` (1F1B, no
interleaving) with the CPU ``torch.cuda`` shims, Megatron's DDP per stage, the word
embedding tied to the output layer (``--share-embeddings-and-output-weights``: a copy on
each stage, gradients summed by Megatron's ``finalize_model_grads``), 4 micro-batches per
iteration, shadows at L3 (each builds its stage on ``meta``), ``consistency: rmu`` with
two-tier erasure protection. Each stage retains only its own parameters and Adam state.

* the fault-free run: the first and last stage's copies of the tied embedding are
  bit-identical at the end (the example reports a digest of each): they start equal
  (Megatron's set-up all-reduce) and apply the same summed gradient; without the
  embedding all-reduce of ``finalize_model_grads`` they differ after one step (checked by
  hand: replacing it with DDP's ``finish_grad_sync`` alone gives two digests). No
  PP=2 == PP=1 comparison: a stage initialises its layers from its own RNG stream
  (as Megatron does), so the two runs start from different weights;
* PP=2 on 2 ranks: SIGKILLs in forward (stage 1, mid-schedule), backward (stage 0, mid
  1F1B), at the gradient sync (stage 1, before ``finalize_model_grads``) and inside the
  optimizer update (stage 0, mid-chunk); every (rank, step) digest equals the fault-free
  PP=2 run's;
* PP=2 x DP=2 on 4 ranks (``slow``, --run-slow): exact recovery from kills in forward, backward
  and mid-update, each replica's tied copies equal.

Not on CPU: NCCL p2p (tests/gpu/test_megatron_gpu.py, 2 GPUs), interleaved schedules
(virtual stages, refused), PP > 2.
"""

from __future__ import annotations

import math
import re

import pytest

from leto.config import FaultSpec
from tests.integrations.megatron_jobs import TINY_GPT, MegatronJobs
from tests.launcher.harness import assert_recovered, digests

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'"
)

MODEL = [
    *TINY_GPT,
    "--share-embeddings-and-output-weights",
    "--clip-grad",
    "0.05",
]  # clipping bites every step
ERASURE = {"page_bytes": 4096, "data_pages": 16, "tier1_parity": 8, "tier2_parity": 1}
LETO = {"consistency": "rmu", "erasure": ERASURE, "rmu_chunk_bytes": 32768}
MICROBATCHES = 4


def _pp(size: int, dp: int = 1) -> list[str]:
    return [
        "--pipeline-model-parallel-size",
        str(size),
        "--global-batch-size",
        str(2 * MICROBATCHES * dp),
    ]


JOBS = MegatronJobs(LETO, MODEL)
_job, _run, _losses = JOBS.job, JOBS.run, MegatronJobs.losses


def _tied(stdout: str) -> dict[int, str]:
    """rank -> the digest of its copy of the tied word embedding at the end (the example's report)."""
    found = re.findall(r"megatron_gpt: rank (\d+) tied embedding ([0-9a-f]+)", stdout)
    return {int(rank): digest for rank, digest in found}


def _clean(tmp_path, *, nproc: int, steps: int, script_args: list[str], timeout_s: float):
    """The fault-free reference: every (rank, step) digest, once; the tied copies equal."""
    proc, events = _run(
        tmp_path, nproc=nproc, steps=steps, script_args=script_args, timeout_s=timeout_s
    )
    ref = digests(events)
    assert set(ref) == {(r, s) for r in range(nproc) for s in range(1, steps + 1)}
    assert all(len(v) == 1 for v in ref.values()), "the fault-free run must be deterministic"
    return proc, events, ref


def _assert_exact_recovery(
    tmp_path,
    *,
    nproc: int,
    steps: int,
    faults: list[FaultSpec],
    resumed_at: list[int],
    script_args: list[str],
    stages: dict[int, tuple[int, int]],
    timeout_s: float,
) -> None:
    """``stages``: replica -> (first-stage rank, last-stage rank)."""
    proc, events, clean = _clean(
        tmp_path, nproc=nproc, steps=steps, script_args=script_args, timeout_s=timeout_s
    )
    assert f"PP 2, DP {len(stages)}), {MICROBATCHES} micro-batches per iteration" in proc.stdout
    tied = _tied(proc.stdout)
    assert set(tied) == {r for pair in stages.values() for r in pair}
    for first, last in stages.values():
        assert tied[first] == tied[last], (
            "the first and last stage's copies of the tied embedding diverged"
        )
    losses = {r: _losses(events, r) for r in range(nproc)}
    for first, last in stages.values():
        assert losses[first] == [None] * steps, "a first stage has no loss"
        assert all(isinstance(x, float) and math.isfinite(x) for x in losses[last])
    proc, events = _run(
        tmp_path,
        nproc=nproc,
        steps=steps,
        faults=faults,
        script_args=script_args,
        timeout_s=timeout_s,
    )
    assert_recovered(clean, events, faults, nproc=nproc, resumed_at=resumed_at)
    assert _tied(proc.stdout) == tied, (
        "the recovered run's tied embedding differs from the fault-free run's"
    )


@pytest.mark.slow  # CI runs the TP, EP and DP Megatron recoveries
@pytest.mark.timeout(400)
def test_pp2_recovery_is_bit_exact(tmp_path):
    faults = [
        FaultSpec(rank=1, step=3, phase="forward"),  # last stage, its first micro-batch's forward
        FaultSpec(
            rank=0, step=5, phase="backward", erase_device_pages=8, erase_host_pages=1
        ),  # mid 1F1B
        FaultSpec(rank=1, step=7, phase="sync"),  # before finalize_model_grads
        FaultSpec(rank=0, step=9, phase="update", point="optimizer", chunk=1, erase_device_pages=8),
    ]
    _assert_exact_recovery(
        tmp_path,
        nproc=2,
        steps=12,
        faults=faults,
        resumed_at=[3, 5, 7, 10],
        script_args=_pp(2),
        stages={0: (0, 1)},
        timeout_s=200,
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp2_dp2_recovery_is_bit_exact(tmp_path):
    # Megatron's rank order: stage 0 = ranks 0, 1 (DP group), stage 1 = ranks 2, 3; replicas (0, 2) and (1, 3).
    faults = [
        FaultSpec(rank=2, step=2, phase="forward"),
        FaultSpec(rank=1, step=4, phase="backward", erase_device_pages=8),
        FaultSpec(rank=3, step=6, phase="update", point="optimizer", chunk=1, erase_device_pages=8),
    ]
    _assert_exact_recovery(
        tmp_path,
        nproc=4,
        steps=8,
        faults=faults,
        resumed_at=[2, 4, 7],
        script_args=_pp(2, dp=2),
        stages={0: (0, 2), 1: (1, 3)},
        timeout_s=400,
    )
