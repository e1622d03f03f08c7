"""The paper's §8.4 on CPU: kills inside the update, lost pages, bit-identical recovery.

Real leto-run jobs (2 ranks, gloo, shadows, state manager) under ``consistency: rmu`` with
two-tier erasure protection. Kills land inside the update — in the optimizer step of a
chunk (its bytes then scribbled, as an aborted kernel leaves them), inside the chunk's
parity update (scratch parity scribbled), inside the copy of the parity to host (the rest
of the destination scribbled) — and each recovery also loses H1 model-state pages in every
protection group and one host tier-1 parity page. Every (rank, step) digest must equal the
fault-free run's. With the incremental parity turned off (the paper's "RMP alone") the same
schedule must diverge: rebuilt pages come from parity that lags the data.
"""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import assert_exact, digests, fault_free_digests, run_leto

STEPS = 100
ERASURE = {"page_bytes": 4096, "data_pages": 32, "tier1_parity": 16, "tier2_parity": 1}
# 64 KiB of parameters per chunk: the test model's update is 3 chunk transactions.
LETO = {"consistency": "rmu", "erasure": ERASURE, "rmu_chunk_bytes": 65536}
CHUNKS = 3
H1 = ERASURE["tier1_parity"]


def _every_ten() -> list[FaultSpec]:
    """§8.4: one kill every 10 iterations, rotating optimizer / parity / flush, both ranks."""
    points = ["optimizer", "parity", "flush"]
    faults = []
    for k, step in enumerate(range(5, STEPS, 10)):
        point = points[k % 3]
        faults.append(
            FaultSpec(
                rank=k % 2,
                step=step,
                phase="update",
                point=point,  # type: ignore[arg-type]
                chunk=None if point == "flush" else k % CHUNKS,
                erase_device_pages=H1,
                erase_host_pages=1,
            )
        )
    return faults


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return fault_free_digests(tmp_path_factory.mktemp("ref"), steps=STEPS, leto=LETO)


def _assert_exact(ref: dict, events: list[dict], faults: list[FaultSpec]) -> None:
    assert_exact(ref, events)
    injected = [e for e in events if e["kind"] == Kind.FAULT_INJECTED]
    assert [(e["rank"], e["step"], e["point"], e["chunk"]) for e in injected] == [
        (f.rank, f.step, f.point, f.chunk if f.point != "flush" else None) for f in faults
    ]


@pytest.mark.timeout(600)
def test_kills_inside_the_update_with_lost_pages_recover_exactly(tmp_path, reference) -> None:
    faults = _every_ten()
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults, leto=LETO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_exact(reference, events, faults)
    rebuilt = [e for e in events if e["kind"] == Kind.PAGES_REBUILT and e["lost"]["state"]["data"]]
    assert len(rebuilt) == len(faults), "every recovery rebuilt lost model-state pages"
    assert all(
        e["lost"]["state"]["data"] >= 2 * H1 and e["lost"]["state"]["tier1"] >= 1 for e in rebuilt
    )
    assert {e["phase"] for e in rebuilt} == {"CHUNK_SAVED", "FLUSHING"}
    actions = {e["action"] for e in events if e["kind"] == Kind.RESUMED}
    assert {"restore+finish", "flush"} <= actions, actions


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_point_sweep_every_chunk_boundary_and_mid_chunk_both_ranks(
    tmp_path, reference
) -> None:
    """Every chunk boundary and mid-chunk point, on each rank (one kill per step: a new
    shadow generation must be spawned between kills), each with lost pages. A soak (~90 s on
    2 cores): CI runs its in-process twin, tests/updater/test_rmu.py::
    test_every_kill_point_with_lost_pages_finishes_exactly; ``--run-slow`` runs this one."""
    faults = []
    step = 4
    for rank in (0, 1):
        for chunk in range(CHUNKS):
            for point in ("boundary", "optimizer"):
                faults.append(
                    FaultSpec(
                        rank=rank,
                        step=step,
                        phase="update",
                        point=point,
                        chunk=chunk,  # type: ignore[arg-type]
                        erase_device_pages=H1,
                        erase_host_pages=1,
                    )
                )
                step += 3
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults, leto=LETO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_exact(reference, events, faults)
    phases = {e["phase"] for e in events if e["kind"] == Kind.PAGES_REBUILT}
    assert {"PARITY_LOADED", "CHUNK_COMMITTED", "CHUNK_SAVED"} <= phases, phases


@pytest.mark.timeout(600)
def test_rmp_alone_without_incremental_parity_diverges(tmp_path, reference, monkeypatch) -> None:
    """The negative test (the paper's NaN curve): the same kind of kill with the RMU's
    parity update off rebuilds lost pages from stale parity, and the run never matches."""
    monkeypatch.setenv("LETO_RMU_PARITY", "0")
    faults = [
        FaultSpec(
            rank=1,
            step=5,
            phase="update",
            point="optimizer",
            chunk=2,
            erase_device_pages=H1,
            erase_host_pages=1,
        )
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults, leto=LETO)
    got = digests(events)
    before = [(r, s) for (r, s) in got if s <= 5]
    assert before and all(got[k] == reference[k] for k in before), "fault-free steps are unaffected"
    wrong = [k for k in got if k[1] > 5 and got[k] != reference[k]]
    refused = [e for e in events if e["kind"] == Kind.UNRECOVERABLE]
    assert proc.returncode != 0 or wrong, "resumed on wrong data without noticing"
    # Here the rebuilt pages hold a garbage Adam step counter: the resume refuses.
    assert proc.returncode != 0 and len(refused) == 1 and refused[0]["rank"] == 1
    assert "step counters contradict" in refused[0]["error"]
    assert not [k for k in got if k[1] > 5 and k[0] == 1], (
        "rank 1 never committed a step on the wrong state"
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("region", "point", "in_place"),
    [
        ("rmu.undo", "optimizer", False),  # chunk saved, half updated: the undo copy is the record
        # mid-update: the working parity is authoritative; between chunks the undo copy is not
        # needed (CI runs the first case)
        pytest.param("rmu.parity", "boundary", False, marks=pytest.mark.slow),
        pytest.param("rmu.undo", "boundary", True, marks=pytest.mark.slow),
    ],
)
def test_lost_update_buffers_mid_update_take_the_checkpoint_path(
    tmp_path, reference, region, point, in_place
) -> None:
    """The undo copy and the working parity are unprotected device regions. Losing one
    while the resume point needs it must never be resumed on: unrecoverable_state, a group
    restart (no checkpoint: from step 0), and still every digest equals the fault-free run.
    Emulated as for model-state pages: the state manager drops the region's chunk."""
    faults = [
        FaultSpec(
            rank=1,
            step=5,
            phase="update",
            point=point,
            chunk=1,
            erase_device_pages=1,
            erase_device_region=region,
        )
    ]
    proc, events = run_leto(
        tmp_path, steps=STEPS, faults=faults, leto=LETO, extra=["--max-restarts", "1"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    assert [e["region"] for e in events if e["kind"] == Kind.PAGES_ERASED] == [region]
    unrecoverable = [e for e in events if e["kind"] == Kind.UNRECOVERABLE]
    restarts = [e for e in events if e["kind"] == Kind.GROUP_RESTART]
    if in_place:
        assert not unrecoverable and not restarts
    else:
        assert [(e["rank"], e["region"]) for e in unrecoverable] == [(1, region)]
        assert len(restarts) == 1 and "ff" in restarts[0]["reason"]
