"""Megatron-Core mixture of experts and expert parallelism under leto-run (gloo, CPU): exact recovery.

Real jobs: examples/megatron_gpt.py ``--num-experts 4 --moe-router-topk 2`` (Megatron's
local MoE layer in both layers: router with the load-balancing aux loss, ``SequentialMLP``
experts, the all-to-all token dispatcher over gloo's ``all_to_all_single``, no token
dropping) with the CPU ``torch.cuda`` shims, Megatron's DDP on retained gradient regions,
shadows at L3, ``consistency: rmu`` with two-tier erasure protection, clipping that bites
every step.

* EP=2 on 2 ranks (each rank retains 2 of the 4 experts; the dense part is data-parallel
  over both): the dense and expert gradients live in separate retained regions
  ("ddp.grads.float32", "ddp.grads.expert.float32"); SIGKILLs in forward (rank 1: rank 0
  then waits in the dispatcher's all-to-all for a dead peer), backward (rank 0, with
  erased pages), at the gradient sync (rank 1, before Megatron's bucket all-reduces) and
  mid-chunk in the optimizer update (rank 0); every (rank, step) digest equals the
  fault-free EP=2 run's; the dense parameters end bit-identical on both ranks (each rank
  clipped by the same global norm: with the expert norm taken over the expert-data-parallel
  group of one instead, they diverge) and equal to the fault-free run's;
* EP=1 at DP=2 (``slow``, --run-slow): the same MoE model, experts replicated, exact
  recovery from kills in forward, backward and mid-update.

Not on CPU: NCCL (tests/gpu/test_megatron_gpu.py, 2 GPUs), EP > 2, expert tensor
parallelism, grouped GEMM, token dropping (refused).
"""

from __future__ import annotations

import math
import re

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.integrations.megatron_jobs import TINY_GPT
from tests.launcher.harness import REPO, assert_recovered, digests, run_leto

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'"
)

SCRIPT = str(REPO / "examples" / "megatron_gpt.py")
MODEL = [
    *TINY_GPT,
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-token-dispatcher-type",
    "alltoall",
    "--moe-router-load-balancing-type",
    "aux_loss",
    "--moe-aux-loss-coeff",
    "1e-2",
    "--disable-bias-linear",
    "--clip-grad",
    "0.05",
]  # clipping bites every step: the expert norm counts
ERASURE = {"page_bytes": 4096, "data_pages": 16, "tier1_parity": 8, "tier2_parity": 1}
LETO = {"consistency": "rmu", "erasure": ERASURE, "rmu_chunk_bytes": 32768}


def _job(ep: int, timeout_s: float) -> dict:
    return {
        "leto": LETO,
        "script": SCRIPT,
        "steps_flag": "--train-iters",
        "model_args": MODEL,
        "script_args": ["--expert-model-parallel-size", str(ep)],
        "timeout_s": timeout_s,
    }


def _dense(stdout: str) -> dict[int, str]:
    """rank -> the digest of its dense (non-expert) parameters at the end (the example's report)."""
    return {
        int(r): d
        for r, d in re.findall(r"megatron_gpt: rank (\d+) dense parameters ([0-9a-f]+)", stdout)
    }


def _assert_exact_recovery(
    tmp_path,
    *,
    ep: int,
    steps: int,
    faults: list[FaultSpec],
    resumed_at: list[int],
    timeout_s: float = 200,
) -> None:
    proc, events = run_leto(tmp_path, steps=steps, nproc=2, **_job(ep, timeout_s))
    assert proc.returncode == 0, proc.stderr[-4000:]
    clean = digests(events)
    assert set(clean) == {(r, s) for r in range(2) for s in range(1, steps + 1)}
    assert all(len(v) == 1 for v in clean.values()), "the fault-free run must be deterministic"
    # every rank clipped by the same global norm (expert squares summed over the EP group)
    dense = _dense(proc.stdout)
    assert set(dense) == {0, 1} and dense[0] == dense[1], (
        "the data-parallel ranks' dense parameters diverged"
    )
    losses = [e["loss"] for e in events if e["kind"] == Kind.STEP_DONE]
    assert len(losses) == 2 * steps and all(
        isinstance(x, float) and math.isfinite(x) for x in losses
    )
    proc, events = run_leto(tmp_path, steps=steps, nproc=2, faults=faults, **_job(ep, timeout_s))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"(TP 1, EP {ep}, DP 2), MoE 4 experts top-2 (alltoall)" in proc.stdout
    regions = (
        "['ddp.grads.float32', 'ddp.grads.expert.float32']" if ep > 1 else "['ddp.grads.float32']"
    )
    held = {0: [0, 1], 1: [2, 3]} if ep > 1 else {0: [0, 1, 2, 3], 1: [0, 1, 2, 3]}
    for rank, experts in held.items():
        assert (
            f"megatron_gpt: rank {rank} experts {experts}, gradient regions {regions}"
            in proc.stdout
        )
    assert_recovered(clean, events, faults, nproc=2, resumed_at=resumed_at)
    assert _dense(proc.stdout) == dense, (
        "the recovered run's dense parameters differ from the fault-free run's"
    )


@pytest.mark.timeout(400)
def test_ep2_recovery_is_bit_exact(tmp_path):
    faults = [
        FaultSpec(
            rank=1, step=2, phase="forward"
        ),  # rank 0 goes on into the dispatcher's all-to-all
        FaultSpec(rank=0, step=4, phase="backward", erase_device_pages=8, erase_host_pages=1),
        FaultSpec(
            rank=1, step=6, phase="sync"
        ),  # before Megatron's dense and expert bucket all-reduces
        FaultSpec(rank=0, step=8, phase="update", point="optimizer", chunk=1, erase_device_pages=8),
    ]
    _assert_exact_recovery(tmp_path, ep=2, steps=10, faults=faults, resumed_at=[2, 4, 6, 9])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_moe_ep1_dp2_recovery_is_bit_exact(tmp_path):
    faults = [
        FaultSpec(rank=0, step=2, phase="forward"),
        FaultSpec(rank=1, step=4, phase="backward", erase_device_pages=8),
        FaultSpec(rank=0, step=6, phase="update", point="optimizer", chunk=1, erase_device_pages=8),
    ]
    _assert_exact_recovery(tmp_path, ep=1, steps=8, faults=faults, resumed_at=[2, 4, 7])
