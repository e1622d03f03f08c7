"""Stateful objects retained with the step (``leto.trainer.extras``), in process.

The record slots: a torn write never costs the newest good record, a checksum catches a
damaged one. The capture protocol, driven as ``RetainedState`` drives it (``begin`` at the
start of each step, ``before_commit`` in ``state.step()`` before GRADS_READY, ``load_pre`` and
``resume`` at a recovery): a "process" dies at every point of a step (its retained region is
what survives), a fresh set of objects resumes from it, and the objects must equal the
fault-free run's at the step the recovery resumes at, and at the end of the job.
"""

from __future__ import annotations

import gc
import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler

from leto.errors import ConfigError, UnrecoverableStateError
from leto.retained.marker import Phase
from leto.trainer import extras
from leto.trainer.extras import Capture, Record, RecordSlots, RecordStore, RetainedExtras

SLOT = 1 << 16


def _region() -> torch.Tensor:
    return torch.zeros(RecordSlots.region_bytes(SLOT), dtype=torch.uint8)


# -- record slots ------------------------------------------------------------------------------
def test_the_newest_records_survive() -> None:
    region = _region()
    store = RecordStore(region)
    for seq in range(1, extras.SLOTS + 2):
        store.write(seq * 10, Capture.BEGIN, bytes([seq]) * 100)
    assert sorted(r.seq for r in store.records()) == list(range(2, extras.SLOTS + 2))
    reread = RecordStore(region)  # a successor's view
    reread.write(99, Capture.PRE, b"x")
    assert sorted(r.seq for r in reread.records()) == list(range(3, extras.SLOTS + 3))


def test_a_torn_write_leaves_the_newest_good_record(monkeypatch: pytest.MonkeyPatch) -> None:
    region = _region()
    store = RecordStore(region)
    for seq in range(1, extras.SLOTS + 1):
        store.write(seq, Capture.BEGIN, bytes([seq]) * 1000)

    class Killed:  # dies after the payload, before the header lands
        size, unpack = extras._HEADER.size, extras._HEADER.unpack

        def pack(self, *_: object) -> bytes:
            raise KeyboardInterrupt

    monkeypatch.setattr(extras, "_HEADER", Killed())
    with pytest.raises(KeyboardInterrupt):
        store.write(99, Capture.BEGIN, b"c" * 1000)  # over the oldest, seq 1
    monkeypatch.undo()
    survivors = {r.seq: r.payload for _, r in RecordSlots(region).read()}
    assert sorted(survivors) == list(range(2, extras.SLOTS + 1))
    assert survivors[extras.SLOTS] == bytes([extras.SLOTS]) * 1000


def test_each_overwrite_waits_for_the_marker_to_pass_what_its_record_serves() -> None:
    """A record goes only once the marker has landed past what a resume from it needs:
    ``BEGIN(u)`` until step u's gradients are final, ``PRE(u)`` until u commits."""

    class Landing:
        def __init__(self) -> None:
            self.waits: list[tuple[Phase, int]] = []

        def wait_landed(self, phase: Phase, step: int) -> None:
            self.waits.append((phase, step))

    marker = Landing()
    store = RecordStore(_region(), marker)  # type: ignore[arg-type]
    steps = extras.SLOTS // 2 + 2
    for step in range(steps):
        store.write(step, Capture.BEGIN, b"b")
        store.write(step, Capture.PRE, b"p")
    kept = extras.SLOTS // 2
    assert marker.waits == [
        wait for u in range(steps - kept) for wait in ((Phase.GRADS_READY, u), (Phase.IDLE, u + 1))
    ]


def test_a_resume_discards_the_records_of_the_steps_it_runs_again() -> None:
    """A failed trainer's host ran ahead of its device: its records of the steps after the
    resume point are stale once those steps run again (a second failure before the new run
    rewrote them must not read them)."""
    store = RecordStore(_region())
    for step in (4, 5, 6):
        store.write(step, Capture.BEGIN, b"old")
        store.write(step, Capture.PRE, b"old")
    store.discard_beyond(5)
    assert sorted((r.step, r.kind.name) for r in store.records()) == [
        (4, "BEGIN"),
        (4, "PRE"),
        (5, "BEGIN"),
    ]


def test_a_damaged_record_fails_its_checksum() -> None:
    region = _region()
    slots = RecordSlots(region)
    slots.write(0, Record(1, 0, Capture.BEGIN, b"a" * 100))
    slots.write(1, Record(2, 1, Capture.PRE, b"b" * 100))
    flipped = extras.HEADER_BYTES + SLOT + extras.HEADER_BYTES + 50  # in record 2's payload
    region[flipped] ^= 1
    assert [r.seq for _, r in RecordSlots(region).read()] == [1]


def test_a_record_larger_than_a_slot_is_refused_with_the_fix() -> None:
    store = RecordStore(_region())
    with pytest.raises(ConfigError, match="stateful_bytes"):
        store.write(0, Capture.BEGIN, b"x" * (SLOT + 1))


# -- the capture protocol ----------------------------------------------------------------------
class Counter:
    """A user Stateful: advanced before or after the commit."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "lambda": lambda opt: lr_scheduler.LambdaLR(opt, lambda s: 0.9**s),
    "onecycle": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=20),
    "cosine_restarts": lambda opt: lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2),
    "sequential": lambda opt: lr_scheduler.SequentialLR(
        opt,
        [lr_scheduler.LinearLR(opt, 0.1, total_iters=3), lr_scheduler.ExponentialLR(opt, 0.8)],
        [3],
    ),
    "chained": lambda opt: lr_scheduler.ChainedScheduler(
        [lr_scheduler.LinearLR(opt, 0.1, total_iters=3), lr_scheduler.ExponentialLR(opt, 0.9)]
    ),
    "cyclic": lambda opt: lr_scheduler.CyclicLR(
        opt, 0.01, 0.1, step_size_up=2, cycle_momentum=False
    ),
}


@dataclass
class Job:
    """One trainer's objects, as a script builds them (the scheduler after ``retain``)."""

    scheduler: str
    region: torch.Tensor
    sched_before_commit: bool = False
    counter_after_commit: bool = False
    named: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.param = torch.nn.Parameter(torch.ones(3))
        self.opt = torch.optim.AdamW([self.param], lr=0.1, foreach=True)
        self.counter = Counter()
        self.extras = RetainedExtras(
            RecordStore(self.region), self.opt, {"counter": self.counter, **self.named}, 0
        )
        self.sched = SCHEDULERS[self.scheduler](self.opt)
        self.extras.discover()

    def state(self) -> dict[str, Any]:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        return {"sched": self.sched.state_dict(), "counter": self.counter.n, "groups": groups}

    def step(self, t: int, die_at: str | None = None) -> bool:
        """Step ``t`` of the script; False when the process dies at ``die_at``."""
        self.extras.begin(t)
        if die_at == "compute":
            return False
        if not self.counter_after_commit:
            self.counter.n += 1  # the batch fetch
        if self.sched_before_commit:
            self.sched.step()
        self.extras.before_commit(t)
        if die_at == "update":
            return False
        self.opt.step()  # the update (its values do not matter here)
        if die_at == "commit":  # committed, the script's code after state.step() never ran
            return False
        if not self.sched_before_commit:
            self.sched.step()
        if self.counter_after_commit:
            self.counter.n += 1
        return True


STEPS = 9


def _fault_free(**kw: Any) -> tuple[dict[int, dict], dict[int, str]]:
    """Each step's starting state and each commit's digest, of a run that never fails."""
    job = Job(region=_region(), **kw)
    starts, digests = {}, {}
    for t in range(STEPS):
        starts[t] = job.state()
        job.step(t)
        digests[t + 1] = job.extras.commit_digest
    starts[STEPS] = job.state()
    return starts, digests


def _recover(die_at: str, kill_step: int, **kw: Any) -> tuple[Job, int, str]:
    """Run until the kill, then bring a fresh job to the resume point as ``_resume`` does."""
    job = Job(region=_region(), **kw)
    for t in range(kill_step):
        assert job.step(t)
    job.step(kill_step, die_at=die_at)
    survivor = job.region.clone()  # what the state manager holds of the dead process
    finish = die_at in ("update", "commit")
    resume_at = kill_step + 1 if finish else kill_step
    fresh = Job(region=survivor, **kw)  # the promoted shadow builds its objects anew
    if die_at == "update":
        fresh.extras.load_pre(kill_step)  # the finishing update reads these hyperparameters
        fresh.opt.step()
    how = fresh.extras.resume(resume_at)
    return fresh, resume_at, how


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
@pytest.mark.parametrize("die_at", ["compute", "update", "commit"])
@pytest.mark.parametrize("kill_step", [0, 4])
def test_every_kill_point_resumes_at_the_fault_free_state(
    scheduler: str, die_at: str, kill_step: int
) -> None:
    starts, digests = _fault_free(scheduler=scheduler)
    job, resume_at, how = _recover(die_at, kill_step, scheduler=scheduler)
    assert how == ("begin" if die_at == "compute" else "pre+replay")
    assert job.state() == starts[resume_at]
    if resume_at:
        assert job.extras.commit_digest == digests[resume_at]  # what emit_digest reports there
    for t in range(resume_at, STEPS):  # the rest of the job, and the history it keeps
        assert job.step(t)
        assert job.extras.commit_digest == digests[t + 1]
    assert job.state() == starts[STEPS]


def test_a_second_failure_never_reads_what_a_host_ran_ahead_before_the_first() -> None:
    """The first trainer's host ran steps 4 and 5 ahead of its device (records of them, its
    counter drawn otherwise: a live data source) and died with step 3 committed. Its
    successor re-runs step 4 and dies right after committing it; the next resumes at 5 from
    the successor's ``PRE(4)``, never from the first trainer's ``BEGIN(5)``."""
    starts, _ = _fault_free(scheduler="onecycle")
    first = Job(region=_region(), scheduler="onecycle")
    for t in range(4):
        assert first.step(t)
    for t in (4, 5):  # ahead of the device: the marker stays at step 4's start
        first.extras.begin(t)
        first.counter.n += 100
        first.extras.before_commit(t)
        first.sched.step()
    first.extras.begin(6)
    second = Job(region=first.region.clone(), scheduler="onecycle")
    assert second.extras.resume(4) == "begin" and second.state() == starts[4]
    assert not second.step(4, die_at="commit")
    third = Job(region=second.region.clone(), scheduler="onecycle")
    assert third.extras.resume(5) == "pre+replay"
    assert third.state() == starts[5]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_scheduler_stepped_before_the_commit_is_not_replayed() -> None:
    starts, _ = _fault_free(scheduler="lambda", sched_before_commit=True)
    for kill_step in (0, 4):
        job, resume_at, how = _recover(
            "update", kill_step, scheduler="lambda", sched_before_commit=True
        )
        assert how == "pre" and job.state() == starts[resume_at]


def test_a_kill_after_the_next_begin_resumes_from_it() -> None:
    """Killed in the script's code of step 5 after its BEGIN record: no replay needed."""
    starts, _ = _fault_free(scheduler="onecycle")
    job, resume_at, how = _recover("compute", 5, scheduler="onecycle")
    assert (resume_at, how) == (5, "begin") and job.state() == starts[5]


def test_an_object_changed_after_the_commit_refuses_a_finishing_recovery() -> None:
    with pytest.raises(
        UnrecoverableStateError,
        match=r"counter \(Counter\): its state was changed after state.step",
    ):
        _recover("update", 4, scheduler="lambda", counter_after_commit=True)
    with pytest.raises(UnrecoverableStateError, match="first step's update was interrupted"):
        _recover("update", 0, scheduler="lambda", counter_after_commit=True)
    _recover("compute", 4, scheduler="lambda", counter_after_commit=True)  # a re-run needs no guess


def _stepped_on_odd_steps_only() -> Job:
    """Four steps whose scheduler is stepped after the commit on odd steps only, then the
    fifth step's ``BEGIN``."""
    job = Job(region=_region(), scheduler="lambda")
    for t in range(4):
        job.extras.begin(t)
        job.counter.n += 1
        job.extras.before_commit(t)
        if t % 2:
            job.sched.step()
    job.extras.begin(4)
    return job


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_a_scheduler_stepped_after_the_commit_on_some_steps_only_is_refused() -> None:
    job = _stepped_on_odd_steps_only()
    job.counter.n += 1
    job.extras.before_commit(4)
    fresh = Job(region=job.region.clone(), scheduler="lambda")
    with pytest.raises(
        UnrecoverableStateError, match="stepped after state.step\\(\\) in 2 of 4 steps"
    ):
        fresh.extras.resume(5)


AFTER_COMMIT: dict[str, Callable[[Job, int], None]] = {
    # torch's documented use: step(epoch + i / iters), its period counted in epochs
    "fractional_epoch": lambda job, t: job.sched.step(t // 3 + (t % 3 + 1) / 3),
    "twice": lambda job, t: (job.sched.step(), job.sched.step()),
    # the scheduler's step, then the script's own warm-up write of the rate
    "lr_written": lambda job, t: (
        job.sched.step(),
        job.opt.param_groups[0].__setitem__("lr", 0.01 * (t + 1)),
    ),
}


@pytest.mark.parametrize("after", sorted(AFTER_COMMIT))
def test_a_scheduler_that_one_step_does_not_reproduce_is_named_and_refused(
    after: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Stepped after the commit in every step, but otherwise than by one ``step()``: a
    recovery that finishes the update cannot replay it, and must not resume on a guess (one
    ``step()`` there resumed a fractional-epoch cosine schedule on another rate)."""

    def run(job: Job, steps: int) -> None:
        for t in range(steps):
            job.extras.begin(t)
            job.counter.n += 1
            job.extras.before_commit(t)
            job.opt.step()
            AFTER_COMMIT[after](job, t)

    scheduler = "cosine_restarts"
    job = Job(region=_region(), scheduler=scheduler)
    run(job, 4)
    job.extras.begin(4)
    job.counter.n += 1
    job.extras.before_commit(4)  # killed inside step 4's update
    warned = [r.getMessage() for r in caplog.records if "CosineAnnealing" in r.getMessage()]
    assert (
        len(warned) == 1 and "step 0" in warned[0] and "otherwise than by one step()" in warned[0]
    )
    fresh = Job(region=job.region.clone(), scheduler=scheduler)
    fresh.extras.load_pre(4)
    with pytest.raises(UnrecoverableStateError, match=r"otherwise than by one step\(\) in 4 of 4"):
        fresh.extras.resume(5)
    fresh = Job(region=job.region.clone(), scheduler=scheduler)
    assert fresh.extras.resume(4) == "begin"  # a kill before the commit needs no replay


def test_a_scheduler_built_inside_the_loop_is_an_error_at_once() -> None:
    job = Job(region=_region(), scheduler="lambda")
    job.step(0)
    late = lr_scheduler.StepLR(job.opt, 2)  # noqa: F841 - the script keeps it
    with pytest.raises(
        ConfigError, match="StepLR on the retained optimizer was built after state.steps"
    ):
        job.extras.begin(1)


def test_a_promoted_shadow_scans_only_what_its_script_built_after_retain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``freeze_heap``: schedulers built before the shadow froze its heap are remembered,
    those built after are found by a scan that no longer sees the frozen heap; the heap is
    unfrozen after the second step's scan."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, foreach=True)
    early = lr_scheduler.StepLR(opt, 2)
    try:
        frozen = extras.freeze_heap(opt)
        assert frozen == [early] and gc.get_freeze_count() > 0
        assert extras.attached_schedulers(opt) == [], "the frozen heap is out of the scan's sight"
        job = RetainedExtras(RecordStore(_region()), opt, None, 0, frozen)
        late = lr_scheduler.LambdaLR(opt, lambda s: 1.0)  # the script's, after retain()
        scanned_frozen: list[bool] = []
        scan = extras.loaders.unretained_loader_iterators

        def loader_scan(named: list) -> list:  # the heap a promoted trainer's scans walk
            scanned_frozen.append(gc.get_freeze_count() > 0)
            return scan(named)

        monkeypatch.setattr(extras.loaders, "unretained_loader_iterators", loader_scan)
        job.begin(0)
        objects = pickle.loads(job.store.records()[-1].payload)["objects"]  # the BEGIN record
        assert {extras.SCHEDULER_PREFIX + type(s).__name__ for s in (early, late)} <= set(objects)
        job.before_commit(0)
        job.begin(1)  # the second step's scan, the last planned one
        assert gc.get_freeze_count() == 0
        # the loader scans walk only the unfrozen heap: not the whole of it in a first step
        assert scanned_frozen == [True, True]
    finally:
        gc.unfreeze()


def test_a_shadow_promoted_to_finish_an_update_scans_loaders_on_the_frozen_heap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Resumed from ``PRE`` (a kill in the update), the second scheduler discovery comes at
    the first step; the heap stays frozen until the second loader scan has run too."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, foreach=True)
    region = _region()
    failed = RetainedExtras(RecordStore(region), opt, None, 0)
    failed.begin(0)
    failed.before_commit(0)
    scanned_frozen: list[bool] = []
    scan = extras.loaders.unretained_loader_iterators

    def loader_scan(named: list) -> list:
        scanned_frozen.append(gc.get_freeze_count() > 0)
        return scan(named)

    monkeypatch.setattr(extras.loaders, "unretained_loader_iterators", loader_scan)
    try:
        frozen = extras.freeze_heap(opt)
        job = RetainedExtras(RecordStore(region), opt, None, 0, frozen)
        job.load_pre(0)
        assert job.resume(1) == "pre"
        job.begin(1)
        job.before_commit(1)
        job.begin(2)
        assert scanned_frozen == [True, True]
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_a_state_in_torch_saves_format_still_loads() -> None:
    """Checkpoints written before records were pickled hold ``torch.save`` bytes."""
    sched_opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, foreach=True)
    sched = lr_scheduler.StepLR(sched_opt, 2)
    for _ in range(3):
        sched_opt.step()
        sched.step()
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    fresh_opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, foreach=True)
    fresh = lr_scheduler.StepLR(fresh_opt, 2)
    extras.Tracked("s", "scheduler", fresh).load(buf.getvalue())
    assert fresh.state_dict() == sched.state_dict()


def test_a_successor_with_other_objects_is_refused() -> None:
    job = Job(region=_region(), scheduler="lambda")
    job.step(0)
    job.extras.begin(1)
    fresh = Job(region=job.region.clone(), scheduler="onecycle")
    with pytest.raises(UnrecoverableStateError, match=r"retained \['lr_scheduler.LambdaLR'\]"):
        fresh.extras.resume(1)


def test_objects_that_are_not_stateful_or_too_large_are_refused_at_retain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
    with pytest.raises(ConfigError, match="has no state_dict"):
        RetainedExtras(RecordStore(_region()), opt, {"x": object()}, 0)
    with pytest.raises(ConfigError, match="reserved"):
        RetainedExtras(RecordStore(_region()), opt, {"optimizer": Counter()}, 0)
    monkeypatch.setattr(extras, "STATE_LIMIT_BYTES", 100)
    with pytest.raises(ConfigError, match="more than the 0 MiB"):
        RetainedExtras(RecordStore(_region()), opt, {"big": torch.nn.Linear(10, 10)}, 0)


def test_hyperparameters_come_back_for_the_finishing_update() -> None:
    """OneCycleLR cycles beta1: the update finished after a recovery must use its step's."""
    job = Job(region=_region(), scheduler="onecycle")
    for t in range(3):
        job.step(t)
    job.step(3, die_at="update")
    betas = job.opt.param_groups[0]["betas"]
    fresh = Job(region=job.region.clone(), scheduler="onecycle")
    assert fresh.opt.param_groups[0]["betas"] != betas
    fresh.extras.load_pre(3)
    assert fresh.opt.param_groups[0]["betas"] == betas


def test_records_name_what_they_hold() -> None:
    job = Job(region=_region(), scheduler="lambda")
    job.step(0)
    record = job.extras.store.latest(Capture.PRE)
    content = pickle.loads(record.payload)
    assert set(content["objects"]) == {"optimizer", "counter", "lr_scheduler.LambdaLR"}
    assert content["kinds"]["lr_scheduler.LambdaLR"] == "scheduler"


class Asked(Counter):
    """A Stateful whose ``state_dict()`` is not free (a StatefulDataLoader builds its iterator)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def state_dict(self) -> dict[str, int]:
        self.asked += 1
        return super().state_dict()


def test_a_restored_object_is_not_asked_before_the_script_ran() -> None:
    asked = Asked()
    job = Job(region=_region(), scheduler="lambda", named={"loader": asked})
    for t in range(3):
        job.step(t)
    job.extras.begin(3)
    fresh_loader = Asked()
    fresh = Job(region=job.region.clone(), scheduler="lambda", named={"loader": fresh_loader})
    assert fresh.extras.resume(3) == "begin"
    before = fresh_loader.asked  # retain() measured it once, before anything was restored
    fresh.extras.begin(3)  # steps()'s first capture: the loaded state, nobody asked
    assert fresh_loader.asked == before
    fresh.extras.before_commit(3)
    assert fresh_loader.asked == before + 1


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_stateful_dataloader_resumes_in_a_later_epoch() -> None:
    """torchdata's loader over a DistributedSampler reshuffled by set_epoch: restored in its
    second epoch, it yields the fault-free batches (its state is not asked before the
    script's set_epoch and iter)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = torch.utils.data.TensorDataset(torch.arange(64.0))

    class Script:
        def __init__(self, region: torch.Tensor) -> None:
            self.sampler = torch.utils.data.DistributedSampler(data, 2, 1, shuffle=True, seed=5)
            self.loader = StatefulDataLoader(data, batch_size=4, sampler=self.sampler)
            self.opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
            self.extras = RetainedExtras(RecordStore(region), self.opt, {"loader": self.loader}, 0)
            self.extras.discover()
            self.it: Any = None

        def step(self, t: int) -> torch.Tensor:
            self.extras.begin(t)
            if self.it is None or t % 8 == 0:  # 8 batches an epoch
                self.sampler.set_epoch(t // 8)
                self.it = iter(self.loader)
            batch = next(self.it)[0]
            self.extras.before_commit(t)
            return batch

    fault_free = Script(_region())
    expected = [fault_free.step(t) for t in range(12)]
    first = Script(_region())
    for t in range(10):
        first.step(t)
    first.extras.begin(10)  # killed in step 10's forward
    fresh = Script(first.extras.store.region.clone())
    assert fresh.extras.resume(10) == "begin"
    fresh.it = None
    assert all(torch.equal(fresh.step(t), expected[t]) for t in (10, 11))


def test_the_commit_digest_follows_the_objects() -> None:
    """What emit_digest adds to the state's digest changes with every scheduler step, so a
    recovery that got a scheduler wrong shows at the next commit."""
    _, digests = _fault_free(scheduler="lambda")
    assert len(set(digests.values())) == STEPS
    job = Job(region=_region(), scheduler="lambda")
    job.step(0)
    before = job.extras.commit_digest
    job.extras.begin(1)
    job.sched.step()  # one scheduler step more than the fault-free run
    job.extras.before_commit(1)
    assert job.extras.commit_digest != digests[2] and before == digests[1]


def test_random_generators_named_come_back() -> None:
    """Generators a script made itself (torch's, NumPy's two kinds, Python's), named in
    ``stateful=``: a trainer killed in a step's compute phase draws again what it drew."""
    import random

    import numpy as np

    def generators() -> dict[str, Any]:
        return {
            "torch": torch.Generator().manual_seed(1),
            "numpy": np.random.default_rng(2),
            "legacy": np.random.RandomState(3),
            "python": random.Random(4),
        }

    def draw(g: dict[str, Any]) -> tuple[float, ...]:
        return (
            float(torch.rand((), generator=g["torch"])),
            float(g["numpy"].random()),
            float(g["legacy"].rand()),
            g["python"].random(),
        )

    def job(region: torch.Tensor, named: dict[str, Any]) -> RetainedExtras:
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
        out = RetainedExtras(RecordStore(region), opt, named, 0)
        out.discover()
        return out

    region, named = _region(), generators()
    first = job(region, named)
    for t in range(2):
        first.begin(t)
        draw(named)
        first.before_commit(t)
    first.begin(2)
    drawn = draw(named)  # step 2's compute phase, then the kill
    again = generators()  # the promoted trainer's script makes them anew
    assert job(region.clone(), again).resume(2) == "begin"
    assert draw(again) == drawn


# -- ReduceLROnPlateau: stepped after the commit with a metric ---------------------------------
LOSSES = [3.0, 2.9, 2.8, 2.7, 1.0, 0.99, 0.98, 0.97, 0.96, 0.95, 0.5, 0.49]
"""Plateaus and drops: the scheduler both keeps and cuts the rate over the job."""


class PlateauJob:
    """A script that steps ``ReduceLROnPlateau(metric)`` after ``state.step(loss=loss)``; the
    metric is the step's loss, or (``stale``) a validation loss read every fourth step."""

    def __init__(self, region: torch.Tensor, stale: bool = False) -> None:
        self.region, self.stale = region, stale
        self.opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
        self.extras = RetainedExtras(RecordStore(region), self.opt, {}, 0)
        self.sched = lr_scheduler.ReduceLROnPlateau(self.opt, factor=0.5, patience=1, threshold=0.5)
        self.extras.discover()

    def state(self) -> tuple[dict[str, Any], float]:
        return self.sched.state_dict(), self.opt.param_groups[0]["lr"]

    def step(self, t: int, die_at: str | None = None) -> bool:
        self.extras.begin(t)
        self.extras.before_commit(t, loss=LOSSES[t])
        if die_at == "update":
            return False
        self.sched.step(LOSSES[t - t % 4] + 0.25 if self.stale else LOSSES[t])
        return True


def _plateau_recovery(job: PlateauJob, kill_step: int) -> PlateauJob:
    """Run ``job`` into a kill inside step ``kill_step``'s update; the promoted trainer's
    objects, resumed at the next step (the finished update's replay included)."""
    for t in range(len(LOSSES)):
        if not job.step(t, die_at="update" if t == kill_step else None):
            break
    return _resume_after(job, kill_step)


def test_a_plateau_scheduler_stepped_with_the_loss_is_replayed_after_a_finished_update() -> None:
    reference = PlateauJob(_region())
    starts = []
    for t in range(len(LOSSES)):
        starts.append(reference.state())
        reference.step(t)
    lrs = {lr for _, lr in starts}
    assert len(lrs) >= 3, "the rate must be cut more than once over the job"
    job = _plateau_recovery(PlateauJob(_region()), 3)
    assert job.state() == starts[4]
    for t in range(4, 7):  # and a second kill after the replayed one, inside step 7's update
        assert job.step(t)
    job.step(7, die_at="update")
    job = _resume_after(job, 7)
    assert job.state() == starts[8]
    for t in range(8, len(LOSSES)):
        assert job.step(t)
    assert job.state() == reference.state()


def _resume_after(job: PlateauJob, kill_step: int) -> PlateauJob:
    fresh = PlateauJob(job.region.clone(), job.stale)
    fresh.extras.load_pre(kill_step)
    assert fresh.extras.resume(kill_step + 1) == "pre+replay"
    return fresh


def test_a_plateau_scheduler_stepped_with_another_metric_is_named_at_once_and_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(UnrecoverableStateError, match="its metric was not that loss"):
        _plateau_recovery(PlateauJob(_region(), stale=True), 5)
    warned = [r.getMessage() for r in caplog.records if "ReduceLROnPlateau" in r.getMessage()]
    assert (
        len(warned) == 1 and "step 0" in warned[0] and "its metric was not that loss" in warned[0]
    )
    with pytest.raises(UnrecoverableStateError, match="no step was observed yet"):
        _plateau_recovery(PlateauJob(_region()), 0)


def test_a_trainer_hands_its_loss_to_the_plateau_capture(monkeypatch, caplog) -> None:
    """``state.step(loss=...)`` passes the loss as a host float where a ReduceLROnPlateau is
    retained, so each step stepped with it counts as replayable."""
    from tests.trainer.local import local_context

    with local_context(monkeypatch) as ctx:
        net = torch.nn.Linear(4, 1)
        state = ctx.retain(net, torch.optim.SGD(net.parameters(), lr=0.1))
        sched = lr_scheduler.ReduceLROnPlateau(state.optimizer, patience=0)

        def compute() -> torch.Tensor:
            loss = net(torch.ones(2, 4)).square().mean()
            loss.backward()
            return loss

        for _ in state.steps(5):
            loss = state.compute(compute)
            state.step(loss=loss)
            sched.step(loss.item())
        assert state.extras._by_step == {"lr_scheduler.ReduceLROnPlateau": 4}
    assert "ReduceLROnPlateau" not in caplog.text


def test_what_a_recovery_could_not_redo_is_named_once_before_any_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    job = Job(region=_region(), scheduler="lambda", counter_after_commit=True)
    for t in range(4):
        assert job.step(t)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "step 0: counter (Counter): its state was changed" in warned[0]
    caplog.clear()
    _stepped_on_odd_steps_only()
    warned = [r.getMessage() for r in caplog.records if "LambdaLR" in r.getMessage()]
    assert len(warned) == 1 and "stepped after state.step() in 1 of 2 steps" in warned[0]


# -- an averaged model (EMA) updated after the commit ------------------------------------------
class EmaJob:
    """A script that averages its model after every ``state.step()``, as torch's loop calls
    ``ema.update_parameters(model)`` after ``optimizer.step()``; ``other``: it averages a
    module that is not the retained model."""

    def __init__(self, region: torch.Tensor, other: bool = False) -> None:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        torch.manual_seed(3)
        self.region = region
        self.model = torch.nn.Linear(3, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.ema = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
        self.averaged = torch.nn.Linear(3, 2) if other else self.model
        self.extras = RetainedExtras(
            RecordStore(region), self.opt, {"ema": self.ema}, 0, model=self.model
        )
        self.extras.discover()

    def update(self, t: int) -> None:
        for i, p in enumerate(self.model.parameters()):
            p.grad = torch.full_like(p, 0.1 * (t + 1) * (i + 1))
        self.opt.step()

    def step(self, t: int, die_at: str | None = None) -> bool:
        self.extras.begin(t)
        self.extras.before_commit(t)
        if die_at == "update":
            return False
        self.update(t)
        self.ema.update_parameters(self.averaged)
        return True

    def state(self) -> list[torch.Tensor]:
        return [
            t.clone() for t in [*self.model.state_dict().values(), *self.ema.state_dict().values()]
        ]


def _ema_recovered(kill_step: int, other: bool = False) -> EmaJob:
    """A job killed inside ``kill_step``'s update; the promoted trainer's, resumed after it."""
    job = EmaJob(_region(), other)
    for t in range(kill_step + 1):
        job.step(t, die_at="update" if t == kill_step else None)
    fresh = EmaJob(job.region.clone(), other)
    fresh.model.load_state_dict(job.model.state_dict())  # the retained, committed parameters
    fresh.extras.load_pre(kill_step)
    fresh.update(kill_step)  # the finishing update
    assert fresh.extras.resume(kill_step + 1) == "pre+replay"
    return fresh


def test_an_averaged_model_is_replayed_over_the_finished_update() -> None:
    reference = EmaJob(_region())
    for t in range(8):
        reference.step(t)
    for kill_step in (3, 6):
        job = _ema_recovered(kill_step)
        for t in range(kill_step + 1, 8):
            assert job.step(t)
        assert all(torch.equal(a, b) for a, b in zip(job.state(), reference.state(), strict=True))


def test_an_averaged_model_of_another_module_is_named_at_once_and_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with pytest.raises(UnrecoverableStateError, match="update_parameters"):
        _ema_recovered(4, other=True)
    warned = [r.getMessage() for r in caplog.records if "AveragedModel" in r.getMessage()]
    assert len(warned) == 1 and "step 0" in warned[0], warned
