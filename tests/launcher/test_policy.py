"""The failure policy (``leto_run.policy.decide``) branch by branch, without an agent."""

from __future__ import annotations

import dataclasses

import pytest

from leto.health import FailureClass
from leto_run.policy import Action, FailureFacts, decide

HOF = FailureFacts(
    failure=FailureClass.HOF,
    in_place_enabled=True,
    state_manager_alive=True,
    shadows_everywhere=True,
    multi_node=False,
    failures_without_progress=1,
    failure_loop_limit=16,
)


def test_a_killed_trainer_with_shadows_everywhere_promotes_them() -> None:
    assert decide(HOF) == decide(dataclasses.replace(HOF, multi_node=True))
    assert decide(HOF).action is Action.PROMOTE


@pytest.mark.parametrize("multi_node", [False, True])
def test_without_shadows_a_cold_generation_attaches_instead_of_a_restart(multi_node: bool) -> None:
    facts = dataclasses.replace(
        HOF, shadows_everywhere=False, multi_node=multi_node, no_shadows_reason="given up"
    )
    decision = decide(facts)
    assert decision.action is Action.PROMOTE_COLD and decision.action.in_place
    assert "given up" in decision.reason


def test_repeated_failures_before_any_step_stop_at_the_loop_limit() -> None:
    assert decide(dataclasses.replace(HOF, failures_without_progress=15)).action is Action.PROMOTE
    decision = decide(dataclasses.replace(HOF, failures_without_progress=16))
    assert decision.action is Action.RESTART and "16 times in a row" in decision.reason


def test_unusable_state_and_script_errors_restart_the_group() -> None:
    dead = dataclasses.replace(
        HOF, failure=FailureClass.FF, state_manager_alive=False, state_manager_exit="signal 9"
    )
    assert decide(dead) == decide(dead)  # pure
    assert (
        decide(dead).action is Action.RESTART
        and "state manager died (signal 9)" in decide(dead).reason
    )
    fatal = decide(dataclasses.replace(HOF, failure=FailureClass.FF))
    assert fatal.action is Action.RESTART and "fatal failure" in fatal.reason
    error = decide(dataclasses.replace(HOF, failure=FailureClass.ERROR, multi_node=True))
    assert error.action is Action.RESTART and "another node's agent" in error.reason
    off = decide(dataclasses.replace(HOF, in_place_enabled=False))
    assert off.action is Action.RESTART and "off" in off.reason


def test_a_kill_before_every_rank_retained_its_state_starts_the_job_afresh() -> None:
    """Nothing to recover in place and nothing trained to lose: a group restart that
    ``--max-restarts`` does not count, up to the loop limit; shadows or not."""
    early = dataclasses.replace(HOF, retained_everywhere=False)
    for shadows in (True, False):
        decision = decide(dataclasses.replace(early, shadows_everywhere=shadows))
        assert decision.action is Action.FRESH_START and not decision.action.in_place
        assert "not counted" in decision.reason
    spent = decide(dataclasses.replace(early, fresh_starts=16))
    assert spent.action is Action.RESTART and "16 fresh starts" in spent.reason
    error = decide(dataclasses.replace(early, failure=FailureClass.ERROR))
    assert error.action is Action.RESTART  # a script's error is not a kill
