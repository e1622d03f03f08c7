"""Megatron shadows below level 3 (2 ranks, gloo, CPU): exact in-place recovery.

A Megatron shadow at level 1 or 2 has no process group before promotion, and Megatron
builds its model from its groups: ``lm.init_parallel`` waits for promotion, then builds
Megatron's ``parallel_state``, the model (on ``meta``) and the optimizer. Real jobs
(examples/megatron_gpt.py with the CPU ``torch.cuda`` shims, shadows, the state manager,
``consistency: rmu``): kills in forward, backward and mid-chunk in the optimizer update,
each after a ready shadow (``shadow_ready_steps_before=1``: the shadow announced itself
from ``init_parallel``), are recovered in place by shadows of the configured level; and
the pre-initialisation controller's path: an injected OOM reclaims the L3 shadows, they are
relaunched one level lower (no memory reports on CPU) and the next kill is recovered by
them. Every (rank, step) digest must equal the fault-free run's.
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
STEPS = 16
LETO = {"consistency": "rmu", "rmu_chunk_bytes": 65536}
KILLS = [
    FaultSpec(rank=1, step=4, phase="forward", shadow_ready_steps_before=1),
    FaultSpec(rank=0, step=8, phase="backward", shadow_ready_steps_before=1),
    FaultSpec(
        rank=1, step=12, phase="update", point="optimizer", chunk=1, shadow_ready_steps_before=1
    ),
]


def _run(tmp_path, faults, **leto):
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        faults=faults,
        leto={**LETO, **leto},
        script=SCRIPT,
        steps_flag="--train-iters",
        model_args=TINY_GPT,
        timeout_s=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not [e for e in events if e["kind"] == Kind.GROUP_RESTART]
    return events


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free_run(
        tmp_path_factory.mktemp("ref"),
        steps=STEPS,
        leto=LETO,
        script=SCRIPT,
        steps_flag="--train-iters",
        model_args=TINY_GPT,
        timeout_s=240,
    )[0]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "level", [1, pytest.param(2, marks=pytest.mark.slow)]
)  # CI: L1, and L2 via the reclaim
def test_low_level_shadows_recover_exactly(tmp_path, reference, level):
    events = _run(tmp_path, KILLS, shadow_level=level)
    injected = [(e["rank"], e["step"]) for e in events if e["kind"] == Kind.FAULT_INJECTED]
    assert injected == [(f.rank, f.step) for f in KILLS]
    # forward/backward kills re-run their step; a kill inside the update finishes it
    assert sorted({e["step"] for e in events if e["kind"] == Kind.RESUMED}) == [4, 8, 13]
    promoted = [(e["rank"], e["gen"], e["level"]) for e in events if e["kind"] == Kind.PROMOTED]
    assert sorted(promoted) == [(r, g, level) for r in range(2) for g in (1, 2, 3)]
    assert_exact(reference, events)


@pytest.mark.timeout(600)
def test_reclaimed_l3_shadows_relaunch_lower_and_promote(tmp_path, reference):
    faults = [
        FaultSpec(rank=0, step=4, phase="forward", kind="oom", shadow_ready_steps_before=1),
        FaultSpec(rank=1, step=9, phase="backward", shadow_ready_steps_before=1),
    ]
    events = _run(tmp_path, faults)
    injected = [
        (e["rank"], e["step"], e["fault_kind"]) for e in events if e["kind"] == Kind.FAULT_INJECTED
    ]
    assert injected == [(f.rank, f.step, f.kind) for f in faults]
    reclaimed = [(e["ranks"], e["level"]) for e in events if e["kind"] == Kind.SHADOW_RECLAIMED]
    assert reclaimed == [([0], 3)]
    assert [(e["rank"], e["step"]) for e in events if e["kind"] == Kind.OOM_RETRY] == [(0, 4)]
    levels = [(e["reason"], e["level"]) for e in events if e["kind"] == Kind.SHADOW_LEVEL]
    assert levels == [("configured", 3), ("oom", 2), ("recovery", 3)]
    # the kill was recovered in place by the relaunched L2 shadows
    assert [(e["rank"], e["level"]) for e in events if e["kind"] == Kind.PROMOTED] in (
        [(0, 2), (1, 2)],
        [(1, 2), (0, 2)],
    )
    assert_exact(reference, events)
