"""Every retained region carries its identity, checked before a successor resumes.

A region freed behind the marker's back (or made anew, or replaced after a shadow mapped
it) must never be resumed on as if it were the retained state: the successor raises
``RegionIdentityError`` (an ``UnrecoverableStateError``) naming the region, and emits an
``unrecoverable_state`` event. Unit tests drive ``RegionMemory`` against a real state
manager; the job test drops a region at a kill (``FaultSpec.drop_region``) in a real
leto-run job, whose promoted shadow must refuse to resume.
"""

from __future__ import annotations

import pytest
import torch

from leto.config import FaultSpec
from leto.events import EventLog, Kind, read_events
from leto.pool.client import RankIdentities
from leto.pool.process import StateManagerProcess
from leto.retained.marker import MARKER_BYTES, IdentityRecord, Marker, RegionIdentityError
from leto.trainer.memory import RegionMemory, identity_problem
from tests.launcher.harness import run_leto

PAGE = 4096
LAYOUT = 0x1234


@pytest.fixture
def sm():
    proc = StateManagerProcess.start()
    yield proc
    proc.stop()


class Trainer:
    """One process's view of rank 0: a two-chunk device region "state" and a marker."""

    def __init__(self, sm: StateManagerProcess, events: EventLog) -> None:
        self.pool = sm.client()
        self.memory = RegionMemory(self.pool, 0, torch.device("cpu"))
        self.state, _ = self.memory.device_region("state", 2 * PAGE, PAGE)
        self.marker = Marker(self.memory.host_region("marker", MARKER_BYTES)[0])
        self.events = events

    def initialise(self) -> None:
        """What a first trainer does: fill the state, record identities, mark, seal."""
        self.state.fill_(7)
        record = self.memory.identity_record()
        self.marker.initialise(LAYOUT, identity=record)
        self.memory.seal(record)

    def check(self) -> None:
        self.memory.check_identity(self.marker, self.marker.is_valid(), self.events)


def _events(tmp_path) -> EventLog:
    return EventLog(tmp_path / "events.jsonl", "test")


def _unrecoverable(tmp_path) -> list[tuple[int, str]]:
    return [
        (e["rank"], e["region"])
        for e in read_events(tmp_path / "events.jsonl")
        if e["kind"] == Kind.UNRECOVERABLE
    ]


def test_a_successor_over_the_same_regions_passes(sm, tmp_path) -> None:
    Trainer(sm, _events(tmp_path)).initialise()
    successor = Trainer(sm, _events(tmp_path))
    assert successor.marker.is_valid() and int(successor.state[0]) == 7
    successor.check()
    successor.marker.initialise(LAYOUT, step=5)  # a checkpoint load keeps the record
    successor.check()
    assert _unrecoverable(tmp_path) == []


def test_a_region_freed_and_made_anew_is_refused(sm, tmp_path) -> None:
    """The successor's attach creates "state" afresh (zeros): it holds none of the state."""
    Trainer(sm, _events(tmp_path)).initialise()
    sm.client().free(0, "state")
    successor = Trainer(sm, _events(tmp_path))
    assert (
        successor.marker.is_valid() and int(successor.state[0]) == 0
    )  # what used to be resumed on
    with pytest.raises(
        RegionIdentityError, match="'state' was made after the rank's state was initialised"
    ) as e:
        successor.check()
    assert e.value.region == "state"
    assert _unrecoverable(tmp_path) == [(0, "state")]


def test_a_region_freed_after_a_shadow_mapped_it_is_refused(sm, tmp_path) -> None:
    """The shadow still maps the old memory (its contents are intact), but the state
    manager no longer holds it: the next failure would lose it."""
    Trainer(sm, _events(tmp_path)).initialise()
    shadow = Trainer(sm, _events(tmp_path))
    sm.client().free(0, "state")
    with pytest.raises(RegionIdentityError, match="'state' is no longer held by the state manager"):
        shadow.check()


def test_a_region_replaced_after_a_shadow_mapped_it_is_refused(sm, tmp_path) -> None:
    Trainer(sm, _events(tmp_path)).initialise()
    shadow = Trainer(sm, _events(tmp_path))
    other = sm.client()
    other.free(0, "marker")
    other.alloc(0, "marker", MARKER_BYTES, "uint8", "host")
    with pytest.raises(
        RegionIdentityError, match="'marker' was replaced after this process mapped it"
    ):
        shadow.check()


def test_a_lost_marker_is_refused_not_started_over(sm, tmp_path) -> None:
    """The marker region itself made anew reads as never initialised; the seal says otherwise."""
    Trainer(sm, _events(tmp_path)).initialise()
    sm.client().free(0, "marker")
    successor = Trainer(sm, _events(tmp_path))
    assert not successor.marker.is_valid()
    with pytest.raises(
        RegionIdentityError, match="'marker' was lost, though the rank's state was initialised"
    ):
        successor.check()
    assert _unrecoverable(tmp_path) == [(0, "marker")]


def test_after_a_reset_a_fresh_start_is_allowed(sm, tmp_path) -> None:
    Trainer(sm, _events(tmp_path)).initialise()
    sm.reset()  # a group restart drops every region and seal
    fresh = Trainer(sm, _events(tmp_path))
    assert not fresh.marker.is_valid()
    fresh.check()
    fresh.initialise()
    Trainer(sm, _events(tmp_path)).check()


def test_a_scribbled_identity_record_is_refused(sm, tmp_path) -> None:
    first = Trainer(sm, _events(tmp_path))
    first.initialise()
    first.marker._words[MARKER_BYTES // 8 - 2] += 1  # the record's last serial
    with pytest.raises(RegionIdentityError, match="fails its checksum"):
        Trainer(sm, _events(tmp_path)).check()


def test_regions_of_another_state_manager_instance_are_refused() -> None:
    """A marker read from one state manager's memory, regions held by another (restarted)."""
    record = IdentityRecord(digest=1, instance=0xAAAA, last_serial=2)
    now = RankIdentities("bbbb", {"marker": "bbbb:1", "state": "bbbb:2"}, None)
    assert identity_problem(record, now, seen={}) == (
        "marker",
        "was made by another state manager (it was restarted)",
    )
    same = RankIdentities("aaaa", {"marker": "aaaa:1", "state": "aaaa:2"}, None)
    record = IdentityRecord(int(same.digest(), 16), 0xAAAA, 2)
    assert identity_problem(record, same, seen=same.regions) is None
    assert identity_problem(record, same, seen={"state": "aaaa:3"}) == (
        "state",
        "was replaced after this process mapped it",
    )


@pytest.mark.timeout(300)
def test_a_job_whose_region_is_dropped_at_a_kill_does_not_resume(tmp_path) -> None:
    """rank 1 is killed at step 5 and its "state" region dropped from the state manager at
    the kill; its shadow (ready 2 steps earlier, so it mapped the region ahead) must not
    resume: an unrecoverable_state event names the region, and no trainer resumes."""
    fault = FaultSpec(
        rank=1, step=5, phase="backward", drop_region="state", shadow_ready_steps_before=2
    )
    proc, events = run_leto(tmp_path, steps=8, faults=[fault])
    kinds = [e["kind"] for e in events]
    assert Kind.FAULT_INJECTED in kinds, proc.stderr[-3000:]
    unrecoverable = [e for e in events if e["kind"] == Kind.UNRECOVERABLE]
    assert [(e["rank"], e["region"]) for e in unrecoverable] == [(1, "state")], proc.stderr[-3000:]
    assert "'state' is no longer held by the state manager" in unrecoverable[0]["error"]
    assert [e for e in events if e["kind"] == Kind.RESUMED] == []
    assert proc.returncode != 0
