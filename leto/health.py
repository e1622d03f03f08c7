"""Trainer heartbeats and failure classes.

Each active trainer bumps a progress counter in a small shared-memory board (one file per
node, mapped by the agent and by every local trainer): at every leaf module's forward, at
every gradient accumulated in backward, around the optimizer step, and once per committed
step. A collective that never returns, a deadlock or a SIGSTOP freezes the counter; the
agent's :class:`HangWatch` sees no progress for ``hang_timeout_s`` (``first_step_timeout_s``
until the trainer's first step, so compilation and data loading are not hangs) and kills
the trainer, which is then recovered like any other crash.

The board costs one increment of a shared 64-bit word per beat: no syscall, no store.
Each slot also carries words for the pre-initialisation controller (``leto.preinit.board``):
the agent and its trainers already share this page, and it is node-local, as shadows are.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV_HEARTBEAT = "LETO_HEARTBEAT_FILE"
_WORDS = 16  # per local rank: progress beats, committed steps, then leto.preinit.board words
_HEARTBEAT_WORDS = 2
_FINISHED = 1 << 63  # set in the steps word once the trainer has run its last step


class FailureClass(str, enum.Enum):
    """How the agent answers a failure.

    HOF (hardware-operable: killed by a signal, or hung and killed) → in-place recovery;
    FF (fatal: the hardware or the retained state is unusable, or the state manager died)
    → group restart from the newest checkpoint; ERROR (the script raised: an in-place
    retry would raise again) → torchrun's group restart.
    """

    HOF = "hof"
    FF = "ff"
    ERROR = "error"


class HeartbeatBoard:
    """The agent's side: a shared file of ``(progress, steps)`` words per local rank.

    The file is a memfd of the agent's; trainers open it as ``/proc/<agent>/fd/<fd>``
    (``path``), so nothing of it is left on disk when the agent is killed."""

    def __init__(self, nslots: int) -> None:
        self._fd = os.memfd_create("leto-heartbeat", os.MFD_CLOEXEC)
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self.nslots = nslots
        os.ftruncate(self._fd, max(mmap.PAGESIZE, nslots * _WORDS * 8))
        self._mm = mmap.mmap(self._fd, 0)
        self._words = (ctypes.c_uint64 * (nslots * _WORDS)).from_buffer(self._mm)

    def read(self, slot: int) -> tuple[int, int]:
        """``(progress, steps)`` of local rank ``slot``."""
        return self._words[slot * _WORDS], self._words[slot * _WORDS + 1]

    def reset(self) -> None:
        """Zero every slot's heartbeat (a new generation of trainers starts counting afresh);
        the other words are counters and reports that outlive a generation."""
        for slot in range(self.nslots):
            for i in range(_HEARTBEAT_WORDS):
                self._words[slot * _WORDS + i] = 0

    def word(self, slot: int, index: int) -> int:
        """Word ``index`` of local rank ``slot`` (indices >= 2: ``leto.preinit.board``)."""
        return self._words[slot * _WORDS + index]

    def set_word(self, slot: int, index: int, value: int) -> None:
        self._words[slot * _WORDS + index] = value

    def close(self) -> None:
        del self._words
        self._mm.close()
        os.close(self._fd)


class Heartbeat:
    """A trainer's side: ``beat()`` for progress, ``stepped()`` after each committed step."""

    def __init__(self, path: str, slot: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._slot = (ctypes.c_uint64 * _WORDS).from_buffer(self._mm, slot * _WORDS * 8)
        self._progress = ctypes.c_uint64.from_buffer(self._mm, slot * _WORDS * 8)
        self._steps = ctypes.c_uint64.from_buffer(self._mm, (slot * _WORDS + 1) * 8)

    @classmethod
    def from_env(cls, local_rank: int) -> Heartbeat | None:
        path = os.environ.get(ENV_HEARTBEAT)
        return cls(path, local_rank) if path else None

    def beat(self, *_: object) -> None:
        """Progress (any arguments are ignored, so this is usable directly as a hook)."""
        self._progress.value += 1

    def stepped(self) -> None:
        self._steps.value += 1
        self._progress.value += 1

    def finished(self) -> None:
        """The training loop is over: what remains (teardown, exit) is not watched."""
        self._steps.value |= _FINISHED

    def word(self, index: int) -> int:
        """Word ``index`` of this rank's slot (indices >= 2: ``leto.preinit.board``)."""
        return self._slot[index]

    def set_word(self, index: int, value: int) -> None:
        self._slot[index] = value


_PF_EXITING = 0x4  # include/linux/sched.h: set as do_exit begins, before memory teardown


def _stat_fields(pid: int) -> list[str]:
    """Fields 3.. of ``/proc/pid/stat`` (after the command name), or [] when it is gone.
    Field n is ``fields[n - 3]``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def proc_state(pid: int) -> str:
    """The state letter of ``pid`` (R, S, D, T, ...), or "?" when it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else "?"


def dying_signal(pid: int) -> int | None:
    """The signal killing ``pid`` while it is still tearing down, else None.

    A process killed by a signal is a zombie (visible to ``waitid``) only after the kernel
    has released its memory and closed its files; on a GPU that includes destroying its
    CUDA context (0.1–0.5 s measured on an H200, bench/teardown_gpu.py). ``do_exit`` sets
    ``PF_EXITING`` and the exit code (field 52, the waitpid status) before that teardown,
    so a reader learns of the death — and can stop the peers, whose teardowns then
    overlap — early. A normal exit (no signal) reads as None.
    """
    fields = _stat_fields(pid)
    if len(fields) < 50 or not int(fields[6]) & _PF_EXITING:  # field 9: flags
        return None
    signo = int(fields[49]) & 0x7F
    return signo or None


@dataclass(frozen=True, slots=True)
class Stall:
    """A local rank that made no progress for longer than its limit."""

    slot: int
    idle_s: float
    limit_s: float


class HangWatch:
    """Turns a :class:`HeartbeatBoard` into stall verdicts (the agent calls ``check`` per poll)."""

    def __init__(
        self,
        board: HeartbeatBoard,
        hang_timeout_s: float,
        first_step_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.board = board
        self.hang_timeout_s = hang_timeout_s
        self.first_step_timeout_s = first_step_timeout_s
        self._clock = clock
        self._seen: list[tuple[int, float]] = []
        self._first_limit_s = first_step_timeout_s
        self.arm()

    def arm(self, *, warm: bool | None = None) -> None:
        """Start watching a new generation: counters zeroed, clocks restarted.

        ``warm``: the generation was pre-initialised (promoted shadows), so its first step
        is held to ``hang_timeout_s``; False: a fresh start (imports, compilation, data
        loading) gets ``first_step_timeout_s``; None keeps the current choice."""
        if warm is not None:
            self._first_limit_s = self.hang_timeout_s if warm else self.first_step_timeout_s
        self.board.reset()
        now = self._clock()
        self._seen = [(0, now)] * self.board.nslots

    def watched(self) -> int:
        """Local ranks still watched: those that have not finished their training loop."""
        return sum(
            1 for slot in range(self.board.nslots) if not self.board.read(slot)[1] & _FINISHED
        )

    def check(self) -> list[Stall]:
        """Ranks over their limit, the one idle longest first (finished ranks never stall)."""
        now = self._clock()
        stalls = []
        for slot in range(self.board.nslots):
            progress, steps = self.board.read(slot)
            last, since = self._seen[slot]
            if progress != last or steps & _FINISHED:
                self._seen[slot] = (progress, now)
                continue
            limit = self._limit(steps)
            if now - since > limit:
                stalls.append(Stall(slot, now - since, limit))
        return sorted(stalls, key=lambda s: -s.idle_s)

    def idle(self, slot: int) -> Stall:
        """How long ``slot`` has been idle, and its current limit (stalled or not)."""
        _, steps = self.board.read(slot)
        return Stall(slot, self._clock() - self._seen[slot][1], self._limit(steps))

    def _limit(self, steps: int) -> float:
        """A slot's limit: the hang timeout once it stepped, its first-step limit before."""
        return self.hang_timeout_s if steps > 0 else self._first_limit_s

    def culprit(self, stalls: list[Stall], states: dict[int, str]) -> Stall | None:
        """The stall to kill, given every watched slot's process state letter, or None yet.

        Peers blocked in a collective with the hung rank stall too, often before it does
        (it was stopped after their last beat). A process that is stopped or in
        uninterruptible sleep is the culprit, stalled past its limit or not; short of one,
        a verdict needs every watched rank stalled: while one still makes progress, the
        stalled ones are waiting for it (a slow peer, not a hang). Then the longest idle
        is blamed.
        """
        if not stalls:
            return None
        stopped = sorted(
            (slot for slot, state in states.items() if state in ("T", "t", "D")),
            key=lambda slot: -self.idle(slot).idle_s,
        )
        if stopped:
            return next((s for s in stalls if s.slot == stopped[0]), None) or self.idle(stopped[0])
        if len(stalls) < self.watched():
            return None
        return stalls[0]
