"""The resume decision (``decide_resume``) over every rank's marker, without processes."""

from __future__ import annotations

import pytest

from leto.errors import UnrecoverableStateError
from leto.retained.marker import UPDATE_PHASES, Phase
from leto.trainer.resume import ResumeAction, ResumeDecision, decide_resume

IDLE, READY = Phase.IDLE, Phase.GRADS_READY


@pytest.mark.parametrize("phase", [IDLE, READY])
def test_no_rank_began_the_update_so_every_rank_reruns_it(phase: Phase) -> None:
    points = [(5, IDLE), (5, phase), (5, READY)]
    for rank in range(3):
        decision = decide_resume(points, rank)
        assert decision == ResumeDecision(step=5, action=ResumeAction.RERUN)
        assert not decision.finishing


@pytest.mark.parametrize("began", sorted(UPDATE_PHASES))
def test_a_rank_in_an_update_phase_makes_every_rank_at_t_finish(began: Phase) -> None:
    points = [(5, began), (5, READY), (5, began)]
    for rank in range(3):
        decision = decide_resume(points, rank)
        assert decision == ResumeDecision(step=6, action=ResumeAction.FINISH)
        assert decision.finishing


def test_a_rank_at_t_plus_one_makes_the_others_finish_and_itself_continue() -> None:
    points = [(6, IDLE), (5, READY), (5, Phase.CHUNK_SAVED)]
    assert decide_resume(points, 0) == ResumeDecision(step=6, action=ResumeAction.COMMITTED)
    assert decide_resume(points, 0).finishing
    assert decide_resume(points, 1).action == ResumeAction.FINISH
    assert decide_resume(points, 2).action == ResumeAction.FINISH


def test_a_committed_rank_already_past_grads_ready_of_t_plus_one_does_nothing() -> None:
    points = [(6, READY), (5, Phase.UPDATING)]
    assert decide_resume(points, 0) == ResumeDecision(step=6, action=ResumeAction.COMMITTED)


def test_a_single_rank_decides_alone() -> None:
    assert decide_resume([(0, IDLE)], 0) == ResumeDecision(0, ResumeAction.RERUN)
    assert decide_resume([(3, Phase.FLUSHING)], 0) == ResumeDecision(4, ResumeAction.FINISH)


def test_ranks_more_than_a_step_apart_are_unrecoverable() -> None:
    points = [(4, IDLE), (6, IDLE)]
    with pytest.raises(UnrecoverableStateError, match="more than one step apart"):
        decide_resume(points, 0)
    with pytest.raises(UnrecoverableStateError, match="more than one step apart"):
        decide_resume(points, 1)  # every rank refuses, not only the one behind


def test_a_finishing_rank_whose_gradients_were_never_final_is_unrecoverable() -> None:
    points = [(5, IDLE), (5, Phase.UPDATING)]
    with pytest.raises(UnrecoverableStateError, match="rank 0 must finish step 5's update"):
        decide_resume(points, 0)
    assert decide_resume(points, 1).action == ResumeAction.FINISH  # only that rank cannot


def test_a_behind_rank_without_final_gradients_is_unrecoverable() -> None:
    with pytest.raises(UnrecoverableStateError, match="gradients were never final"):
        decide_resume([(5, IDLE), (6, IDLE)], 0)


def test_the_decision_is_frozen() -> None:
    decision = decide_resume([(1, IDLE)], 0)
    with pytest.raises(AttributeError):
        decision.step = 2  # type: ignore[misc]
