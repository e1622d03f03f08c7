"""The agent sees a SIGKILLed trainer while the kernel still tears it down, and kills its peers.

``LetoAgent._detect_killed_active`` runs on every monitoring pass. A trainer killed by a
signal becomes waitable only after the kernel has released its memory and, on a GPU, its
CUDA context (0.1-0.5 s on an H200); ``leto.health.dying_signal`` reads the death from
``/proc`` before that, so the agent SIGKILLs the peers on the same pass and their teardowns
overlap the victim's.

Real processes play the trainers: the pidfd and ``waitid`` calls are the agent's own. On CPU
a process's teardown lasts microseconds, too short to hold a real victim in that state, so
the one fake is ``/proc``'s answer for the victim: "dying of SIGKILL" while it is still
alive (not waitable) — exactly the window on a GPU. ``tests/health/test_health.py`` checks
that ``dying_signal`` reads a real kill from ``/proc``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest

import leto_run.agent
from leto_run.agent import LetoAgent

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def trainers():
    """Two live trainer processes, local ranks 0 and 1."""
    procs = [subprocess.Popen(SLEEPER) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def _agent(procs: list[subprocess.Popen]) -> SimpleNamespace:
    """The agent's state that ``_detect_killed_active`` reads and writes."""
    pids = {rank: p.pid for rank, p in enumerate(procs)}
    agent = SimpleNamespace(
        _uses_leto=True,
        _pcontext=SimpleNamespace(pids=lambda: dict(pids)),
        _detected_t=None,
        _root_pid=None,
        _pidfds={},
    )
    agent._exit_of = types.MethodType(LetoAgent._exit_of, agent)  # the agent's own pidfd check
    return agent


def test_a_dying_trainer_is_the_root_and_its_peers_are_killed_on_the_same_pass(
    trainers, monkeypatch
) -> None:
    victim, peer = trainers
    real = leto_run.agent.dying_signal
    monkeypatch.setattr(
        leto_run.agent,
        "dying_signal",
        lambda pid: signal.SIGKILL if pid == victim.pid else real(pid),
    )
    agent = _agent(trainers)
    try:
        LetoAgent._detect_killed_active(agent)  # type: ignore[arg-type]
        assert agent._root_pid == victim.pid and agent._detected_t is not None
        assert (
            peer.wait(timeout=30) == -signal.SIGKILL
        )  # stopped at once, not left to its collective
        assert victim.poll() is None  # the kernel finishes the victim; the agent does not touch it
    finally:
        LetoAgent._close_pidfds(agent)  # type: ignore[arg-type]


def test_live_trainers_are_left_alone(trainers) -> None:
    agent = _agent(trainers)
    try:
        LetoAgent._detect_killed_active(agent)  # type: ignore[arg-type]
        assert agent._root_pid is None and agent._detected_t is None
        assert all(p.poll() is None for p in trainers)
    finally:
        LetoAgent._close_pidfds(agent)  # type: ignore[arg-type]


def test_a_reaped_kill_is_seen_through_the_pidfd(trainers) -> None:
    """A victim that is already a zombie (the kernel finished) is found without ``/proc``."""

    victim, peer = trainers
    victim.send_signal(signal.SIGKILL)
    os.waitid(os.P_PID, victim.pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped
    agent = _agent(trainers)
    try:
        LetoAgent._detect_killed_active(agent)  # type: ignore[arg-type]
        assert agent._root_pid == victim.pid
        assert peer.wait(timeout=30) == -signal.SIGKILL
    finally:
        LetoAgent._close_pidfds(agent)  # type: ignore[arg-type]
