"""The failure policy as a pure function: the facts of one failure in, one decision out.

The agent gathers :class:`FailureFacts` (what failed, what this node still has) and
carries out the :class:`Decision`; nothing here touches a process, a store or a clock,
so every branch is unit-tested without an agent (``tests/launcher/test_policy.py``).

While the retained state is intact a hardware-operable failure never costs the job:

* shadows of the next generation live on every node → promote them (``PROMOTE``; a
  shadow still pre-initialising is promoted too: it attaches when it gets there);
* a node has none (they were given up, reclaimed for an OOM, or the failure struck
  before replacements existed) → start a *cold* generation that attaches to the
  retained state at once (``PROMOTE_COLD``);
* only retained state that is unusable (a dead state manager, a fatal failure, a
  trainer that raised) or a failure loop (``failure_loop_limit`` failures in a row
  without a committed step) takes torchrun's group restart (``RESTART``).

A trainer killed before every rank's state was retained (while the script builds or
loads its model, or its checkpoint, after ``leto.init()``) leaves nothing to recover in
place and nothing trained since the attempt began to lose: the attempt starts afresh
(``FRESH_START``), a group restart that ``--max-restarts`` does not count, up to
``failure_loop_limit`` times in a job.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from leto.health import FailureClass


class Action(str, enum.Enum):
    """What every node does for one failure."""

    PROMOTE = "promote"
    """Promote the live shadows of the next generation (ready or still starting)."""
    PROMOTE_COLD = "promote_cold"
    """Start a fresh generation and promote it at once; it attaches to the retained state."""
    RESTART = "restart"
    """torchrun's group restart: trainers load the newest complete checkpoint."""
    FRESH_START = "fresh_start"
    """A group restart before anything was retained, not counted against ``--max-restarts``."""

    @property
    def in_place(self) -> bool:
        return self not in (Action.RESTART, Action.FRESH_START)


@dataclass(frozen=True, slots=True)
class FailureFacts:
    """What the deciding agent knows when a failure is seen."""

    failure: FailureClass
    in_place_enabled: bool
    """``leto.recovery: in_place`` and the job uses leto (a plain script never recovers in place)."""
    state_manager_alive: bool
    shadows_everywhere: bool
    """Every node has a live (spawned, not dead) shadow generation for the next generation."""
    multi_node: bool
    failures_without_progress: int
    """Failures in a row, this one included, since a generation last committed a step."""
    failure_loop_limit: int
    retained_everywhere: bool = True
    """Every rank's state is retained (``contract.retained``)."""
    fresh_starts: int = 0
    """``FRESH_START`` decisions so far in this job."""
    no_shadows_reason: str = ""
    """Why this node has no shadows (shadows given up, reclaimed...), for the reason line."""
    state_manager_exit: str = ""
    """How the state manager ended, when it is dead (``exit code 1``, ``signal 9``)."""


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str


def decide(facts: FailureFacts) -> Decision:
    """The job-wide answer to one failure (see the module docstring)."""
    if facts.failure is FailureClass.ERROR:
        return Decision(
            Action.RESTART,
            "trainer exited with an error"
            + (
                " (no other node reported a failure: is another node's agent gone?)"
                if facts.multi_node
                else ""
            ),
        )
    if facts.failure is FailureClass.FF:
        if not facts.state_manager_alive:
            how = f" ({facts.state_manager_exit})" if facts.state_manager_exit else ""
            return Decision(Action.RESTART, f"the state manager died{how}: retained state is lost")
        return Decision(Action.RESTART, "fatal failure: hardware or retained state unusable")
    if not facts.in_place_enabled:
        return Decision(Action.RESTART, "trainer killed (in-place recovery is off)")
    if not facts.retained_everywhere:
        if facts.fresh_starts < facts.failure_loop_limit:
            return Decision(
                Action.FRESH_START,
                "trainer killed before every rank retained its state (nothing trained since "
                "this attempt began): it starts afresh, not counted against --max-restarts",
            )
        return Decision(
            Action.RESTART,
            f"trainer killed before every rank retained its state, {facts.fresh_starts} fresh "
            f"starts already (leto.failure_loop_limit {facts.failure_loop_limit})",
        )
    if facts.failures_without_progress >= facts.failure_loop_limit:
        return Decision(
            Action.RESTART,
            (
                f"trainer killed {facts.failures_without_progress} times in a row without committing a step "
                f"(leto.failure_loop_limit {facts.failure_loop_limit})"
            ),
        )
    if facts.shadows_everywhere:
        return Decision(Action.PROMOTE, "trainer killed")
    why = f" ({facts.no_shadows_reason})" if facts.no_shadows_reason else ""
    return Decision(
        Action.PROMOTE_COLD,
        f"trainer killed, no shadows on every node{why}: a cold generation attaches",
    )
