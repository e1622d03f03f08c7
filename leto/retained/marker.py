"""The update marker: the last completed operation of a rank's update, in retained memory.

The marker is the single source of truth a promoted trainer reads to decide where to
resume. Its state word packs ``(step, chunk, parity buffer, phase)`` into one aligned
64-bit store, so a kill can never leave half a transition behind::

    bits 63..32 step   bits 31..9 chunk cursor   bit 8 authoritative parity buffer   bits 7..0 phase

Transitions (``t`` = committed optimizer steps; ``consistency: snapshot`` on the left,
``consistency: rmu`` on the right)::

                               ┌──▶ UPDATING(t) ──commit──▶ IDLE(t+1)          (snapshot)
    IDLE(t) ──▶ GRADS_READY(t) ┤
       ▲             │         └──▶ PARITY_LOADED(t) ──▶ CHUNK_SAVED(t, 0) ──▶ CHUNK_COMMITTED(t, 0)
       └── re-run ───┘                    ──▶ CHUNK_SAVED(t, 1) ──▶ ... ──▶ CHUNK_COMMITTED(t, k-1)
                                          ──▶ FLUSHING(t) ──▶ IDLE(t+1)     (rmu)

IDLE(t): model state is M_t, gradients are not (yet) final.
GRADS_READY(t): model state is M_t, gradients of step t are final (reduced and clipped).
UPDATING(t): the snapshot update of step t has begun; the snapshot holds M_t.
PARITY_LOADED(t): the working parity buffers both hold the host tier-1 parity of M_t.
CHUNK_SAVED(t, j): the undo buffer holds chunk j's pre-update bytes; chunk j may be
    partially updated; the parity buffer ``sel`` matches the data with chunk j undone.
CHUNK_COMMITTED(t, j): chunks 0..j are updated; parity buffer ``sel`` matches the data.
FLUSHING(t): every chunk is committed; parity buffer ``sel`` is being copied to host.

Besides progress the marker keeps the identity of the state it describes: the layout
digest and an :class:`IdentityRecord` of the rank's regions (which state manager made
them, the newest creation serial, a digest of every region's identity), written once when
the state is initialised and covered by a checksum. A successor compares it with what the
state manager holds now (``leto.trainer.memory.RegionMemory.check_identity``), so a region
freed, re-created or replaced since is found before anything resumes on it.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import torch

from leto.errors import InvalidTransitionError, UnrecoverableStateError

MAGIC = 0x4C45544F_4D4B0003  # "LETO" "MK" v3 (identity record)
MARKER_BYTES = 4096
_WORDS = MARKER_BYTES // 8
_IDENTITY = _WORDS - 4
"""Words _IDENTITY .. _IDENTITY + 3: identity digest, instance, last serial, checksum."""
_PASSES = _IDENTITY - 1
"""The backward passes of the last step that recorded them (``record_passes``)."""
_MAX_LR = _PASSES - 4
MAX_CHUNKS = 1 << 23


class RegionIdentityError(UnrecoverableStateError):
    """A retained region is not the one the rank's state was initialised over."""

    def __init__(self, region: str, message: str) -> None:
        super().__init__(message)
        self.region = region
        """The region found lost, re-created or replaced (or "marker")."""


@dataclass(frozen=True, slots=True)
class IdentityRecord:
    """Which regions a rank's state was initialised over (kept in the marker)."""

    digest: int
    """64-bit digest of every (region name, identity) of the rank (``protocol.identity_digest``)."""
    instance: int
    """The state manager instance that made them (64-bit)."""
    last_serial: int
    """The newest region's creation serial: a region made later holds none of that state."""


class Phase(enum.IntEnum):
    IDLE = 0
    GRADS_READY = 1
    UPDATING = 2
    PARITY_LOADED = 3
    CHUNK_SAVED = 4
    CHUNK_COMMITTED = 5
    FLUSHING = 6


UPDATE_PHASES = frozenset(
    {Phase.UPDATING, Phase.PARITY_LOADED, Phase.CHUNK_SAVED, Phase.CHUNK_COMMITTED, Phase.FLUSHING}
)
"""Phases in which this rank has begun (and not yet committed) its optimizer update."""

_ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.GRADS_READY}),
    Phase.GRADS_READY: frozenset({Phase.UPDATING, Phase.PARITY_LOADED, Phase.IDLE}),
    Phase.UPDATING: frozenset({Phase.IDLE}),
    Phase.PARITY_LOADED: frozenset({Phase.CHUNK_SAVED, Phase.FLUSHING}),
    Phase.CHUNK_SAVED: frozenset({Phase.CHUNK_COMMITTED}),
    Phase.CHUNK_COMMITTED: frozenset({Phase.CHUNK_SAVED, Phase.FLUSHING}),
    Phase.FLUSHING: frozenset({Phase.IDLE}),
}


class Marker:
    """View of the marker words in a retained host region (uint8 tensor of MARKER_BYTES).

    ``device_words`` (on GPU): the same host memory as an int64 CUDA tensor (page-locked
    and mapped). Every write is then a one-element fill kernel on the current stream, so
    the marker moves only after the device work queued before it has completed — a kill
    can never leave a marker that claims more than the device did. The trainer reads its
    own writes from a host-side copy (``_words``, Python ints read from the memory at
    construction and by :meth:`reload`: an update reads the marker a few times per chunk);
    a successor reads what actually landed.
    """

    def __init__(self, region: torch.Tensor, device_words: torch.Tensor | None = None) -> None:
        if region.numel() < MARKER_BYTES:
            raise ValueError(f"marker region must hold {MARKER_BYTES} bytes")
        memory = region[:MARKER_BYTES].view(torch.int64)
        if device_words is not None and device_words.numel() * 8 < MARKER_BYTES:
            raise ValueError(f"marker device view must cover {MARKER_BYTES} bytes")
        self._device = device_words
        self._device_word: dict[int, torch.Tensor] = {}  # one-element views, made once each
        self._landmarks: dict[Phase, list[tuple[int, Any]]] = {}
        """Per landmark phase: this process's last ``LANDMARKS_KEPT`` writes of it, oldest
        first, each with its step and an event recorded behind it (``wait_landed``)."""
        self._first_landmark: dict[Phase, int] = {}
        """Per landmark phase: the step of this process's first write of it (an earlier one
        was a predecessor's, and landed before this process read the marker)."""
        self._memory = memory
        self._words: torch.Tensor | list[int] = memory if device_words is None else memory.tolist()

    def reload(self) -> None:
        """Re-read the host copy from the memory (a shadow that mapped the marker ahead
        must, once its predecessor is gone: the words moved on since)."""
        if self._device is not None:
            self._words = self._memory.tolist()

    @property
    def stream_ordered(self) -> bool:
        """Writes land in the current stream's order (the device view), not at once."""
        return self._device is not None

    def _set(self, index: int, value: int) -> None:
        self._words[index] = value
        if self._device is not None:
            word = self._device_word.get(index)
            if word is None:
                word = self._device_word[index] = self._device[index]
            word.fill_(value)  # lands in stream order

    # -- identity ---------------------------------------------------------------------------
    def is_valid(self) -> bool:
        return int(self._words[0]) == _signed(MAGIC)

    def layout_hash(self) -> int:
        return int(self._words[1])

    def initialise(
        self, layout_hash: int, step: int = 0, identity: IdentityRecord | None = None
    ) -> None:
        """Mark the state as fully initialised at ``step`` (0, or a loaded checkpoint's);
        ``identity``: of its regions (None keeps the one recorded, e.g. at a checkpoint load)."""
        if identity is None:
            identity = self.identity(check=False)
        words = (_signed(identity.digest), _signed(identity.instance), identity.last_serial)
        self._set(1, layout_hash)
        for i, word in enumerate(words):
            self._set(_IDENTITY + i, word)
        self._set(_IDENTITY + 3, _checksum(layout_hash, *words))
        self._set(2, pack(step, Phase.IDLE))
        self._set(0, _signed(MAGIC))

    def identity(self, check: bool = True) -> IdentityRecord:
        """The identity record; with ``check``, a record failing its checksum is an error."""
        words = [int(self._words[_IDENTITY + i]) for i in range(4)]
        if check and words[3] != _checksum(self.layout_hash(), *words[:3]):
            raise RegionIdentityError(
                "marker",
                "the marker's identity record fails its checksum (the marker region was overwritten); "
                "refusing to resume on it (restart the job from a checkpoint)",
            )
        return IdentityRecord(words[0] & _MASK64, words[1] & _MASK64, words[2])

    def check_layout(self, layout_hash: int) -> None:
        if self.layout_hash() != layout_hash:
            raise UnrecoverableStateError(
                "retained state was written by a different model/optimizer layout; "
                "refusing to resume on it (restart the job from a checkpoint)"
            )

    # -- progress ---------------------------------------------------------------------------
    @property
    def word(self) -> int:
        return int(self._words[2])

    @property
    def step(self) -> int:
        return self.word >> 32

    @property
    def phase(self) -> Phase:
        return Phase(self.word & 0xFF)

    @property
    def chunk(self) -> int:
        """The chunk cursor (meaningful in CHUNK_SAVED / CHUNK_COMMITTED)."""
        return (self.word >> 9) & (MAX_CHUNKS - 1)

    @property
    def parity_sel(self) -> int:
        """Which of the two working parity buffers is authoritative (rmu phases)."""
        return (self.word >> 8) & 1

    def advance(
        self, phase: Phase, step: int | None = None, *, chunk: int = 0, sel: int | None = None
    ) -> None:
        """Move to ``phase`` (and ``step``, chunk, parity buffer), checking the transitions.

        Chunk transactions must follow one another: CHUNK_SAVED(j) comes after
        PARITY_LOADED (j = 0) or CHUNK_COMMITTED(j - 1), CHUNK_COMMITTED(j) after
        CHUNK_SAVED(j).
        """
        current, cur_chunk = self.phase, self.chunk
        if phase not in _ALLOWED[current]:
            raise InvalidTransitionError(f"marker cannot go from {current.name} to {phase.name}")
        if phase == Phase.CHUNK_SAVED:
            expected = 0 if current == Phase.PARITY_LOADED else cur_chunk + 1
            if chunk != expected:
                raise InvalidTransitionError(
                    f"chunk {chunk} saved after {current.name}({cur_chunk}); expected {expected}"
                )
        if phase == Phase.CHUNK_COMMITTED and chunk != cur_chunk:
            raise InvalidTransitionError(
                f"chunk {chunk} committed while chunk {cur_chunk} is in flight"
            )
        if not 0 <= chunk < MAX_CHUNKS:
            raise ValueError(f"chunk {chunk} out of range")
        new_step = self.step if step is None else step
        new_sel = self.parity_sel if sel is None else sel
        self._set(2, pack(new_step, phase, chunk, new_sel))
        if self._device is not None and phase in LANDMARKS:
            self._first_landmark.setdefault(phase, new_step)
            marks = self._landmarks.setdefault(phase, [])
            if len(marks) < LANDMARKS_KEPT:
                event = _landmark_event(self._device.device)
            else:
                event = marks.pop(0)[1]  # the oldest's event, recorded again
            if event is not None:
                event.record(_current_stream(self._device.device))  # the write's stream
                marks.append((new_step, event))

    def wait_landed(self, phase: Phase, step: int) -> None:
        """Block the host until this process's write of ``phase`` at ``step`` has landed.

        A stream-ordered marker moves when the device gets there, and the host may run
        ahead of it: host-side state that a resume from an earlier marker needs (the
        stateful objects' records, ``leto.trainer.extras``) must outlive the marker's
        passing it. This waits for the event behind that write, or behind the oldest later
        one kept (further in its stream); a write this process did not make, or a marker
        written by the host, has landed already."""
        if step < self._first_landmark.get(phase, step + 1):
            return
        later = [(s, event) for s, event in self._landmarks.get(phase, ()) if s >= step]
        if later:
            min(later, key=lambda mark: mark[0])[1].synchronize()

    # -- update hyper-parameters recorded with GRADS_READY -----------------------------------
    def record_lrs(self, lrs: list[float]) -> None:
        """The update's learning rates. A word that already holds its value is not written
        again (on GPU a write is a kernel launch): these words are written on the current
        stream only, so the earlier write of that value lands before anything queued now."""
        if len(lrs) > _MAX_LR:
            raise ValueError(f"at most {_MAX_LR} parameter groups")
        words = [len(lrs), *(struct.unpack("<q", struct.pack("<d", lr))[0] for lr in lrs)]
        for i, word in enumerate(words, start=3):
            if int(self._words[i]) != word:
                self._set(i, word)

    def record_passes(self, passes: int) -> None:
        """The step's backward passes, with its gradients (plain data parallelism's buckets
        launch during the pass the last step ran last: ``leto.trainer.grad_buckets``)."""
        if int(self._words[_PASSES]) != passes:
            self._set(_PASSES, passes)

    def recorded_passes(self) -> int:
        return int(self._words[_PASSES])

    def recorded_lrs(self) -> list[float]:
        n = int(self._words[3])
        return [
            struct.unpack("<d", struct.pack("<q", int(self._words[4 + i])))[0] for i in range(n)
        ]


LANDMARKS = frozenset({Phase.GRADS_READY, Phase.IDLE})
"""Phases whose stream-ordered writes :meth:`Marker.wait_landed` can wait for."""
LANDMARKS_KEPT = 4
"""Writes of each landmark phase whose events are kept: the stateful objects' records wait
for one up to three steps back (``leto.trainer.extras.SLOTS``)."""


def _landmark_event(device: torch.device) -> Any:
    """An event to record behind a landmark write on ``device`` (None: writes land at once)."""
    return torch.cuda.Event() if device.type == "cuda" else None


def _current_stream(device: torch.device) -> Any:
    """The stream a write to ``device`` is queued on now (None off CUDA)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def pack(step: int, phase: Phase, chunk: int = 0, sel: int = 0) -> int:
    """The 64-bit state word (signed, as the int64 view stores it)."""
    return _signed((step << 32) | (chunk << 9) | (sel << 8) | int(phase))


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_MASK64 = (1 << 64) - 1


def _checksum(*words: int) -> int:
    data = struct.pack(f"<{len(words)}q", *words)
    return _signed(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little"))
