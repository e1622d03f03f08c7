"""The agent's side of the controller: reclaim the shadows on an OOM, choose their level.

The agent (``leto_run.agent``) owns the shadow processes; this class owns the decisions
and the board words, so both can be driven from a test without processes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from typing import Literal

from leto.errors import ProtocolError
from leto.health import HeartbeatBoard
from leto.preinit import board
from leto.preinit.config import PreinitConfig
from leto.preinit.levels import (
    DeviceMemory,
    LevelChoice,
    ShadowLevel,
    aggregate,
    choose_level,
    footprints,
)

logger = logging.getLogger(__name__)


class ShadowState(str, enum.Enum):
    """The node's shadow generation as the controller sees it::

    NONE ──spawned──▶ LIVE ──reclaimed (an active's OOM)──▶ RECLAIMED
      ▲                │                                        │
      └──closed────────┘ (promoted, group restart, job end,     │ spawned again, once
      │                   died before promotion)                │ every active reported
      └──closed─────────────────────────────────────────────────┘
    """

    NONE = "none"
    LIVE = "live"
    RECLAIMED = "reclaimed"


_TRANSITIONS = {
    ShadowState.NONE: {ShadowState.LIVE},
    ShadowState.LIVE: {ShadowState.NONE, ShadowState.RECLAIMED},
    ShadowState.RECLAIMED: {ShadowState.LIVE, ShadowState.NONE},
}


class PreinitController:
    """Shadow level and reclaim bookkeeping of one node."""

    def __init__(self, config: PreinitConfig, max_level: int, hb_board: HeartbeatBoard) -> None:
        self.config = config
        self.max_level = ShadowLevel(max_level)
        self.level = self.max_level
        """Level of the live generation, or of the last one (the reclaimed or promoted)."""
        self.state = ShadowState.NONE
        self.reclaims = 0
        self._board = hb_board
        self._slots = range(hb_board.nslots)
        self._seq_at_reclaim: list[int] = []
        self._footprint = footprints(config.l2_bytes, config.l3_bytes)
        self._give_up(False)

    def _to(self, state: ShadowState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise ProtocolError(f"shadow state {self.state.value} -> {state.value} is not allowed")
        self.state = state

    def _publish_level(self, level: int, generation: int = 0) -> None:
        for slot in self._slots:
            self._board.set_word(slot, board.SHADOW_READY, 0)
            self._board.set_word(slot, board.SHADOW_GEN, generation)
            self._board.set_word(slot, board.SHADOW_LEVEL, level)

    # -- transitions (the agent calls these as it spawns and stops shadows) ------------------
    def _give_up(self, given_up: bool) -> None:
        for slot in self._slots:
            self._board.set_word(slot, board.SHADOWS_GIVEN_UP, int(given_up))

    def spawned(self, level: ShadowLevel, generation: int) -> None:
        self._to(ShadowState.LIVE)
        self.level = level
        self._give_up(False)
        self._publish_level(int(level), generation)

    def ready(self) -> bool:
        """Every local shadow of the live generation has announced that it waits for promotion."""
        return self.state is ShadowState.LIVE and all(
            board.shadow_ready(functools.partial(self._board.word, s)) for s in self._slots
        )

    def gave_up(self) -> None:
        """The agent stopped relaunching shadows that keep dying: tell the trainers none is coming."""
        self._give_up(True)

    def closed(self) -> None:
        """The shadows are gone for a reason other than a reclaim (or became the actives)."""
        if self.state is not ShadowState.NONE:
            self._to(ShadowState.NONE)
        self._publish_level(0)

    def reclaimed(self) -> None:
        """The shadows were killed and reaped for an active's OOM."""
        self._to(ShadowState.RECLAIMED)
        self._publish_level(0)
        self.reclaims += 1
        self._seq_at_reclaim = [self._board.word(s, board.MEM_SEQ) for s in self._slots]

    # -- requests from the trainers ----------------------------------------------------------
    def requests(self) -> list[int]:
        """Local ranks (slots) waiting for an answer to an OOM."""
        return [
            s
            for s in self._slots
            if self._board.word(s, board.OOM_REQUEST) > self._board.word(s, board.OOM_ACK)
        ]

    def answer(self, slots: list[int], reclaimed_level: int) -> None:
        for s in slots:
            self._board.set_word(s, board.OOM_RECLAIMED, reclaimed_level)
            self._board.set_word(s, board.OOM_ACK, self._board.word(s, board.OOM_REQUEST))

    # -- the level ---------------------------------------------------------------------------
    def relaunch_due(self) -> bool:
        """After a reclaim: every local active has committed a step since (the retried one),
        so its report holds the peak that needed the shadows' memory."""
        return self.state is ShadowState.RECLAIMED and all(
            self._board.word(s, board.MEM_SEQ) > seq
            for s, seq in zip(self._slots, self._seq_at_reclaim, strict=True)
        )

    def reports(self) -> list[DeviceMemory]:
        """The local actives' newest memory reports, one entry per device."""
        rows = [tuple(self._board.word(s, i) for i in board.MEM_WORDS) for s in self._slots]
        return aggregate(r for r in rows if r[1] > 0)  # type: ignore[misc]

    def choose(self, reason: Literal["oom", "recovery"]) -> LevelChoice:
        """The level of the next shadows from the actives' reported peak (paper §6).

        ``oom`` (relaunch after a reclaim): the highest level that fits, and below the
        reclaimed one — the OOM showed that level did not fit — so further reclaims only
        lower it. ``recovery`` (fresh actives, new shadows): raised to the highest level
        that fits, never lowered. Without reports (CPU, no emulation) a reclaim lowers the
        level by one and a recovery returns to the configured level.
        """
        below = ShadowLevel(max(1, self.level - 1))
        fallback = self.max_level if reason == "recovery" else below
        choice = choose_level(
            self.reports(),
            self._footprint,
            max_level=self.max_level,
            margin_bytes=self.config.margin_bytes,
            reason=reason,
            fallback=fallback,
        )
        level = min(choice.level, below) if reason == "oom" else max(choice.level, self.level)
        return dataclasses.replace(choice, level=ShadowLevel(level))
