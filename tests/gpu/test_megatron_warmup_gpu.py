"""The shadow's model warm-up (``lm.warm_up_shadow``) on one GPU: exact, compiled ahead, in budget.

examples/megatron_gpt.py with Megatron's ``jit_fuser`` fusions on (``--fusions``: bias-GeLU
and bias-dropout-add compiled by ``torch.compile`` into Triton kernels), world size 1, NCCL,
bf16 compute. Kills in backward and mid-chunk inside the update, each with a ready shadow
(``shadow_ready_steps_before=1``). Checked: every (rank, step) digest equals the fault-free
run's (which compiles the same fusions in its actives); every promoted shadow warmed up at
L3 and compiled the fusions there, its device peak measured and within ``lm.warmup_bytes``'s
estimate; the promoted first iterations compile nothing.

The same test on CPU is tests/integrations/test_megatron_warmup.py. megatron-core is not on
the GPU image; docs/MEGATRON.md says how the carried wheel is installed.
"""

from __future__ import annotations

import re

import pytest
import torch

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import REPO, assert_exact, fault_free_run, run_leto

pytest.importorskip(
    "megatron.core",
    reason="megatron-core is not importable: install the carried wheel (docs/MEGATRON.md)",
)

SCRIPT = str(REPO / "examples" / "megatron_gpt.py")
STEPS = 16
MODEL = [
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
    "--bf16",
    "--fusions",
]
LETO = {"consistency": "rmu", "rmu_chunk_bytes": 65536}
FAULTS = [
    FaultSpec(rank=0, step=5, phase="backward", shadow_ready_steps_before=1),
    FaultSpec(
        rank=0, step=11, phase="update", point="optimizer", chunk=1, shadow_ready_steps_before=1
    ),
]
FIRST = re.compile(
    r"rank (\d) promoted, first iteration \(step (\d+)\).*torch\.compile graphs compiled (\d+)"
)


@pytest.mark.timeout(900)
def test_megatron_gpu_warmed_shadows_recover_exactly(tmp_path):
    common = {
        "leto": LETO,
        "script": SCRIPT,
        "steps_flag": "--train-iters",
        "model_args": MODEL,
        "timeout_s": 400,
    }
    reference, _ = fault_free_run(tmp_path, steps=STEPS, nproc=1, **common)
    proc, events = run_leto(tmp_path, steps=STEPS, nproc=1, faults=FAULTS, **common)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [(e["rank"], e["step"]) for e in events if e["kind"] == Kind.FAULT_INJECTED] == [
        (0, 5),
        (0, 11),
    ]
    assert_exact(reference, events)

    warmed = {e["gen"]: e for e in events if e["kind"] == Kind.MODEL_WARMED}
    for gen in (1, 2):  # the promoted generations
        event = warmed[gen]
        assert event["ran"] and event["level"] == 3 and event["compiled_graphs"] > 0, event
        if torch.cuda.is_available():  # the CPU has no allocator peak to measure
            assert 0 < event["peak_bytes"] <= event["transient_bytes"], (
                f"the estimate must cover the peak: {event}"
            )
    firsts = [tuple(int(g) for g in m.groups()) for m in FIRST.finditer(proc.stdout + proc.stderr)]
    assert sorted((rank, step) for rank, step, _ in firsts) == [(0, 5), (0, 12)]
    assert all(compiled == 0 for *_, compiled in firsts), firsts
