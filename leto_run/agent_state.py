"""The agent's runtime state as named objects (``leto_run.agent.LetoAgent`` holds them).

* :class:`Phase` — where the node's agent is; its transitions are checked.
* :class:`Attempt` — everything one group attempt owns (its stores, epoch board, hang
  watch, pre-initialisation controller, generation counter, ...), built fresh by
  ``_start_workers`` so nothing of a previous attempt leaks into the next.
* :class:`ShadowGeneration` — one launch of the next generation's shadows (its PContext,
  pidfds, level, launch number), torn down through its one :meth:`~ShadowGeneration.retire`.
* :class:`Pidfds` and :func:`detect_kill` — how a watched child ended, without reaping it;
  :class:`Detection` is the kill seen that way, :class:`Recovery` the promotion in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import signal
import subprocess
import time
from collections.abc import Iterable

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import PContext

from leto.epoch import EpochBoard
from leto.errors import InvalidTransitionError
from leto.health import HangWatch, dying_signal
from leto.preinit.controller import PreinitController
from leto.preinit.levels import ShadowLevel


class Phase(str, enum.Enum):
    """Where this node's agent is::

        STOPPED ──start──▶ STARTING ──every active called leto.init()──▶ RUNNING
                           (a plain script stays here)                   │    ▲
                                                                 promoted│    │ every promoted
                                                                         ▼    │ trainer stepped
                                                promoted again ⟲ RECOVERING ──┘
        RUNNING, RECOVERING ──a restart record──▶ RESTARTING
        any phase ──workers stopped──▶ STOPPED

    Workers stop for a group restart or at the job's end.
    A trainer's death seen early (:class:`Detection`) is not a phase: it happens in RUNNING
    or RECOVERING and ends in the decision that moves the phase on.
    """

    STOPPED = "stopped"
    """No workers: before the first attempt, between attempts, after the run."""
    STARTING = "starting"
    """The attempt's actives run; not every one has called ``leto.init()`` yet."""
    RUNNING = "running"
    """Every active registered: shadows are kept and failures are handled in place."""
    RECOVERING = "recovering"
    """A generation was promoted; not every promoted trainer has stepped yet."""
    RESTARTING = "restarting"
    """The job-wide decision is torchrun's group restart; torch stops the workers next."""

    @property
    def uses_leto(self) -> bool:
        """The attempt's trainers use leto (their failures are the agent's to decide)."""
        return self in (Phase.RUNNING, Phase.RECOVERING, Phase.RESTARTING)

    def to(self, phase: Phase) -> Phase:
        """``phase``, when the table allows going there from this one; raises otherwise."""
        if phase not in _TRANSITIONS[self]:
            raise InvalidTransitionError(
                f"agent phase {self.value} -> {phase.value} is not allowed"
            )
        return phase


_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.STOPPED: frozenset({Phase.STOPPED, Phase.STARTING}),
    Phase.STARTING: frozenset({Phase.STOPPED, Phase.RUNNING}),
    Phase.RUNNING: frozenset({Phase.STOPPED, Phase.RECOVERING, Phase.RESTARTING}),
    Phase.RECOVERING: frozenset({Phase.STOPPED, Phase.RUNNING, Phase.RECOVERING, Phase.RESTARTING}),
    Phase.RESTARTING: frozenset({Phase.STOPPED}),
}


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessExit:
    """How a watched process ended: by ``signal``, or with ``exitcode`` (both None: it was
    reaped elsewhere, e.g. by torch's PContext, and its status is gone)."""

    signal: int | None = None
    exitcode: int | None = None


def close_processes(pcontext: PContext, sig: signal.Signals, timeout: float = 5.0) -> None:
    """Signal and reap every process of ``pcontext`` (torch's ``close``). torch signals each
    live one's process group (``killpg``), which raises ``ProcessLookupError`` half-way, the
    rest unsignalled, for one that exited since torch's poll, and for a worker the fork
    server has just forked, before its ``setsid``: no group of that id exists yet. Each
    live process is then signalled by its pid and waited for, and closing again skips the
    ones gone (they are reaped)."""
    for attempt in range(3):
        try:
            pcontext.close(death_sig=sig, timeout=timeout)
            return
        except ProcessLookupError:
            if attempt == 2:
                raise
            for handler in getattr(pcontext, "subprocess_handlers", {}).values():
                if handler.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(handler.proc.pid, sig)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        handler.proc.wait(timeout)


class Pidfds:
    """One pidfd per watched child, opened on first look and kept until :meth:`close`."""

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._fds)

    def exit_of(self, pid: int) -> ProcessExit | None:
        """How ``pid`` (a child) ended, without reaping it; None while it lives. A signal is
        seen already while the kernel tears the process down (``dying_signal``). Raises
        OSError when pidfds are unavailable."""
        fd = self._fds.get(pid)
        if fd is None:
            try:
                fd = self._fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                return ProcessExit()
        try:
            info = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # already reaped (by torch's PContext)
            return ProcessExit()
        if info is None:
            signo = dying_signal(pid)
            return None if signo is None else ProcessExit(signal=signo)
        if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            return ProcessExit(signal=info.si_status)
        return ProcessExit(exitcode=info.si_status)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclasses.dataclass(frozen=True, slots=True)
class Detection:
    """A trainer seen killed by a signal before torch's poll reports its failure."""

    t: float
    """When the agent saw it (``time.time()``): the recovery's start."""
    root_pid: int
    """The killed trainer: the root cause; its peers were SIGKILLed after it."""


def detect_kill(pids: Iterable[int], pidfds: Pidfds) -> Detection | None:
    """The first of ``pids`` killed by a signal, its peers SIGKILLed at once; else None.

    torch's PContext, on a failure, sends SIGTERM to the survivors and waits for them;
    peers stuck in a collective then take their time. With a pidfd and ``WNOWAIT`` the
    death is seen first and the survivors are SIGKILLed, so torch finds them all dead;
    ``dying_signal`` sees it even before the victim is a zombie, while the kernel still
    tears down its memory and CUDA context, so the teardowns overlap. None also when
    pidfds are unavailable (e.g. gVisor): torch's poll still sees the death.
    """
    pids = list(pids)
    for pid in pids:
        try:
            end = pidfds.exit_of(pid)
        except OSError:
            return None
        if end is not None and end.signal is not None:
            detection = Detection(t=time.time(), root_pid=pid)
            for other in pids:
                if other != pid:
                    try:
                        os.kill(other, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            return detection
    return None


@dataclasses.dataclass(slots=True, eq=False)
class ShadowGeneration:
    """One launch of the next generation's shadows on this node: torch's PContext of every
    local rank, their pidfds, the level and launch number they were started with."""

    gen: int
    level: ShadowLevel
    launch: int
    pcontext: PContext
    pidfds: Pidfds = dataclasses.field(default_factory=Pidfds)
    done: bool = False
    """Retired or promoted: its processes are no longer this object's to stop."""

    def pids(self) -> dict[int, int]:
        """Local rank → pid."""
        return self.pcontext.pids()

    def dead(self) -> tuple[int, ProcessExit] | None:
        """The first shadow (local rank, how it ended) that is gone, else None."""
        for local_rank, pid in self.pcontext.pids().items():
            try:
                end = self.pidfds.exit_of(pid)
            except OSError:  # no pidfds: torch's poll (it reaps) is all there is
                result = self.pcontext.wait(0)
                if result is None:
                    return None
                failure = min(result.failures.values(), key=lambda f: f.timestamp, default=None)
                return (failure.local_rank if failure else local_rank), ProcessExit(
                    exitcode=failure.exitcode if failure else 0
                )
            if end is not None:
                return local_rank, end
        return None

    def retire(self, sig: signal.Signals = signal.SIGKILL) -> dict[int, int]:
        """Stop every shadow with ``sig`` and reap it (torch's close returns once reaped),
        closing their pidfds; returns their pids (local rank → pid). Only the first call
        acts: a retired or promoted generation is left alone."""
        if self.done:
            return {}
        self.done = True
        pids = self.pcontext.pids()
        self.pidfds.close()
        close_processes(self.pcontext, sig)
        return pids

    def promote(self) -> tuple[PContext, Pidfds]:
        """Hand the processes and their pidfds over as the active generation."""
        assert not self.done, "a retired shadow generation cannot be promoted"
        self.done = True
        return self.pcontext, self.pidfds


@dataclasses.dataclass(frozen=True, slots=True)
class Recovery:
    """A recovery in progress: promoted, waiting for every promoted trainer's first step."""

    gen: int
    epoch: int
    detected_t: float
    stopped_t: float
    cold: bool


@dataclasses.dataclass(slots=True, kw_only=True)
class Attempt:
    """One group attempt's runtime state on this node, built fresh by ``_start_workers``."""

    raw_store: dist.Store
    """The attempt's worker store (fault claims live in it, outside the job's prefix)."""
    store: dist.Store
    """``raw_store`` under the job's prefix (``leto.contract``): every agent↔trainer key."""
    epochs: EpochBoard
    """The job-wide recovery decisions (``leto.epoch``)."""
    hangs: HangWatch
    preinit: PreinitController
    generation: int = 0
    """The active generation; its shadows are ``generation + 1``."""
    actives: Pidfds = dataclasses.field(default_factory=Pidfds)
    """pidfds of the active generation's trainers."""
    shadows: ShadowGeneration | None = None
    detection: Detection | None = None
    """A trainer's death seen early, until its generation is stopped."""
    recovery: Recovery | None = None
    """The promotion in flight (phase RECOVERING)."""
    failures_in_a_row: int = 0
    """HOFs since a generation last committed a step (``leto.failure_loop_limit``)."""
    sm_death_seen: bool = False
    launches: dict[int, int] = dataclasses.field(default_factory=dict)
    """Generation → its last shadow launch number."""
    shadow_deaths: int = 0
    """Shadow generations that died in a row before every shadow became ready."""
    no_shadows_reason: str = ""
    """Why this node has no shadows although the job uses them (the group-restart reason)."""

    def actives_stopped(self) -> None:
        """The active generation is gone: forget its pidfds and its detected death."""
        self.actives.close()
        self.detection = None
