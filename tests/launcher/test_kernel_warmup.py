"""The shadow's kernel warm-up in real jobs: a level-3 shadow runs it before it waits (here
in Triton's interpreter, through the CPU test hook), a level-2 shadow does not, and runs
with it recover bit-identically to the fault-free run."""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from leto.preinit.warmup import ENV_CPU
from tests.launcher.harness import assert_exact, fault_free_digests, run_leto

STEPS = 8
# Tiny groups, so the interpreter's warm-up stays short: 4 KiB pages, D=8, H1=2, H2=1.
ERASURE = {"page_bytes": 4096, "data_pages": 8, "tier1_parity": 2, "tier2_parity": 1}
FAULTS = [
    FaultSpec(rank=1, step=3, phase="backward", erase_device_pages=2, erase_host_pages=1),
    FaultSpec(rank=0, step=6, phase="update", erase_device_pages=2),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free_digests(
        tmp_path_factory.mktemp("ref"), steps=STEPS, leto={"erasure": ERASURE}
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize("level", [3, pytest.param(2, marks=pytest.mark.slow)])  # CI: L3
def test_level_3_shadows_warm_kernels_and_recover_exactly(
    tmp_path, reference, monkeypatch, level: int
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(ENV_CPU, "1")
    proc, events = run_leto(
        tmp_path, steps=STEPS, faults=FAULTS, leto={"erasure": ERASURE, "shadow_level": level}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    promoted = [(e["rank"], e["gen"]) for e in events if e["kind"] == Kind.PROMOTED]
    assert len(promoted) == 4, "two recoveries, two ranks each"
    warmed = {(e["rank"], e["gen"]): e for e in events if e["kind"] == Kind.KERNELS_WARMED}
    ready = {(e["rank"], e["gen"]): e["t"] for e in events if e["kind"] == Kind.SHADOW_READY}
    for key in promoted:
        e = warmed[key]
        assert e["level"] == level and e["t"] <= ready[key], (
            "the warm-up runs before the shadow waits"
        )
        if level == 3:
            assert (
                e["ran"] and e["calls"]["gf16_mac"] > 0 and e["calls"]["adamw_rmu"] == 0
            )  # CPU: not fused
        else:
            assert not e["ran"] and "level 2" in e["reason"]
