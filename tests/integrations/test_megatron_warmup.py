"""Shadows warm Megatron's first iteration (``lm.warm_up_shadow``): real leto-run jobs, CPU.

examples/megatron_gpt.py with Megatron's ``jit_fuser`` fusions on (bias-GeLU and
bias-dropout-add, compiled by ``torch.compile`` per process), 2 ranks, gloo, shadows at L3,
gradients in Leto's "grads" region with its flat all-reduce (``--ddp-impl leto``: the
Megatron recovery test with that path).
Each kill waits for a ready shadow the step before (``shadow_ready_steps_before=1``), so
every promoted trainer comes from a shadow that ran the warm-up. Checked: each such shadow reports the warm-up (``model_warmed``,
ran, fusion graphs compiled there); each promoted trainer's first iteration compiles nothing;
every (rank, step) digest equals the fault-free run's. A control run without the warm-up
shows that its promoted trainer compiles the fusions in its first iteration instead. The
level and memory rules are tests/preinit/test_model_warmup.py.
"""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.integrations.megatron_jobs import TINY_GPT
from tests.launcher.harness import REPO, assert_exact, fault_free_run, run_leto

pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'"
)

SCRIPT = str(REPO / "examples" / "megatron_gpt.py")
STEPS = 20
MODEL = [
    *TINY_GPT,
    "--fusions",
    "--ddp-impl",
    "leto",
]  # the other Megatron jobs run Megatron's DDP; this one keeps Leto's all-reduce
LETO = {"consistency": "rmu", "rmu_chunk_bytes": 65536}
FAULTS = [
    FaultSpec(rank=1, step=6, phase="backward", shadow_ready_steps_before=1),
    FaultSpec(
        rank=0, step=13, phase="update", point="optimizer", chunk=1, shadow_ready_steps_before=1
    ),
]


def _run(tmp_path, faults, *script_args):
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        faults=faults,
        leto=LETO,
        script=SCRIPT,
        steps_flag="--train-iters",
        model_args=MODEL,
        script_args=list(script_args),
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    firsts = [
        (e["rank"], e["step"], e["compiled_graphs"])
        for e in events
        if e["kind"] == Kind.FIRST_ITERATION
    ]
    return events, firsts


@pytest.mark.slow  # CI runs tests/preinit/test_model_warmup.py
@pytest.mark.timeout(700)
def test_warmed_shadows_recover_exactly_without_compiling(tmp_path):
    reference, _ = fault_free_run(
        tmp_path,
        steps=STEPS,
        leto=LETO,
        script=SCRIPT,
        steps_flag="--train-iters",
        model_args=MODEL,
        timeout_s=240,
    )
    events, firsts = _run(tmp_path, FAULTS)
    assert [(e["rank"], e["step"]) for e in events if e["kind"] == Kind.FAULT_INJECTED] == [
        (1, 6),
        (0, 13),
    ]
    assert_exact(reference, events)

    promoted = {(e["rank"], e["gen"]) for e in events if e["kind"] == Kind.PROMOTED}
    assert promoted == {(r, g) for r in range(2) for g in (1, 2)}
    warmed = {(e["rank"], e["gen"]): e for e in events if e["kind"] == Kind.MODEL_WARMED}
    ready = {(e["rank"], e["gen"]): e["t"] for e in events if e["kind"] == Kind.SHADOW_READY}
    for key in promoted:
        event = warmed[key]
        assert event["ran"] and event["level"] == 3 and event["reason"] == "ok", event
        assert event["compiled_graphs"] > 0, "the shadow compiled Megatron's fusions"
        assert event["t"] < ready[key], "the warm-up ran before the shadow was ready"
    # each promoted trainer's first iteration (an event: the log line of the same report was
    # once lost in torch elastic's log tailing): the same specialisations, already compiled
    assert sorted((rank, step) for rank, step, _ in firsts) == [(0, 6), (0, 14), (1, 6), (1, 14)], (
        firsts
    )
    assert all(compiled == 0 for *_, compiled in firsts), firsts


@pytest.mark.slow  # CI runs tests/preinit/test_model_warmup.py
@pytest.mark.timeout(400)
def test_without_the_warm_up_the_promoted_trainer_compiles(tmp_path):
    events, firsts = _run(tmp_path, FAULTS[:1], "--no-shadow-warm-up")
    assert not [e for e in events if e["kind"] == Kind.MODEL_WARMED]
    assert sorted((rank, step) for rank, step, _ in firsts) == [(0, 6), (1, 6)], firsts
    assert all(compiled > 0 for *_, compiled in firsts), firsts
