"""The agent's runtime state objects (``leto_run.agent_state``), driven with real processes.

* :class:`Phase`: the transitions the agent makes are allowed, the others raise.
* :class:`ShadowGeneration`: ``retire`` closes the generation's pidfds, stops and reaps its
  processes (torch's own ``PContext`` of real children), and does so once; a promoted
  generation hands its processes and pidfds over and is never stopped by ``retire``.
* :class:`Pidfds`: how a child ended, seen without reaping it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, PContext, start_processes

from leto.errors import InvalidTransitionError
from leto.preinit.levels import ShadowLevel
from leto_run.agent_state import Attempt, Detection, Phase, Pidfds, ProcessExit, ShadowGeneration

SLEEP = "import time; time.sleep(60)"


# -- phases ------------------------------------------------------------------------------------
def test_the_agents_path_through_a_recovery_and_a_restart_is_allowed() -> None:
    path = [
        Phase.STARTING,  # _start_workers
        Phase.RUNNING,  # every active registered
        Phase.RECOVERING,  # promoted
        Phase.RECOVERING,  # the promoted generation failed before stepping, promoted again
        Phase.RUNNING,  # every promoted trainer stepped
        Phase.RESTARTING,  # a restart record
        Phase.STOPPED,  # torch stops the workers
        Phase.STOPPED,  # ... and shuts down (the run's end) once more
        Phase.STARTING,  # the next attempt
    ]
    phase = Phase.STOPPED
    for step in path:
        phase = phase.to(step)
    assert phase is Phase.STARTING


@pytest.mark.parametrize(
    ("start", "target"),
    [
        (Phase.STOPPED, Phase.RUNNING),  # workers must be started first
        (Phase.STARTING, Phase.RECOVERING),  # a plain script is never promoted
        (Phase.STARTING, Phase.RESTARTING),  # ... nor decided on: torch restarts it
        (Phase.RUNNING, Phase.STARTING),  # a new attempt only after its workers stopped
        (Phase.RUNNING, Phase.RUNNING),
        (Phase.RESTARTING, Phase.RUNNING),  # a restart decision is final for the attempt
        (Phase.RESTARTING, Phase.RECOVERING),
    ],
)
def test_a_transition_outside_the_table_raises(start: Phase, target: Phase) -> None:
    with pytest.raises(InvalidTransitionError, match=f"{start.value} -> {target.value}"):
        start.to(target)


def test_every_phase_may_stop() -> None:
    for phase in Phase:
        assert phase.to(Phase.STOPPED) is Phase.STOPPED


def test_only_phases_after_registration_use_leto() -> None:
    assert {p for p in Phase if p.uses_leto} == {Phase.RUNNING, Phase.RECOVERING, Phase.RESTARTING}


# -- pidfds ------------------------------------------------------------------------------------
def _open_pidfds() -> int:
    """How many pidfds this process holds (``anon_inode:[pidfd]`` in ``/proc/self/fd``)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        except OSError:  # the listing's own fd, gone by now
            pass
    return n


def _look(pidfds: Pidfds, pids: list[int]) -> None:
    """Look at every pid once (which opens its pidfd)."""
    for pid in pids:
        pidfds.exit_of(pid)


def test_a_childs_end_is_seen_without_reaping_it() -> None:
    alive = subprocess.Popen([sys.executable, "-c", SLEEP])
    exits = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    killed = subprocess.Popen([sys.executable, "-c", SLEEP])
    pidfds = Pidfds()
    try:
        killed.kill()
        for p in (exits, killed):
            os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped
        assert pidfds.exit_of(alive.pid) is None
        assert pidfds.exit_of(exits.pid) == ProcessExit(exitcode=3)
        assert pidfds.exit_of(killed.pid) == ProcessExit(signal=signal.SIGKILL)
        assert exits.wait(timeout=5) == 3  # still ours to reap
        assert pidfds.exit_of(exits.pid) == ProcessExit()  # reaped elsewhere: status gone
    finally:
        pidfds.close()
        for p in (alive, exits, killed):
            p.kill()
            p.wait()
    assert len(pidfds) == 0


def test_an_attempt_forgets_its_stopped_actives() -> None:
    child = subprocess.Popen([sys.executable, "-c", SLEEP])
    attempt = Attempt(raw_store=None, store=None, epochs=None, hangs=None, preinit=None)  # type: ignore[arg-type]
    before = _open_pidfds()
    try:
        _look(attempt.actives, [child.pid])
        assert _open_pidfds() == before + 1
        attempt.detection = Detection(t=1.0, root_pid=child.pid)
        attempt.actives_stopped()
        assert attempt.detection is None and _open_pidfds() == before
    finally:
        child.kill()
        child.wait()


# -- a shadow generation -----------------------------------------------------------------------
class CountingClose:
    """torch's PContext with its ``close`` calls counted."""

    def __init__(self, pcontext: PContext) -> None:
        self.pcontext = pcontext
        self.closes: list[signal.Signals | None] = []

    def __getattr__(self, name: str):
        return getattr(self.pcontext, name)

    def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        self.closes.append(death_sig)
        self.pcontext.close(death_sig=death_sig, timeout=timeout)


@pytest.fixture
def generation(tmp_path: Path):
    """A live shadow generation of two real processes (local ranks 0 and 1)."""
    pcontext = start_processes(
        name="shadows",
        entrypoint=sys.executable,
        args={0: ("-c", SLEEP), 1: ("-c", SLEEP)},
        envs={0: {}, 1: {}},
        logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)),
    )
    counted = CountingClose(pcontext)
    gen = ShadowGeneration(gen=1, level=ShadowLevel(3), launch=0, pcontext=counted)  # type: ignore[arg-type]
    yield gen, counted
    pcontext.close(death_sig=signal.SIGKILL, timeout=5)


def _reaped(pid: int) -> bool:
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


def test_retire_closes_the_pidfds_and_stops_and_reaps_every_shadow_once(generation) -> None:
    gen, counted = generation
    pids, before = gen.pids(), _open_pidfds()
    assert gen.dead() is None  # every shadow looked at: their pidfds are open
    assert _open_pidfds() == before + 2

    assert gen.retire(signal.SIGKILL) == pids
    assert counted.closes == [signal.SIGKILL]
    assert all(_reaped(pid) for pid in pids.values())  # returns once reaped
    assert _open_pidfds() == before

    assert gen.retire(signal.SIGTERM) == {}  # a second teardown does nothing
    assert counted.closes == [signal.SIGKILL]


def test_a_dead_shadow_is_named_with_how_it_ended(generation) -> None:
    gen, _ = generation
    pid = gen.pids()[1]
    os.kill(pid, signal.SIGKILL)
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    assert gen.dead() == (1, ProcessExit(signal=signal.SIGKILL))


def test_a_promoted_generation_is_handed_over_and_never_retired(generation) -> None:
    gen, counted = generation
    pids, before = gen.pids(), _open_pidfds()
    _look(gen.pidfds, list(pids.values()))
    pcontext, pidfds = gen.promote()
    assert pcontext is counted and pidfds is gen.pidfds
    assert gen.retire() == {} and counted.closes == []
    assert all(pidfds.exit_of(pid) is None for pid in pids.values())  # alive, still watched
    assert _open_pidfds() == before + 2
    pidfds.close()
    assert _open_pidfds() == before
    with pytest.raises(AssertionError):
        gen.promote()  # processes are handed over once


def test_retire_stops_every_shadow_when_one_exits_under_torchs_close(
    generation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shadow that exits between torch's poll and its ``killpg`` made torch's close raise
    ``ProcessLookupError`` half-way, leaving the other shadow running (a job's end that
    failed with a traceback); retire closes again and every shadow is stopped and reaped."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    gen, _ = generation
    pids = gen.pids()
    real_killpg, raised = os.killpg, []

    def killpg(pgid: int, sig: int) -> None:
        if not raised:  # the first shadow ends on its own just before torch's signal
            raised.append(pgid)
            real_killpg(pgid, signal.SIGKILL)
            os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOWAIT)
            raise ProcessLookupError(3, "No such process")
        real_killpg(pgid, sig)

    monkeypatch.setattr(subprocess_handler.os, "killpg", killpg)
    assert gen.retire(signal.SIGTERM) == pids
    assert raised and all(_reaped(pid) for pid in pids.values())


def test_closing_a_worker_that_leads_no_process_group_yet_signals_it_by_pid() -> None:
    """A worker the fork server has just forked has not called ``setsid`` yet: torch's
    ``close`` (``killpg`` of each live process) raises ``ProcessLookupError`` for it. Here a
    child left in this process group stands in for it, behind a context that closes as
    torch's does; ``close_processes`` must still kill and reap it."""
    from leto_run.agent_state import close_processes

    child = subprocess.Popen([sys.executable, "-c", SLEEP])

    class Handler:
        proc = child

    class TorchLikeContext:
        def __init__(self) -> None:
            self.subprocess_handlers = {0: Handler()}

        def close(self, death_sig: signal.Signals, timeout: float) -> None:
            for handler in self.subprocess_handlers.values():
                if handler.proc.poll() is None:
                    os.killpg(handler.proc.pid, death_sig)  # no group of that id

    try:
        close_processes(TorchLikeContext(), signal.SIGKILL, timeout=5)  # type: ignore[arg-type]
        assert child.poll() == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
