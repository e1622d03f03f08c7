"""Recovery with lost memory pages: rebuilt from two-tier parity, bit-identical; beyond
the code's tolerance, detected, reported and never resumed on.

Page loss is emulated, not real poison: at the recovery after a SIGKILL the agent asks
the state manager to punch the chosen pages out of their memfd (their contents are gone:
every mapping reads zeros) and to mprotect(PROT_NONE) them in its own mapping, so its
madvise(MADV_POPULATE_READ) scan finds them the way it would find EHWPOISON pages. The
localisation, remap and rebuild code that runs is the production code.
"""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import assert_exact, fault_free_digests, run_leto

STEPS = 20
# Small pages and groups so a tiny model spans several groups: 4 KiB pages, D=32.
ERASURE = {"page_bytes": 4096, "data_pages": 32, "tier1_parity": 16, "tier2_parity": 1}
# Three kills (compute, compute, update), each losing H1=16 device pages per group and one
# tier-1 host parity page (shared with the GPU twin, tests/gpu/test_gpu_erasure_recovery.py).
H1_LOSSES = [
    FaultSpec(rank=1, step=4, phase="backward", erase_device_pages=16, erase_host_pages=1),
    FaultSpec(rank=0, step=11, phase="forward", erase_device_pages=16, erase_host_pages=1),
    FaultSpec(rank=1, step=16, phase="update", erase_device_pages=16, erase_host_pages=1),
]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free_digests(
        tmp_path_factory.mktemp("ref"), steps=STEPS, leto={"erasure": ERASURE}
    )


def _lost(events: list[dict], rank: int, gen: int) -> dict:
    (event,) = [
        e
        for e in events
        if e["kind"] == Kind.PAGES_REBUILT and e["rank"] == rank and e["gen"] == gen
    ]
    return event["lost"]["state"]


@pytest.mark.timeout(600)
def test_hof_plus_h1_lost_pages_per_group_recovers_bit_identically(tmp_path, reference) -> None:
    """Each kill loses H1=16 model-state pages in every group and 1 tier-1 parity page."""
    proc, events = run_leto(tmp_path, steps=STEPS, faults=H1_LOSSES, leto={"erasure": ERASURE})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    erased = [e for e in events if e["kind"] == Kind.PAGES_ERASED and e["region"] == "state"]
    assert len(erased) == 3 and all(len(e["pages"]) >= 32 for e in erased), (
        "several groups lost 16 pages"
    )
    # The first two kills hit the compute phase: their pages were rebuilt from parity.
    assert _lost(events, 1, gen=1) == {
        "data": len(erased[0]["pages"]),
        "tier1": 1 * len(erased[0]["pages"]) // 16,
        "tier2": 0,
    }
    assert _lost(events, 0, gen=2)["data"] == len(erased[1]["pages"])
    assert _lost(events, 0, gen=1) == {"data": 0, "tier1": 0, "tier2": 0}


@pytest.mark.slow  # CI runs test_beyond_tolerance_without_restarts_fails_loudly
@pytest.mark.timeout(600)
def test_more_than_h1_lost_pages_fall_back_and_say_so(tmp_path, reference) -> None:
    """H1+1 lost pages in one group: the promoted trainer refuses to resume, the event
    says why, the agent takes torchrun's group restart, and the restarted job (from step
    0: no checkpoint yet) matches the fault-free run at every step."""
    faults = [FaultSpec(rank=1, step=6, phase="backward", erase_device_pages=17, erase_group=0)]
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        faults=faults,
        leto={"erasure": ERASURE},
        extra=["--max-restarts", "1"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    unrecoverable = [e for e in events if e["kind"] == Kind.UNRECOVERABLE]
    assert len(unrecoverable) == 1 and unrecoverable[0]["rank"] == 1
    assert "17" in unrecoverable[0]["error"] or unrecoverable[0]["lost"]["data"] == 17
    assert [e["restart"] for e in events if e["kind"] == Kind.WORKERS_STARTED] == [0, 1]
    assert_exact(reference, events)


@pytest.mark.timeout(300)
def test_beyond_tolerance_without_restarts_fails_loudly(tmp_path) -> None:
    faults = [FaultSpec(rank=0, step=3, phase="forward", erase_device_pages=17, erase_group=0)]
    proc, events = run_leto(tmp_path, steps=8, faults=faults, leto={"erasure": ERASURE})
    assert proc.returncode == 1
    assert any(e["kind"] == Kind.UNRECOVERABLE for e in events)
    assert "UnrecoverableStateError" in proc.stderr
