"""Megatron's distributed optimizer on Leto's retained state (CPU, gloo).

In one process (a world of one): the shard plan is the same from a ``meta`` model as from a
real one; at DP=2 the two ranks' shards cover every parameter element exactly once (so each
rank's Adam state is half the model's, padding aside); Megatron's own buffers and its
``DistributedOptimizer`` range maps equal the plan, and a plan that differs fails loudly.

Under leto-run (2 ranks, DP=2, Megatron DDP with overlapped reduce-scatters in 2000-element
buckets, ``consistency: rmu`` with two-tier parity):

* fault-free, the distributed optimizer equals Megatron DDP without it: with clipping
  inactive bit for bit (losses and every parameter: the reduce-scattered shard is the same
  sum as the all-reduced bucket, AdamW is element-wise); with clipping active to float
  rounding only (the global norm is summed per shard, then over ranks, instead of over the
  whole gradient: a different association of the same squares, so the coefficient may
  differ in its last bits; ``assert_close`` at fp32's default tolerances);
* each rank retains optimizer state for its shard only: the two ranks' counts add up to the
  model's parameter count, each about half;
* recovery (``test_megatron_distopt_recovery_is_bit_exact``): SIGKILLs in forward, in
  backward (+16 lost state pages and a host parity page), mid-chunk inside the sharded
  update (+16 lost state pages), inside the parameter all-gather (the buffer scribbled and
  its chunk lost), and mid-update losing pages of the reduce-scattered gradient buffer:
  every (rank, step) digest — the retained shard state and the all-gathered parameters —
  equals the fault-free distributed-optimizer run's;
* bad input: ``--use-distributed-optimizer`` with ``--ddp-impl leto``, or under
  ``consistency: snapshot``, is a one-line error and a non-zero exit.

Slow (``--run-slow``): TP=2 x DP=2 (equal losses under a biting clip, exact recovery), the
fused Triton RMU kernel (the GPU's default path, interpreted) over the shards, and DP=4
(a quarter of the state per rank, exact recovery).
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from leto.config import FaultSpec
from leto.errors import ProtocolError
from leto.events import Kind
from tests.integrations.megatron_jobs import SCRIPT, TINY_GPT, MegatronJobs
from tests.integrations.test_megatron_ddp import _gpt
from tests.launcher.harness import _env, assert_recovered, digests, run_leto

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'"
)

ERASURE = {"page_bytes": 4096, "data_pages": 32, "tier1_parity": 16, "tier2_parity": 1}
LETO = {"consistency": "rmu", "erasure": ERASURE, "rmu_chunk_bytes": 16384}
JOBS = MegatronJobs(leto=LETO, model=TINY_GPT)
DDP = ["--overlap-grad-reduce", "--ddp-bucket-size", "2000"]
DISTOPT = [*DDP, "--use-distributed-optimizer"]
BUCKET = 2000


# -- in one process --------------------------------------------------------------------------
def _setup(lm, device: str = "cpu"):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    model = _gpt(lm, device)
    opt = lm.adamw(model, OptimizerConfig(optimizer="adam", lr=1e-3))
    config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET
    )
    return model, [p for g in opt.param_groups for p in g["params"]], config


def test_shards_cover_the_model_once_and_plan_from_meta(parallel):
    from leto.integrations import megatron_distopt

    model, params, config = _setup(parallel)
    meta, meta_params, _ = _setup(parallel, "meta")
    plans = [
        megatron_distopt.plan_shards(model, params, config, dp_rank=r, dp_size=2) for r in range(2)
    ]
    assert plans == [
        megatron_distopt.plan_shards(meta, meta_params, config, dp_rank=r, dp_size=2)
        for r in range(2)
    ]
    (buffer,) = plans[0].buffers
    assert len(buffer.buckets) > 4 and buffer.numel % 2 == 0
    covered = [torch.zeros(p.numel(), dtype=torch.int32) for p in params]
    for plan in plans:
        for piece in plan.pieces:
            covered[piece.param][piece.lo : piece.hi] += 1
    assert all(bool((c == 1).all()) for c in covered), "every element in exactly one rank's shard"
    total = sum(p.numel() for p in params)
    counts = [plan.shard_numel() for plan in plans]
    assert sum(counts) == total and max(counts) <= total // 2 + (buffer.numel - total)
    assert plans[0].grad_placement.regions == (("ddp.grads.float32", buffer.numel * 4),)
    assert plans[0].mirror == (("ddp.params.float32", buffer.numel * 4),)


def test_megatrons_buffers_and_ranges_equal_the_plan(parallel):
    from megatron.core.distributed import DistributedDataParallel

    from leto.integrations import megatron_distopt

    model, params, config = _setup(parallel)
    plan = megatron_distopt.plan_shards(model, params, config, dp_rank=0, dp_size=1)
    ddp = DistributedDataParallel(config=model.config, ddp_config=config, module=model)
    megatron_distopt.check_against_megatron(ddp, plan, params)
    assert all(
        p.data_ptr() - ddp.buffers[0].param_data.data_ptr() == 4 * plan.buffers[0].index[i][0]
        for i, p in enumerate(params)
    )
    (buffer,) = plan.buffers
    shifted = type(buffer)(
        param_dtype=buffer.param_dtype,
        grad_dtype=buffer.grad_dtype,
        numel=buffer.numel,
        buckets=((0, buffer.buckets[0][1] + 128), *buffer.buckets[1:]),
        index=buffer.index,
    )
    with pytest.raises(ProtocolError, match="pads or buckets differently"):
        megatron_distopt.check_against_megatron(
            ddp, type(plan)(dp_rank=0, dp_size=1, buffers=(shifted,), pieces=plan.pieces), params
        )


# -- under leto-run --------------------------------------------------------------------------
def _state_counts(stdout: str) -> dict[int, tuple[int, int]]:
    found = re.findall(r"rank (\d) optimizer state (\d+) of (\d+) parameter elements", stdout)
    return {int(r): (int(n), int(m)) for r, n, m in found}


def _parameters(path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.slow  # CI runs test_megatron_distopt_recovery_is_bit_exact
@pytest.mark.timeout(300)
def test_distributed_optimizer_equals_megatron_ddp(tmp_path):
    steps = 8
    runs = {}
    for name, args in {"ddp": DDP, "distopt": DISTOPT}.items():
        for clip in ("1e9", "1.0"):
            out = tmp_path / f"{name}-{clip}.pt"
            proc, events = JOBS.run(
                tmp_path,
                nproc=2,
                steps=steps,
                script_args=[*args, "--clip-grad", clip, "--parameters-out", str(out)],
            )
            runs[name, clip] = (proc, events, out)
    # clipping inactive: bit for bit
    for rank in range(2):
        assert JOBS.losses(runs["ddp", "1e9"][1], rank) == JOBS.losses(
            runs["distopt", "1e9"][1], rank
        )
    plain, sharded = (_parameters(runs[k, "1e9"][2]) for k in ("ddp", "distopt"))
    assert plain.keys() == sharded.keys()
    assert all(torch.equal(plain[k], sharded[k]) for k in plain), (
        "parameters differ without clipping"
    )
    # clipping active (the model's gradient norm is above 1): equal to float rounding
    plain, sharded = (_parameters(runs[k, "1.0"][2]) for k in ("ddp", "distopt"))
    differ = [k for k in plain if not torch.equal(plain[k], sharded[k])]
    print(f"clipped: {len(differ)} of {len(plain)} parameters differ in their last bits")
    for k in plain:
        torch.testing.assert_close(sharded[k], plain[k])
    torch.testing.assert_close(
        torch.tensor(JOBS.losses(runs["distopt", "1.0"][1], 0)),
        torch.tensor(JOBS.losses(runs["ddp", "1.0"][1], 0)),
    )
    # each rank retains the Adam state of its shard only
    full, half = (
        _state_counts(runs["ddp", "1.0"][0].stdout),
        _state_counts(runs["distopt", "1.0"][0].stdout),
    )
    (total,) = {m for _, m in full.values()}
    assert all(n == total for n, _ in full.values())
    assert set(half) == {0, 1} and sum(n for n, _ in half.values()) == total
    assert all(abs(n - total / 2) <= 0.02 * total for n, _ in half.values()), half
    assert "distributed optimizer" in runs["distopt", "1.0"][0].stdout


FAULTS = [
    FaultSpec(rank=1, step=3, phase="forward"),
    FaultSpec(rank=0, step=6, phase="backward", erase_device_pages=16, erase_host_pages=1),
    FaultSpec(rank=1, step=9, phase="update", point="optimizer", chunk=2, erase_device_pages=16),
    FaultSpec(
        rank=0,
        step=12,
        phase="update",
        point="gather",
        erase_device_pages=1,
        erase_device_region="ddp.params.float32",
    ),
    FaultSpec(
        rank=1,
        step=15,
        phase="update",
        point="optimizer",
        chunk=1,
        erase_device_pages=12,
        erase_device_region="ddp.grads.float32",
    ),
]
STEPS = 18


@pytest.mark.timeout(400)
def test_megatron_distopt_recovery_is_bit_exact(tmp_path):
    _, clean_events = JOBS.run(tmp_path, nproc=2, steps=STEPS, script_args=DISTOPT)
    clean = digests(clean_events)
    assert set(clean) == {(r, s) for r in range(2) for s in range(1, STEPS + 1)}
    assert all(len(d) == 1 for d in clean.values())
    proc, events = JOBS.run(
        tmp_path, nproc=2, steps=STEPS, script_args=DISTOPT, faults=FAULTS, timeout_s=300
    )
    # forward/backward kills re-run their step; kills inside the update finish it; a kill in
    # the all-gather leaves every rank committed, the gather at resume completes it
    assert_recovered(
        clean,
        events,
        FAULTS,
        nproc=2,
        resumed_at=[3, 6, 10, 13, 16],
        fields=("rank", "step", "point"),
    )
    erased = {e["region"] for e in events if e["kind"] == Kind.PAGES_ERASED}
    assert {"state", "state.p1", "ddp.params.float32", "ddp.grads.float32"} <= erased
    rebuilt = [
        e
        for e in events
        if e["kind"] == Kind.PAGES_REBUILT
        and e["rank"] == 1
        and e["lost"].get("ddp.grads.float32", {}).get("data")
    ]
    assert rebuilt and rebuilt[-1]["phase"] == "CHUNK_SAVED", (
        "the lost gradient pages were not rebuilt"
    )
    # a digest is 32 hex digits: another process's output may follow it on the same line
    finals = re.findall(r"rank (\d) parameters ([0-9a-f]{32})", proc.stdout)
    assert len({d for _, d in finals}) == 1 and len(finals) == 2, (
        "the ranks' all-gathered parameters differ"
    )


@pytest.mark.timeout(120)
def test_bad_input_is_a_one_line_error(tmp_path):
    proc = subprocess.run(
        [sys.executable, SCRIPT, *TINY_GPT, "--ddp-impl", "leto", "--use-distributed-optimizer"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        (
            "megatron_gpt: --use-distributed-optimizer needs --ddp-impl megatron (got --ddp-impl leto): "
            "the shards are Megatron DDP's buckets"
        )
    ]
    proc, _ = run_leto(
        tmp_path,
        steps=2,
        nproc=2,
        **JOBS.job(script_args=DISTOPT, leto={"consistency": "snapshot"}, timeout_s=100),
    )
    assert proc.returncode != 0
    assert (
        "megatron_gpt: --use-distributed-optimizer needs leto consistency: rmu (got snapshot)"
        in proc.stderr
    )


# -- with tensor parallelism (slow: 4 ranks and their shadows on the CI's cores) -------------
TP2 = ["--tensor-model-parallel-size", "2"]
CLIP = ["--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "0.05", "--lr", "1e-2"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tp2_dp2_distopt_matches_and_recovers(tmp_path):
    """TP=2 x DP=2: each TP rank's shard is split over its DP group. A clip that bites every
    step catches a wrong norm (a TP-duplicated norm counted twice, a rank's squares missing):
    losses equal the non-distributed TP=2 x DP=2 run's to float rounding. Then kills in
    backward, mid-update and in the all-gather: digests equal the fault-free run's."""
    plain = {"consistency": "rmu"}
    proc, sharded = JOBS.run(
        tmp_path, nproc=4, steps=6, script_args=[*DISTOPT, *CLIP, *TP2], leto=plain, timeout_s=400
    )
    assert "(TP 2, DP 2)" in proc.stdout and "distributed optimizer" in proc.stdout
    _, full = JOBS.run(
        tmp_path, nproc=4, steps=6, script_args=[*DDP, *CLIP, *TP2], leto=plain, timeout_s=400
    )
    for rank in range(4):
        want, got = JOBS.losses(full, rank), JOBS.losses(sharded, rank)
        assert len(want) == len(got) == 6
        assert got == pytest.approx(want, rel=1e-5, abs=0), (
            f"rank {rank}: distributed {got} != {want}"
        )
    counts = _state_counts(proc.stdout)
    for tp_rank in range(
        2
    ):  # ranks (0, 2) and (1, 3) are the DP groups of TP ranks 0 and 1 (Megatron's order)
        (total,) = {counts[r][1] for r in (tp_rank, tp_rank + 2)}
        assert counts[tp_rank][0] + counts[tp_rank + 2][0] == total
    faults = [
        FaultSpec(rank=3, step=2, phase="backward", erase_device_pages=8),
        FaultSpec(rank=2, step=4, phase="update", point="optimizer", chunk=1, erase_device_pages=8),
        FaultSpec(rank=1, step=6, phase="update", point="gather"),
    ]
    _, clean_events = JOBS.run(
        tmp_path, nproc=4, steps=8, script_args=[*DISTOPT, *TP2], timeout_s=400
    )
    _, events = JOBS.run(
        tmp_path, nproc=4, steps=8, script_args=[*DISTOPT, *TP2], faults=faults, timeout_s=500
    )
    assert sorted({e["step"] for e in events if e["kind"] == Kind.RESUMED}) == [2, 5, 7]
    clean, faulty = digests(clean_events), digests(events)
    assert set(faulty) == set(clean)
    for key, want in clean.items():
        assert faulty[key] == want, f"rank {key[0]} step {key[1]}: {faulty[key]} != {want}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_distopt_fused_rmu_recovery_is_bit_exact(tmp_path, monkeypatch):
    """The GPU's default update path, the fused Triton RMU kernel (interpreted here), over
    the shards: a mid-chunk kill with lost pages and a kill in the all-gather recover exactly."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the trainers inherit it
    leto = {**LETO, "rmu_fused": True}
    faults = [
        FaultSpec(
            rank=1, step=3, phase="update", point="optimizer", chunk=2, erase_device_pages=16
        ),
        FaultSpec(rank=0, step=6, phase="update", point="gather"),
    ]
    _, clean_events = JOBS.run(
        tmp_path, nproc=2, steps=8, script_args=DISTOPT, leto=leto, timeout_s=600
    )
    _, events = JOBS.run(
        tmp_path, nproc=2, steps=8, script_args=DISTOPT, leto=leto, faults=faults, timeout_s=600
    )
    assert [e["point"] for e in events if e["kind"] == Kind.FAULT_INJECTED] == [
        "optimizer",
        "gather",
    ]
    assert sorted({e["step"] for e in events if e["kind"] == Kind.RESUMED}) == [4, 7]
    assert digests(events) == digests(clean_events)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dp4_distopt_quarter_state_and_recovers(tmp_path):
    """DP=4: each rank retains a quarter of the Adam state; kills mid-update (lost pages)
    and in the all-gather recover exactly."""
    faults = [
        FaultSpec(
            rank=2, step=2, phase="update", point="optimizer", chunk=1, erase_device_pages=16
        ),
        FaultSpec(rank=3, step=4, phase="update", point="gather"),
    ]
    proc, clean_events = JOBS.run(tmp_path, nproc=4, steps=6, script_args=DISTOPT, timeout_s=400)
    counts = _state_counts(proc.stdout)
    (total,) = {m for _, m in counts.values()}
    assert set(counts) == {0, 1, 2, 3} and sum(n for n, _ in counts.values()) == total
    assert all(abs(n - total / 4) <= 0.05 * total for n, _ in counts.values()), counts
    _, events = JOBS.run(
        tmp_path, nproc=4, steps=6, script_args=DISTOPT, faults=faults, timeout_s=500
    )
    assert sorted({e["step"] for e in events if e["kind"] == Kind.RESUMED}) == [3, 5]
    assert digests(events) == digests(clean_events)
