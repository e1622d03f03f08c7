"""Shadows that die before promotion: the agent sees it, retracts them and relaunches them,
or, when they keep dying, stops relaunching them (the next failure starts a cold generation). Real leto-run jobs,
2 CPU ranks, real SIGKILLs; digests equal the fault-free run's."""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from leto_run.agent import COLD_LAUNCH
from tests.launcher.harness import assert_exact, fault_free_digests, run_leto

STEPS = 16
SIGKILL = 9


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], set[str]]:
    return fault_free_digests(tmp_path_factory.mktemp("ref"), steps=STEPS)


def _kinds(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


@pytest.mark.timeout(240)
def test_killed_shadow_is_replaced_and_the_next_kill_recovers_in_place(tmp_path, reference) -> None:
    faults = [
        FaultSpec(rank=1, step=4, kind="kill_shadow"),  # returns once the agent retracted it
        FaultSpec(
            rank=1, step=9, phase="backward", shadow_ready_steps_before=2
        ),  # waits for the replacement
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    assert [e["fault_kind"] for e in _kinds(events, Kind.FAULT_INJECTED)] == ["kill_shadow", "kill"]
    (died,) = _kinds(events, Kind.SHADOW_DIED)
    assert (died["rank"], died["gen"], died["signal"], died["exitcode"]) == (1, 1, SIGKILL, None), (
        died
    )
    assert died["level"] == 3 and died["deaths"] == 1
    launches = [(e["gen"], e["launch"]) for e in _kinds(events, Kind.SHADOWS_SPAWNED)]
    assert launches[:2] == [(1, 0), (1, 1)], (
        launches
    )  # the replacement, same generation, same level
    assert _kinds(events, Kind.SHADOWS_SPAWNED)[1]["level"] == 3
    assert not _kinds(events, Kind.SHADOWS_GIVEN_UP)
    (epoch,) = _kinds(events, Kind.EPOCH)
    assert (epoch["action"], epoch["failure"]) == ("in_place", "hof")
    promoted = _kinds(events, Kind.PROMOTED)
    assert {e["rank"] for e in promoted} == {0, 1} and {e["gen"] for e in promoted} == {1}
    # The promoted shadows are the replacement's: they announced ready after the death.
    ready = [e for e in _kinds(events, Kind.SHADOW_READY) if e["gen"] == 1 and e["t"] > died["t"]]
    assert {e["rank"] for e in ready} == {0, 1}, ready
    assert not _kinds(events, Kind.GROUP_RESTART)
    (done,) = _kinds(events, Kind.JOB_FINISHED)
    assert (done["restarts"], done["recoveries"]) == (0, 1)


LIMIT = 2  # preinit.shadow_deaths_limit (default 3): the setting reaches the agent


LOOP = 3  # leto.failure_loop_limit


@pytest.mark.timeout(300)
def test_shadows_that_keep_dying_are_given_up_and_a_failure_loop_restarts_the_group(
    tmp_path, reference
) -> None:
    """Shadows given up, then a kill: a cold generation tries to attach, but it starts the
    same way and dies too (every launch of rank 1 crashes); after ``failure_loop_limit``
    failures without a committed step the group restarts from the checkpoint."""
    faults = [
        FaultSpec(rank=1, step=0, kind="shadow_crash"),  # every launch of rank 1's shadow dies
        # waits until the agent gave up relaunching (no shadow will be ready), then dies
        FaultSpec(rank=1, step=9, phase="backward", shadow_ready_steps_before=2),
    ]
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        faults=faults,
        leto={"preinit": {"shadow_deaths_limit": LIMIT}, "failure_loop_limit": LOOP},
        extra=[
            "--max-restarts",
            "1",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--checkpoint-every",
            "4",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    (restart,) = _kinds(events, Kind.GROUP_RESTART)
    before = [e for e in events if e["t"] < restart["t"]]
    # Generation 1's shadows died LIMIT times, then were given up; the replacements spawned
    # at each promotion die as well, and one may be seen before the restart, or not.
    died = [e for e in _kinds(before, Kind.SHADOW_DIED) if e["gen"] == 1]
    assert [e["deaths"] for e in died] == list(range(1, LIMIT + 1)), died
    later = [e for e in _kinds(before, Kind.SHADOW_DIED) if e["gen"] != 1]
    assert all(e["rank"] == 1 for e in died + later) and all(e["gen"] > 1 for e in later), later
    launches = [(e["gen"], e["launch"]) for e in _kinds(before, Kind.SHADOWS_SPAWNED)]
    # gen 1 launched LIMIT times, then a cold gen 1; then at each promotion replacements
    # (which die as well: the next generation is theirs if still alive, else cold)
    assert launches[: LIMIT + 1] == [(1, n) for n in range(LIMIT)] + [(1, COLD_LAUNCH)], launches
    assert all(launch in (0, COLD_LAUNCH) and gen > 1 for gen, launch in launches[LIMIT + 1 :]), (
        launches
    )
    # gen 1's shadows are given up first; on a loaded machine a replacement spawned at a
    # promotion may die before the restart too and be given up at once (the attempt's count
    # of deaths in a row is past the limit already)
    given_up, *more = _kinds(before, Kind.SHADOWS_GIVEN_UP)
    assert (given_up["gen"], given_up["deaths"], given_up["rank"]) == (1, LIMIT, 1), given_up
    assert all(e["deaths"] >= LIMIT and e["rank"] == 1 for e in more), more
    epochs = _kinds(before, Kind.EPOCH)
    assert [(e["action"], e["failure"]) for e in epochs] == [("in_place", "hof")] * (LOOP - 1) + [
        ("restart", "hof")
    ]
    assert epochs[0]["cold"] and f"died {LIMIT} times in a row" in epochs[0]["reason"], epochs[0]
    assert f"killed {LOOP} times in a row without committing a step" in restart["reason"], restart
    assert "killed 3 times in a row" in proc.stderr  # one log line names it
    assert not _kinds(before, Kind.PROMOTED)  # no cold generation got past its pre-initialisation
    loaded = _kinds(events, Kind.CHECKPOINT_LOADED)
    assert {e["rank"] for e in loaded} == {0, 1} and loaded[0]["step"] in (4, 8)
    (done,) = _kinds(events, Kind.JOB_FINISHED)
    assert done["restarts"] == 1
