"""Stateful objects and buffers recover bit-identically: LR schedulers, hyperparameters, a
data position, a stateful loader, BatchNorm statistics.

Real leto-run jobs of examples/train_scheduled.py (2 CPU ranks, gloo, shadows, the state
manager, SIGKILLs): the scheduler is stepped after ``state.step()`` and never named to
Leto, a user ``Stateful`` cursor drives the data, BatchNorm updates its running statistics
in forward. Kills in forward and backward re-run their step (buffers and objects back to
its start), kills in the update finish it (objects back to the commit, the scheduler's step
after it replayed), a fatal failure restarts from the checkpoint. Every (rank, step) digest —
the state region (buffers included) and the stateful objects' capture at the commit — and
every step's hyperparameters and batch (augmented from Python's ``random`` and NumPy's
global generator in the loop: ``--augment``) equal the fault-free run's; the fault-free
hyperparameters equal torch's own scheduler's. CI runs LambdaLR (the Hugging Face pattern) and OneCycleLR
(it cycles beta1 too; with a checkpoint restart); ``--run-slow`` runs
CosineAnnealingWarmRestarts, torchdata's StatefulDataLoader, random schedules (``LETO_SOAK=N``
of them), ``consistency: snapshot`` and a one-rank job against plain torch. Their in-process
twins: tests/trainer/test_extras.py, test_buffers.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import (
    REPO,
    assert_exact,
    assert_recovered,
    fault_free_digests,
    fault_free_run,
    random_schedule,
    resume_steps,
    run_leto,
)

SCRIPT = str(REPO / "examples" / "train_scheduled.py")
STEPS = 12
SOAK = int(os.environ.get("LETO_SOAK", "4"))


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_scheduled", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _args(tmp: Path, scheduler: str, *extra: str) -> list[str]:
    return ["--scheduler", scheduler, "--trace", str(tmp / "trace"), *extra]


def trace(tmp: Path, rank: int) -> dict[int, dict]:
    """Each step's hyperparameters as the script logged them (a re-run step: its last entry)."""
    out: dict[int, dict] = {}
    for line in (tmp / f"trace.rank{rank}").read_text().splitlines():
        entry = json.loads(line)
        out[entry["step"]] = entry
    return out


def plain_trajectory(scheduler: str, steps: int) -> list[dict]:
    """The hyperparameters torch's own scheduler gives each step (no Leto, no model)."""
    example = _example()
    args = example.argparse.Namespace(steps=steps, lr=1e-2, warmup=3)
    opt = torch.optim.AdamW(
        [torch.nn.Parameter(torch.zeros(1))], lr=args.lr, weight_decay=0.01, foreach=True
    )
    sched = example.make_scheduler(scheduler, opt, args)
    out = []
    for _ in range(steps):
        out.append(example.hyperparameters(opt))
        opt.step()
        sched.step()
    return out


class Reference:
    """A fault-free run: its digests and each rank's hyperparameters per step."""

    def __init__(self, tmp: Path, scheduler: str, *extra: str, leto: dict | None = None) -> None:
        """``leto``: the job file's section, for this run and every ``run``."""
        self.scheduler, self.extra, self.leto = scheduler, extra, leto
        tmp.mkdir(parents=True, exist_ok=True)
        self.digests, _ = fault_free_run(
            tmp, steps=STEPS, script=SCRIPT, model_args=_args(tmp, scheduler, *extra), leto=leto
        )
        self.traces = [trace(tmp, rank) for rank in range(2)]
        assert sorted(self.traces[0]) == list(range(STEPS))
        hypers = [{k: self.traces[0][s][k] for k in ("lr", "betas")} for s in range(STEPS)]
        assert hypers == plain_trajectory(scheduler, STEPS)

    def run(self, tmp: Path, faults: list[FaultSpec], **kwargs) -> list[dict]:
        proc, events = run_leto(
            tmp,
            steps=STEPS,
            faults=faults,
            script=SCRIPT,
            model_args=_args(tmp, self.scheduler, *self.extra),
            leto=self.leto,
            **kwargs,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        for rank in range(2):
            assert trace(tmp, rank) == self.traces[rank], f"rank {rank}'s hyperparameters diverged"
        return events


@pytest.fixture(scope="module")
def lambda_ref(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return Reference(tmp_path_factory.mktemp("ref_lambda"), "lambda", "--augment")


@pytest.fixture(scope="module")
def onecycle_ref(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    return Reference(tmp_path_factory.mktemp("ref_onecycle"), "onecycle", "--augment")


KILLS = [
    FaultSpec(rank=0, step=2, phase="forward"),
    FaultSpec(rank=1, step=5, phase="update"),
    FaultSpec(rank=0, step=8, phase="backward"),
]
RESUMED_AT = [2, 6, 8]


def _resumed(events: list[dict]) -> list[tuple[int, int, str, bool]]:
    return [
        (e["rank"], e["step"], e["extras"], e["buffers_restored"])
        for e in events
        if e["kind"] == Kind.RESUMED
    ]


def _assert_capture_use(events: list[dict]) -> None:
    """Which capture each recovery of ``KILLS`` restored, on the killed rank."""
    resumed = _resumed(events)
    # killed inside the update: it finishes it, restores the commit's capture and replays
    # the scheduler's step (its buffers are what step 5's forward wrote: nothing to undo)
    assert (1, 6, "pre+replay", False) in resumed, resumed
    # killed in forward / backward: the step's start, and the buffers its forward had updated
    assert (0, 2, "begin", True) in resumed and (0, 8, "begin", True) in resumed, resumed


@pytest.mark.timeout(600)
def test_lambda_scheduler_stepped_after_the_commit_recovers_exactly(
    tmp_path: Path, lambda_ref: Reference
) -> None:
    """The held-out pattern (a Hugging Face script's LambdaLR), kills in forward, update, backward."""
    events = lambda_ref.run(tmp_path, KILLS)
    assert_recovered(lambda_ref.digests, events, KILLS, nproc=2, resumed_at=RESUMED_AT)
    _assert_capture_use(events)


@pytest.mark.timeout(600)
def test_onecycle_recovers_exactly_in_place_and_from_the_checkpoint(
    tmp_path: Path, onecycle_ref: Reference
) -> None:
    """OneCycleLR moves lr and beta1 every step; a kill mid-chunk of the update, then a fatal
    failure: the group restarts from the checkpoint, whose records hold the objects."""
    faults = [
        FaultSpec(rank=1, step=2, phase="backward"),
        FaultSpec(rank=0, step=4, phase="update", point="optimizer"),
        FaultSpec(rank=1, step=10, phase="forward", kind="fatal"),
    ]
    events = onecycle_ref.run(
        tmp_path,
        faults,
        extra=[
            "--max-restarts",
            "1",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--checkpoint-every",
            "2",
        ],
    )
    assert_exact(onecycle_ref.digests, events)
    assert [(e["rank"], e["step"]) for e in events if e["kind"] == Kind.FAULT_INJECTED] == [
        (1, 2),
        (0, 4),
        (1, 10),
    ]
    resumed = _resumed(events)
    assert (1, 2, "begin", True) in resumed and (0, 5, "pre+replay", False) in resumed, resumed
    loaded = [e for e in events if e["kind"] == Kind.CHECKPOINT_LOADED]
    # saves at 6, 8, 10 after the in-place recoveries; the one at 10 may still be in flight
    assert {e["rank"] for e in loaded} == {0, 1} and loaded[0]["step"] in (8, 10), loaded


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cosine_warm_restarts_recover_exactly(tmp_path: Path) -> None:
    ref = Reference(tmp_path / "ref", "cosine_restarts")
    events = ref.run(tmp_path, KILLS)
    assert_recovered(ref.digests, events, KILLS, nproc=2, resumed_at=RESUMED_AT)
    _assert_capture_use(events)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_stateful_dataloader_recovers_exactly(tmp_path: Path) -> None:
    """torchdata's StatefulDataLoader named to Leto (a DistributedSampler shard, epochs of 8
    batches): kills mid-epoch, in the last update of an epoch, in the next epoch's forward."""
    pytest.importorskip("torchdata.stateful_dataloader")
    ref = Reference(tmp_path / "ref", "onecycle", "--loader")
    faults = [
        FaultSpec(rank=1, step=3, phase="update"),
        FaultSpec(rank=0, step=7, phase="update"),
        FaultSpec(rank=1, step=10, phase="forward"),
    ]
    events = ref.run(tmp_path, faults)
    assert_recovered(ref.digests, events, faults, nproc=2, resumed_at=[4, 8, 10])


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_random_kill_schedules_recover_exactly(tmp_path: Path) -> None:
    """``LETO_SOAK`` random (rank, step, phase) schedules per scheduler, two kills each."""
    for scheduler in ("lambda", "onecycle", "cosine_restarts"):
        ref = Reference(tmp_path / scheduler / "ref", scheduler)
        for seed in range(SOAK):
            run_dir = tmp_path / scheduler / str(seed)
            run_dir.mkdir(parents=True)
            faults = random_schedule(seed, STEPS, count=2, min_gap=4, first=2)
            events = ref.run(run_dir, faults)
            assert_recovered(ref.digests, events, faults, nproc=2, resumed_at=resume_steps(faults))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_rank_job_equals_plain_torch(tmp_path: Path) -> None:
    """The same loop with torch alone and under leto-run end bit-identical: parameters,
    BatchNorm statistics, AdamW state, the scheduler, the cursor."""
    import subprocess
    import sys

    plain, leto = tmp_path / "plain.pt", tmp_path / "leto.pt"
    args = ["--scheduler", "onecycle", "--final"]
    subprocess.run(
        [sys.executable, SCRIPT, "--plain", "--steps", str(STEPS), *args, str(plain)],
        check=True,
        timeout=300,
    )
    proc, _ = run_leto(tmp_path, steps=STEPS, nproc=1, script=SCRIPT, model_args=[*args, str(leto)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = torch.load(plain, weights_only=False), torch.load(leto, weights_only=False)
    assert a.keys() == b.keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for i, state in a["optim"]["state"].items():
        for key, value in state.items():
            assert torch.equal(value, b["optim"]["state"][i][key]), (i, key)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    assert (a["scheduler"], a["cursor"]) == (b["scheduler"], b["cursor"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_snapshot_consistency_recovers_exactly(tmp_path: Path) -> None:
    """The same under ``consistency: snapshot`` (torch's optimizer.step() on a restored snapshot)."""
    ref = Reference(tmp_path / "ref", "lambda", leto={"consistency": "snapshot"})
    events = ref.run(tmp_path, KILLS)
    assert_recovered(ref.digests, events, KILLS, nproc=2, resumed_at=RESUMED_AT)
    _assert_capture_use(events)


def _script_recovers_exactly(tmp_path: Path, script: str, faults: list[FaultSpec]) -> str:
    """``tests/launcher/scripts/<script>`` with ``faults``: every rank resumed once per fault
    and every digest equal to the script's fault-free run's; its stderr."""
    path = str(REPO / "tests" / "launcher" / "scripts" / script)
    (tmp_path / "ref").mkdir()
    reference = fault_free_digests(tmp_path / "ref", steps=STEPS, script=path, model_args=[])
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults, script=path, model_args=[])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(reference, events, faults, nproc=2, resumed_at=resume_steps(faults))
    return proc.stderr


def test_a_plateau_scheduler_stepped_with_the_loss_recovers_exactly(tmp_path: Path) -> None:
    """``ReduceLROnPlateau.step(float(loss))`` after ``state.step(loss=loss)``: two kills
    inside updates in a row (each promoted trainer replays the scheduler with the retained
    loss of the interrupted step, the second one after the first one's replay), every
    digest equal to the fault-free run's."""
    faults = [
        FaultSpec(rank=0, step=3, phase="update"),
        FaultSpec(rank=1, step=6, phase="update"),
    ]
    stderr = _script_recovers_exactly(tmp_path, "plateau.py", faults)
    assert "ReduceLROnPlateau" not in stderr  # no warning: every step is replayable


def test_an_ema_of_the_weights_recovers_exactly(tmp_path: Path) -> None:
    """``AveragedModel.update_parameters(model)`` after every ``state.step()``: kills inside
    two updates (each promoted trainer averages the finished update's weights again) and in
    backward, every digest (the average's state included) equal to the fault-free run's."""
    faults = [
        FaultSpec(rank=0, step=3, phase="update"),
        FaultSpec(rank=1, step=6, phase="update"),
        FaultSpec(rank=0, step=9, phase="backward"),
    ]
    stderr = _script_recovers_exactly(tmp_path, "ema.py", faults)
    assert "AveragedModel" not in stderr  # no warning: every step is replayable
