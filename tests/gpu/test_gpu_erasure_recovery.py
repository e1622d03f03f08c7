"""Lost DEVICE pages on a GPU: localised per chunk, replaced, rebuilt from host parity,
bit-identical to the fault-free run; beyond tolerance, reported and restarted, still exact.

What is emulated: at the recovery after a SIGKILL the agent asks the state manager to
drop the chunks (one ``cuMemCreate`` allocation of 2 MiB = one erasure page each) that
hold the chosen model-state pages: it closes their fds, so the memory is gone once no
process maps it (the shadow, which mapped ahead, still does until it localises). The
promoted trainer's page-map query finds the empty slots, unmaps its stale view, maps
fresh zeroed allocations at the same addresses and rebuilds them from host parity (Triton
kernels on the GPU). One host tier-1 parity page per group is lost as on CPU (hole punch
+ PROT_NONE, found by the state manager's madvise scan). No real HBM fault is involved.
The CPU twin is tests/launcher/test_erasure_recovery.py.
"""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import assert_exact, fault_free_digests, run_leto
from tests.launcher.test_erasure_recovery import H1_LOSSES, STEPS

# ~13M parameters: ~150 MiB of state = 3 groups of D=32 two-MiB pages (the last one short).
MODEL = ["--dim", "512", "--layers", "4", "--heads", "8", "--seq", "128", "--batch", "8", "--bf16"]
ERASURE = {"page_bytes": 2 << 20, "data_pages": 32, "tier1_parity": 16, "tier2_parity": 1}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free_digests(
        tmp_path_factory.mktemp("ref"),
        steps=STEPS,
        model_args=MODEL,
        leto={"erasure": ERASURE},
        timeout_s=600,
    )


@pytest.mark.timeout(900)
def test_gpu_hof_plus_h1_lost_device_pages_per_group_recovers_bit_identically(
    tmp_path, reference
) -> None:
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        model_args=MODEL,
        faults=H1_LOSSES,
        leto={"erasure": ERASURE},
        timeout_s=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    erased = [e for e in events if e["kind"] == Kind.PAGES_ERASED and e["region"] == "state"]
    assert len(erased) == 3 and all(len(e["pages"]) >= 32 for e in erased), (
        "several groups lost 16 pages"
    )
    rebuilt = {(e["rank"], e["gen"]): e for e in events if e["kind"] == Kind.PAGES_REBUILT}
    # Compute-phase kills: every erased device page was found by the page-map query and rebuilt.
    assert rebuilt[(1, 1)]["lost"]["state"]["data"] == len(erased[0]["pages"])
    assert rebuilt[(1, 1)]["lost"]["state"]["tier1"] >= 1
    assert rebuilt[(0, 2)]["lost"]["state"]["data"] == len(erased[1]["pages"])
    assert rebuilt[(0, 1)]["lost"]["state"] == {"data": 0, "tier1": 0, "tier2": 0}
    # Mid-update kill: rebuilt from the RMU's working parity, still found page by page.
    assert rebuilt[(1, 3)]["lost"]["state"]["data"] == len(erased[2]["pages"])
    for (rank, gen), e in sorted(
        rebuilt.items()
    ):  # shown with pytest -s: the numbers for BENCHMARKS.md
        print(
            f"rank {rank} gen {gen}: lost {e['lost']['state']}  localise {e['localize_s'] * 1e3:.1f} ms  "
            f"rebuild {e['rebuild_s'] * 1e3:.1f} ms"
        )


@pytest.mark.timeout(900)
def test_gpu_more_than_h1_lost_device_pages_restart_the_group_exactly(tmp_path, reference) -> None:
    faults = [FaultSpec(rank=1, step=6, phase="backward", erase_device_pages=17, erase_group=0)]
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        model_args=MODEL,
        faults=faults,
        leto={"erasure": ERASURE},
        extra=["--max-restarts", "1"],
        timeout_s=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (unrecoverable,) = [e for e in events if e["kind"] == Kind.UNRECOVERABLE]
    assert unrecoverable["rank"] == 1 and unrecoverable["lost"]["data"] == 17
    assert [e["restart"] for e in events if e["kind"] == Kind.WORKERS_STARTED] == [0, 1]
    assert_exact(reference, events)
