"""Optimizers other than AdamW recover exactly in real leto-run jobs.

``examples/train_gpt.py --optimizer`` under leto-run (2 ranks, gloo, shadows, SIGKILLs),
``consistency: rmu`` with two-tier erasure and chunks of 16 KiB (the optimizer's own step
runs chunk by chunk over whole parameters): kills in forward, backward, at a chunk boundary,
mid-chunk (the chunk's bytes scribbled) and after the last chunk, with lost model-state pages
at the update kills. Every (rank, step) digest (parameters, every state tensor the probe
found, the PRESENT bytes, RNG) equals the fault-free run's. CI runs SGD (momentum, Nesterov,
weight decay) and Muon chained with AdamW (``leto.ChainedOptimizer``); ``--run-slow`` runs RMSprop, NAdam, Adam with amsgrad, Muon and SGD under
``consistency: snapshot`` (their in-process twins: tests/updater/test_any_optimizer.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import assert_recovered, fault_free_digests, run_leto

STEPS = 18
ERASURE = {"page_bytes": 4096, "data_pages": 32, "tier1_parity": 16, "tier2_parity": 1}
H1 = ERASURE["tier1_parity"]
FIELDS = ("rank", "step", "phase", "point", "chunk")


def _faults(consistency: str) -> tuple[list[FaultSpec], list[int]]:
    """The schedule and the steps every rank resumes at (a kill before the update re-runs
    its step, one inside it finishes it)."""
    before = [
        FaultSpec(rank=0, step=3, phase="forward"),
        FaultSpec(rank=1, step=6, phase="backward"),
    ]
    if consistency == "snapshot":
        return [*before, FaultSpec(rank=0, step=9, phase="update")], [3, 6, 10]
    return [
        *before,
        FaultSpec(
            rank=0,
            step=9,
            phase="update",
            point="optimizer",
            chunk=1,
            erase_device_pages=H1,
            erase_host_pages=1,
        ),
        FaultSpec(rank=1, step=12, phase="update", point="boundary", chunk=2),
        FaultSpec(rank=0, step=15, phase="update", erase_device_pages=H1),
    ], [3, 6, 10, 13, 16]


def _recovers_exactly(tmp: Path, optimizer: str, consistency: str = "rmu") -> None:
    leto: dict = {"consistency": consistency}
    if consistency == "rmu":
        leto |= {"erasure": ERASURE, "rmu_chunk_bytes": 16384}
    args = ["--optimizer", optimizer]
    reference = fault_free_digests(tmp / "ref", steps=STEPS, leto=leto, script_args=args)
    faults, resumed_at = _faults(consistency)
    proc, events = run_leto(tmp, steps=STEPS, faults=faults, leto=leto, script_args=args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(reference, events, faults, nproc=2, resumed_at=resumed_at, fields=FIELDS)
    resumed = [e for e in events if e["kind"] == Kind.RESUMED]
    actions = {e["action"] for e in resumed}
    expected = {"restore+finish"} | ({"resume+finish"} if consistency == "rmu" else set())
    assert expected <= actions, actions
    for kill in faults[:2]:  # before the update: every rank re-runs the step, unless the
        # other rank was still in the previous step's update (a slow rank under load): then
        # that update is finished and nothing is re-run
        at = {e["action"] for e in resumed if e["step"] == kill.step}
        assert at == {"rerun"} or (at and "rerun" not in at and at - {"none"}), (kill, at)


@pytest.mark.timeout(900)
def test_sgd_with_nesterov_momentum_recovers_exactly_from_kills_in_every_phase(
    tmp_path: Path,
) -> None:
    (tmp_path / "ref").mkdir()
    _recovers_exactly(tmp_path, "sgd")


@pytest.mark.timeout(900)
def test_muon_chained_with_adamw_recovers_exactly_from_kills_in_every_phase(
    tmp_path: Path,
) -> None:
    """Muon for the blocks' matrices and AdamW for the rest, one ``leto.ChainedOptimizer``."""
    (tmp_path / "ref").mkdir()
    _recovers_exactly(tmp_path, "muon+adamw")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("optimizer", "consistency"),
    [
        ("rmsprop", "rmu"),
        ("nadam", "rmu"),
        ("adam-amsgrad", "rmu"),
        ("muon", "rmu"),
        ("sgd", "snapshot"),
    ],
)
def test_other_optimizers_recover_exactly_from_kills_in_every_phase(
    tmp_path: Path, optimizer: str, consistency: str
) -> None:
    (tmp_path / "ref").mkdir()
    _recovers_exactly(tmp_path, optimizer, consistency)
