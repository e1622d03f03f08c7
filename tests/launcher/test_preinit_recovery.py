"""The pre-initialisation controller end to end (paper §6), on CPU with real processes.

Real leto-run jobs (2 ranks, gloo, shadows, state manager). An injected ``oom`` fault
raises a real ``torch.OutOfMemoryError`` in an active's forward or backward, only while
the node has shadows, as if their footprint made the allocation fail; the CPU device is
emulated (``leto.preinit.emulated_device_bytes``) so the fault's ``oom_bytes`` is a real
peak in the trainer's memory report. Each OOM must be absorbed: shadows reclaimed, the
step retried in place, shadows relaunched at the highest level that fits the retried
step's peak; a later SIGKILL is then recovered in place from those lower-level shadows,
after which the fresh actives' peak raises the level again. Every (rank, step) digest
must equal the fault-free run's.
"""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import assert_exact, fault_free_run, run_leto

STEPS = 24
GIB = 1 << 30
# Each rank's emulated device: 10 GiB, 4 GiB of it the trainer's. L3 needs 1.5 GiB + a
# 0.25 GiB margin, L2 0.75 + 0.25 GiB (PreinitConfig's defaults).
LETO = {"preinit": {"emulated_device_bytes": 10 * GIB, "emulated_trainer_bytes": 4 * GIB}}
# Each fault waits (a step ahead) for its rank's shadow to be ready: an OOM only happens while
# the shadows hold memory, and a kill is meant for the level-lowered shadows, however slowly
# a loaded machine starts them.
FAULTS = [
    FaultSpec(
        rank=1,
        step=4,
        phase="backward",
        kind="oom",
        oom_bytes=GIB * 9 // 2,  # 1.5 GiB left: L2
        shadow_ready_steps_before=1,
    ),
    FaultSpec(
        rank=0, step=9, phase="forward", shadow_ready_steps_before=1
    ),  # recovered from the L2 shadows
    FaultSpec(
        rank=0,
        step=14,
        phase="forward",
        kind="oom",
        oom_bytes=GIB * 11 // 2,  # 0.5 GiB left: L1
        shadow_ready_steps_before=1,
    ),
    FaultSpec(
        rank=1, step=19, phase="backward", shadow_ready_steps_before=1
    ),  # recovered from the L1 shadows
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    ref, events = fault_free_run(tmp_path_factory.mktemp("ref"), steps=STEPS, leto=LETO)
    assert not [e for e in events if e["kind"] in (Kind.OOM_RETRY, Kind.SHADOW_RECLAIMED)]
    return ref


@pytest.mark.timeout(600)
def test_oom_reclaims_shadows_and_kills_recover_from_lower_levels(tmp_path, reference) -> None:
    proc, events = run_leto(tmp_path, steps=STEPS, faults=FAULTS, leto=LETO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    injected = [
        (e["rank"], e["step"], e["fault_kind"]) for e in events if e["kind"] == Kind.FAULT_INJECTED
    ]
    assert injected == [(f.rank, f.step, f.kind) for f in FAULTS]
    # Both OOMs were absorbed: shadows reclaimed, the step retried, nothing restarted.
    reclaimed = [e for e in events if e["kind"] == Kind.SHADOW_RECLAIMED]
    assert [(e["ranks"], e["level"]) for e in reclaimed] == [([1], 3), ([0], 3)]
    retries = [
        (e["rank"], e["step"], e["reclaimed_level"]) for e in events if e["kind"] == Kind.OOM_RETRY
    ]
    assert retries == [(1, 4, 3), (0, 14, 3)]
    assert not [e for e in events if e["kind"] == Kind.GROUP_RESTART]
    # Levels: configured, lowered by each OOM from the retried step's peak; after each
    # recovery the replacements start at the level the old actives' peak allowed, then are
    # raised once the fresh actives report their (lower) peak.
    levels = [(e["reason"], e["level"]) for e in events if e["kind"] == Kind.SHADOW_LEVEL]
    assert levels == [
        ("configured", 3),
        ("oom", 2),
        ("recovery", 2),
        ("recovery", 3),
        ("oom", 1),
        ("recovery", 1),
        ("recovery", 3),
    ]
    oom_choices = [e for e in events if e["kind"] == Kind.SHADOW_LEVEL and e["reason"] == "oom"]
    assert [e["peak_bytes"] for e in oom_choices] == [GIB * 17 // 2, GIB * 19 // 2]
    # The kills were recovered in place, by shadows of the lowered levels.
    promoted = [e["level"] for e in events if e["kind"] == Kind.PROMOTED]
    assert promoted == [2, 2, 1, 1]
    assert len([e for e in events if e["kind"] == Kind.SHADOWS_PROMOTED]) == 2


@pytest.mark.timeout(600)
def test_oom_without_memory_reports_steps_the_level_down(tmp_path, reference) -> None:
    """No emulated device (plain CPU): a reclaim lowers the level by one, L3 -> L2."""
    faults = [
        FaultSpec(rank=0, step=5, phase="forward", kind="oom", shadow_ready_steps_before=1),
        FaultSpec(rank=1, step=11, phase="update", shadow_ready_steps_before=1),
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    levels = [
        (e["reason"], e["level"], e["headroom_bytes"])
        for e in events
        if e["kind"] == Kind.SHADOW_LEVEL
    ]
    assert levels == [("configured", 3, None), ("oom", 2, None), ("recovery", 3, None)]
    assert [e["level"] for e in events if e["kind"] == Kind.PROMOTED] == [2, 2]
