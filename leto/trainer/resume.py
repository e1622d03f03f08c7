"""Where a promoted trainer resumes: a pure decision over every rank's marker.

After one all-gather of each rank's (step, phase) (``Recovery.points``), the ranks
agree without further messages, because every rank computes the same decision from the
same points:

* some rank is at t+1, or in an update phase of t: step t's gradients were final on every
  rank (the barrier after ``GRADS_READY`` was passed), so every rank still at t finishes
  t's update and training continues at t+1;
* otherwise no rank began t's update: every rank re-runs step t from its forward pass.

Ranks more than one step apart, or a rank that must finish an update whose gradients it
never marked final, are not a state any crash of this protocol leaves behind: resuming
would train on inconsistent state, so the decision is an ``UnrecoverableStateError``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from leto.errors import UnrecoverableStateError
from leto.retained.marker import UPDATE_PHASES, Phase


class ResumeAction(str, enum.Enum):
    """What this rank does before training continues at ``ResumeDecision.step``."""

    FINISH = "finish"
    """Finish step ``step - 1``'s update (its gradients are final on this rank)."""
    COMMITTED = "committed"
    """Nothing: this rank already committed step ``step - 1``, which others finish."""
    RERUN = "rerun"
    """Nothing retained changes: every rank re-runs step ``step`` from its forward pass."""


@dataclass(frozen=True, slots=True)
class ResumeDecision:
    """The agreed resume point, and this rank's part in reaching it."""

    step: int
    """The step every rank's loop resumes at."""
    action: ResumeAction

    @property
    def finishing(self) -> bool:
        """True when step ``step - 1``'s update is being finished (on this rank or others)."""
        return self.action != ResumeAction.RERUN


def decide_resume(points: Sequence[tuple[int, Phase]], rank: int) -> ResumeDecision:
    """The resume point of the ranks whose markers read ``points`` (indexed by rank), and
    what ``rank`` does to reach it; raises ``UnrecoverableStateError`` where no consistent
    point exists."""
    low = min(s for s, _ in points)
    if max(s for s, _ in points) > low + 1:
        raise UnrecoverableStateError(f"ranks are more than one step apart: {list(points)}")
    finish = any(s == low + 1 or (s == low and ph in UPDATE_PHASES) for s, ph in points)
    if not finish:
        return ResumeDecision(step=low, action=ResumeAction.RERUN)
    step, phase = points[rank]
    if step != low:
        return ResumeDecision(step=low + 1, action=ResumeAction.COMMITTED)
    if phase not in UPDATE_PHASES and phase != Phase.GRADS_READY:
        raise UnrecoverableStateError(
            f"rank {rank} must finish step {step}'s update but its gradients were never final"
        )
    return ResumeDecision(step=low + 1, action=ResumeAction.FINISH)
