"""Megatron-Core GPTModel on one GPU under leto-run: exact in-place recovery (issue 6).

examples/megatron_gpt.py runs Megatron natively on CUDA here (no shims): its GPU
initialisation path, the real ``CudaRNGStatesTracker`` (attention dropout under
``fork()``, reseeded per step by ``MegatronState``), retained state in CUDA VMM regions,
``consistency: rmu``. Each case runs a fault-free job and one whose trainers are SIGKILLed
in forward, in backward and mid-chunk inside the optimizer update; every (rank, step)
digest of the retained state must equal the fault-free run's.

Data parallelism is Megatron-Core's ``DistributedDataParallel`` (the example's default,
``--ddp-impl megatron``): its contiguous gradient buffer is a retained CUDA VMM region
("ddp.grads.float32") and its bucketed all-reduce (``finish_grad_sync``) runs on NCCL, on
gloo where two ranks share the GPU. The DP=2 case on two GPUs overlaps the bucket
all-reduces with backward (``--overlap-grad-reduce``, small buckets): its backward kill
lands with NCCL bucket all-reduces in flight. The "-leto-ddp" case keeps Leto's flat
"grads" region and all-reduce (``--ddp-impl leto``).

* world size 1, NCCL, bf16 compute (autocast) over fp32 params and Adam state;
* two ranks sharing the GPU, gloo (NCCL refuses two ranks on one device), fp32 (on a
  machine with two GPUs leto-run gives each rank its own and picks NCCL: DP=2). Every
  collective this layout issues runs on gloo with CUDA tensors: Leto's flat gradient
  all-reduce and Megatron's cross-entropy all-reduces (TP group of one). What would not:
  gloo has no CUDA reduce-scatter / all-gather (on CPU tensors it has: the CPU tests run
  the distributed optimizer there), so Megatron's DistributedOptimizer on the GPU and
  sequence parallelism need NCCL (one GPU per rank);
* world size 1, NCCL, bf16, with two-tier parity on 2 MiB pages (one CUDA VMM chunk
  each): the backward and the update kills also lose 16 device pages of the model state
  (found by the page-map query, rebuilt from host parity, or from the RMU's working
  parity mid-update) and a host tier-1 parity page per group; a fourth kill mid-update
  loses 8 pages of DDP's gradient buffer, which finishing the update needs (rebuilt from
  its parity);
* tensor parallelism, TP=2 on two GPUs (one rank each), NCCL, bf16: each rank retains its
  shard, Megatron's TP all-reduces run on NCCL groups that the L3 shadows build before
  promotion, gradients are averaged over the data-parallel group (of one) and clipped by
  the TP-aware global norm. Needs 2 GPUs (``nvidia-h200-x2``); skips with fewer;
* pipeline parallelism, PP=2 on two GPUs (one stage each), NCCL, bf16: Megatron's 1F1B
  schedule over 4 micro-batches with its batched NCCL p2p sends, the word embedding tied
  to the output layer (a copy per stage, gradients summed over the embedding group by
  ``finalize_model_grads``; the example reports a digest of each copy, which must agree),
  each stage retaining its own parameters and Adam state; the forward kill is on the
  first stage, the backward kill on the last. Needs 2 GPUs; skips with fewer;
* expert parallelism, EP=2 on two GPUs (one rank each), NCCL, bf16: Megatron's local MoE
  layer (4 experts, top-2, aux loss, no linear biases), the all-to-all token dispatcher on
  NCCL (``all_to_all_single`` with per-rank splits), each rank retaining 2 experts whose
  gradients are Megatron DDP's expert buffer ("ddp.grads.expert.float32", reduced over the
  expert-data-parallel group), the dense part data-parallel over both GPUs; the forward kill
  leaves the other rank in the dispatcher's all-to-all. Needs 2 GPUs; skips with fewer;
* Megatron's distributed optimizer (``--use-distributed-optimizer``), NCCL, bf16: world
  size 1 (DP=1: one shard, the whole buffer; Megatron's reduce-scatter and all-gather over
  a group of one, ``param_data`` a retained CUDA VMM region), and DP=2 on two GPUs with
  overlapped NCCL reduce-scatters (each rank retains and updates half of the main params
  and Adam state; the updated shards all-gathered over NCCL). Besides the three kills, a
  fourth lands inside the parameter all-gather (``param_data`` scribbled): the gather every
  rank runs at resume completes it. The digests cover the shard state and ``param_data``.

megatron-core is not on the GPU image; docs/MEGATRON.md says how the carried wheel is
installed. Without it these tests skip, saying so.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import REPO, assert_recovered, digests, run_leto

pytest.importorskip(
    "megatron.core",
    reason="megatron-core is not importable: install the carried wheel first "
    "(python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl; docs/MEGATRON.md)",
)

SCRIPT = str(REPO / "examples" / "megatron_gpt.py")
STEPS = 16
TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--micro-batch-size",
    "4",
    "--vocab-size",
    "512",
    "--lr",
    "1e-3",
    "--seed",
    "11",
]
# ~5.3 M parameters: 64 MiB of fp32 params + Adam state = one group of D=32 two-MiB pages.
SMALL = [
    "--num-layers",
    "4",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "8",
    "--seq-length",
    "128",
    "--micro-batch-size",
    "4",
    "--vocab-size",
    "4096",
    "--lr",
    "1e-3",
    "--seed",
    "11",
]
RMU = {
    "consistency": "rmu",
    "rmu_chunk_bytes": 65536,
}  # about ten chunks of TINY: chunk 1 is mid-update
PARITY = {
    "consistency": "rmu",
    "rmu_chunk_bytes": 1 << 20,
    "erasure": {"page_bytes": 2 << 20, "data_pages": 32, "tier1_parity": 16, "tier2_parity": 1},
}


OVERLAP = [
    "--overlap-grad-reduce",
    "--ddp-bucket-size",
    "20000",
]  # TINY (~0.2 M parameters): ~10 buckets


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    nproc: int
    model: list[str]
    leto: dict
    bf16: bool
    lost_device_pages: int = 0
    """Model-state pages lost at the backward and at the update kill (per group)."""
    tp: int = 1
    """--tensor-model-parallel-size."""
    pp: int = 1
    """--pipeline-model-parallel-size (> 1: 4 micro-batches, tied embedding)."""
    gpus: int = 1
    """GPUs the case needs (one rank per GPU for NCCL)."""
    ddp: list[str] = dataclasses.field(default_factory=list)
    """Data-parallel flags: [] is Megatron's DDP (the example's default)."""
    lost_grad_pages: int = 0
    """Pages of Megatron DDP's gradient buffer lost at a fourth kill, mid-update."""
    ep: int = 0
    """> 0: a MoE model (4 experts, top-2) with --expert-model-parallel-size ep."""
    distopt: bool = False
    """Megatron's distributed optimizer (``ddp`` carries the flag); a fourth kill in the all-gather."""

    def backend(self) -> str:
        """What leto-run's ``backend="auto"`` picks: NCCL when every rank has a GPU of its own."""
        return "nccl" if self.nproc <= torch.cuda.device_count() else "gloo"


CASES = {
    "nccl-1rank-bf16": Case(1, TINY, RMU, bf16=True),
    "gloo-2ranks-fp32": Case(2, TINY, RMU, bf16=False),
    "nccl-1rank-bf16-parity": Case(
        1, SMALL, PARITY, bf16=True, lost_device_pages=16, lost_grad_pages=8
    ),
    "nccl-tp2-2gpus-bf16": Case(2, TINY, RMU, bf16=True, tp=2, gpus=2),
    "nccl-pp2-2gpus-bf16": Case(2, TINY, RMU, bf16=True, pp=2, gpus=2),
    "nccl-ep2-2gpus-bf16": Case(2, TINY, RMU, bf16=True, gpus=2, ep=2),
    "nccl-dp2-2gpus-bf16": Case(2, TINY, RMU, bf16=True, gpus=2, ddp=OVERLAP),
    "nccl-dp2-2gpus-bf16-leto-ddp": Case(
        2, TINY, RMU, bf16=True, gpus=2, ddp=["--ddp-impl", "leto"]
    ),
    "nccl-1rank-bf16-distopt": Case(
        1, TINY, RMU, bf16=True, ddp=["--use-distributed-optimizer"], distopt=True
    ),
    "nccl-dp2-2gpus-bf16-distopt": Case(
        2, TINY, RMU, bf16=True, gpus=2, ddp=[*OVERLAP, "--use-distributed-optimizer"], distopt=True
    ),
}


def _faults(case: Case) -> list[FaultSpec]:
    lost, host = case.lost_device_pages, int(case.lost_device_pages > 0)
    faults = [
        FaultSpec(rank=0, step=3, phase="forward"),
        FaultSpec(
            rank=case.nproc - 1,
            step=7,
            phase="backward",
            erase_device_pages=lost,
            erase_host_pages=host,
        ),
        FaultSpec(
            rank=0,
            step=11,
            phase="update",
            point="optimizer",
            chunk=1,
            erase_device_pages=lost,
            erase_host_pages=host,
        ),
    ]
    if case.lost_grad_pages:
        faults.append(
            FaultSpec(
                rank=0,
                step=14,
                phase="update",
                point="optimizer",
                chunk=0,
                erase_device_pages=case.lost_grad_pages,
                erase_device_region=GRAD_REGION,
            )
        )
    if case.distopt:  # inside the all-gather of the updated shards (after its first bucket group)
        faults.append(FaultSpec(rank=case.nproc - 1, step=14, phase="update", point="gather"))
    return faults


GRAD_REGION = "ddp.grads.float32"
"""Megatron DDP's gradient buffer of fp32 params (``leto.integrations.megatron_ddp.region_name``)."""


MICROBATCHES = 4
"""Micro-batches per iteration of a PP case (--global-batch-size = 4 x TINY's micro-batch of 4)."""


def _pipeline_args(case: Case) -> list[str]:
    if case.pp == 1:
        return []
    return [
        "--pipeline-model-parallel-size",
        str(case.pp),
        "--global-batch-size",
        str(MICROBATCHES * 4),
        "--share-embeddings-and-output-weights",
    ]


def _moe_args(case: Case) -> list[str]:
    if not case.ep:
        return []
    return [
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
        "--expert-model-parallel-size",
        str(case.ep),
    ]


def _run(tmp_path, case: Case, faults: list[FaultSpec]):
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        nproc=case.nproc,
        faults=faults,
        leto=case.leto,
        script=SCRIPT,
        steps_flag="--train-iters",
        model_args=case.model,
        script_args=["--bf16"] * case.bf16
        + [
            "--tensor-model-parallel-size",
            str(case.tp),
            *_pipeline_args(case),
            *_moe_args(case),
            *case.ddp,
        ],
        timeout_s=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, events


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CASES))
def test_megatron_gpu_recovery_is_bit_exact(tmp_path, name: str) -> None:
    case = CASES[name]
    if torch.cuda.device_count() < case.gpus:
        pytest.skip(
            f"needs {case.gpus} GPUs (one rank each), found {torch.cuda.device_count()}: "
            "run on nvidia-h200-x2"
        )
    ref_proc, ref_events = _run(tmp_path, case, [])
    output = ref_proc.stdout + ref_proc.stderr
    assert f"backend {case.backend()}" in output, "the run did not use the expected backend"
    stages = f", PP {case.pp}" if case.pp > 1 else ""
    experts = f", EP {case.ep}" if case.ep else ""
    assert f"(TP {case.tp}{stages}{experts}, DP {case.nproc // (case.tp * case.pp)})" in output, (
        "the run did not use the expected TP/PP/EP sizes"
    )
    if case.ep:
        held = re.findall(
            r"megatron_gpt: rank (\d+) experts \[([\d, ]+)\], gradient regions (\[.*\])", output
        )
        assert sorted(held) == [
            ("0", "0, 1", "['ddp.grads.float32', 'ddp.grads.expert.float32']"),
            ("1", "2, 3", "['ddp.grads.float32', 'ddp.grads.expert.float32']"),
        ], held
    if case.pp > 1:
        tied = re.findall(r"megatron_gpt: rank (\d+) tied embedding ([0-9a-f]+)", ref_proc.stdout)
        assert len(tied) == 2 and tied[0][1] == tied[1][1], (
            f"the stages' tied embedding copies diverged: {tied}"
        )
    impl = (
        "leto"
        if "leto" in case.ddp
        else "megatron (overlap)"
        if OVERLAP == case.ddp
        else "megatron"
    )
    assert f"DDP {impl}" in output, "the run did not use the expected data-parallel implementation"
    if case.distopt:
        assert "distributed optimizer" in output, (
            "the run did not use Megatron's distributed optimizer"
        )
        held = [int(n) for n, _ in re.findall(r"rank \d+ optimizer state (\d+) of (\d+)", output)]
        (total,) = {
            int(m) for _, m in re.findall(r"rank \d+ optimizer state (\d+) of (\d+)", output)
        }
        assert len(held) == case.nproc and sum(held) == total, (held, total)
    reference = digests(ref_events)
    assert set(reference) == {(r, s) for r in range(case.nproc) for s in range(1, STEPS + 1)}
    assert all(len(d) == 1 for d in reference.values())

    faults = _faults(case)
    _, events = _run(tmp_path, case, faults)
    assert len([e for e in events if e["kind"] == Kind.SHADOWS_PROMOTED]) == len(faults)
    # forward/backward kills re-run their step; a kill inside the update finishes it
    assert_recovered(
        reference,
        events,
        faults,
        nproc=case.nproc,
        resumed_at=[3, 7, 12] + [15] * bool(case.lost_grad_pages or case.distopt),
    )
    if (
        case.lost_grad_pages
    ):  # recovery 4 found the erased gradient pages and rebuilt them (needed mid-update)
        erased = [
            e for e in events if e["kind"] == Kind.PAGES_ERASED and e["region"] == GRAD_REGION
        ]
        rebuilt = [
            e["lost"][GRAD_REGION]
            for e in events
            if e["kind"] == Kind.PAGES_REBUILT and e["gen"] == 4
        ]
        assert len(erased) == 1 and erased[0]["pages"], erased
        assert [x["data"] for x in rebuilt] == [len(erased[0]["pages"])], rebuilt
    if case.lost_device_pages:  # recoveries 2 and 3 found every erased device page and rebuilt it
        erased = [e for e in events if e["kind"] == Kind.PAGES_ERASED and e["region"] == "state"]
        rebuilt = {
            (e["rank"], e["gen"]): e["lost"]["state"]
            for e in events
            if e["kind"] == Kind.PAGES_REBUILT
        }
        assert [len(e["pages"]) for e in erased] == [case.lost_device_pages] * 2, erased
        lost = [rebuilt[(faults[1].rank, 2)], rebuilt[(faults[2].rank, 3)]]
        assert [x["data"] for x in lost] == [case.lost_device_pages] * 2, rebuilt
        assert lost[0]["tier1"] >= 1, rebuilt
