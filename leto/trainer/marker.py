"""The update marker: the last completed operation of a rank's update, in retained memory.

The marker is the single source of truth a promoted trainer reads to decide where to
resume. Its state word packs ``(step, phase)`` into one aligned 64-bit store, so a kill
can never leave half a transition behind.

Transitions (``t`` = committed optimizer steps)::

    IDLE(t) ──grads final──▶ GRADS_READY(t) ──snapshot taken──▶ UPDATING(t) ──commit──▶ IDLE(t+1)
       ▲                          │                                 │  ▲
       └──── re-run step t ───────┘                                 └──┘ restore + redo

IDLE(t): model state is M_t, gradients are not (yet) final.
GRADS_READY(t): model state is M_t, gradients of step t are final (reduced and clipped).
UPDATING(t): the update of step t has begun; the snapshot holds M_t.
"""

from __future__ import annotations

import enum
import struct

import torch

from leto.errors import InvalidTransitionError, UnrecoverableStateError

MAGIC = 0x4C45544F_4D4B0001  # "LETO" "MK" v1
MARKER_BYTES = 4096
_MAX_LR = (MARKER_BYTES // 8) - 4


class Phase(enum.IntEnum):
    IDLE = 0
    GRADS_READY = 1
    UPDATING = 2


_ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.GRADS_READY}),
    Phase.GRADS_READY: frozenset({Phase.UPDATING, Phase.IDLE}),
    Phase.UPDATING: frozenset({Phase.IDLE}),
}


class Marker:
    """View of the marker words in a retained host region (uint8 tensor of MARKER_BYTES)."""

    def __init__(self, region: torch.Tensor) -> None:
        if region.numel() < MARKER_BYTES:
            raise ValueError(f"marker region must hold {MARKER_BYTES} bytes")
        self._words = region[:MARKER_BYTES].view(torch.int64)

    # -- identity ---------------------------------------------------------------------------
    def is_valid(self) -> bool:
        return int(self._words[0]) == _signed(MAGIC)

    def layout_hash(self) -> int:
        return int(self._words[1])

    def initialise(self, layout_hash: int, step: int = 0) -> None:
        """Mark the state as fully initialised at ``step`` (0, or a loaded checkpoint's)."""
        self._words[1] = layout_hash
        self._words[2] = _pack(step, Phase.IDLE)
        self._words[0] = _signed(MAGIC)

    def check_layout(self, layout_hash: int) -> None:
        if self.layout_hash() != layout_hash:
            raise UnrecoverableStateError(
                "retained state was written by a different model/optimizer layout; "
                "refusing to resume on it (restart the job from a checkpoint)"
            )

    # -- progress ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return int(self._words[2]) >> 8

    @property
    def phase(self) -> Phase:
        return Phase(int(self._words[2]) & 0xFF)

    def advance(self, phase: Phase, step: int | None = None) -> None:
        """Move to ``phase`` (and ``step``), checking the transition table."""
        current = self.phase
        if phase not in _ALLOWED[current]:
            raise InvalidTransitionError(f"marker cannot go from {current.name} to {phase.name}")
        new_step = self.step if step is None else step
        self._words[2] = _pack(new_step, phase)

    # -- update hyper-parameters recorded with GRADS_READY -----------------------------------
    def record_lrs(self, lrs: list[float]) -> None:
        if len(lrs) > _MAX_LR:
            raise ValueError(f"at most {_MAX_LR} parameter groups")
        self._words[3] = len(lrs)
        for i, lr in enumerate(lrs):
            self._words[4 + i] = struct.unpack("<q", struct.pack("<d", lr))[0]

    def recorded_lrs(self) -> list[float]:
        n = int(self._words[3])
        return [struct.unpack("<d", struct.pack("<q", int(self._words[4 + i])))[0] for i in range(n)]


def _pack(step: int, phase: Phase) -> int:
    return (step << 8) | int(phase)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x
