"""The agent sees a SIGKILLed trainer while the kernel still tears it down, and kills its peers.

The agent runs ``leto_run.agent_state.detect_kill`` on its actives every monitoring pass. A trainer killed by a
signal becomes waitable only after the kernel has released its memory and, on a GPU, its
CUDA context (0.1-0.5 s on an H200); ``leto.health.dying_signal`` reads the death from
``/proc`` before that, so the agent SIGKILLs the peers on the same pass and their teardowns
overlap the victim's.

Real processes play the trainers: the pidfd and ``waitid`` calls are the agent's own
(``Pidfds``). On CPU
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

import pytest

import leto_run.agent_state
from leto_run.agent_state import Pidfds, detect_kill

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def trainers():
    """Two live trainer processes, local ranks 0 and 1."""
    procs = [subprocess.Popen(SLEEPER) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def pidfds():
    fds = Pidfds()
    yield fds
    fds.close()


def test_a_dying_trainer_is_the_root_and_its_peers_are_killed_on_the_same_pass(
    trainers, pidfds, monkeypatch
) -> None:
    victim, peer = trainers
    real = leto_run.agent_state.dying_signal
    monkeypatch.setattr(
        leto_run.agent_state,
        "dying_signal",
        lambda pid: signal.SIGKILL if pid == victim.pid else real(pid),
    )
    detection = detect_kill([p.pid for p in trainers], pidfds)
    assert detection is not None and detection.root_pid == victim.pid
    assert peer.wait(timeout=30) == -signal.SIGKILL  # stopped at once, not left to its collective
    assert victim.poll() is None  # the kernel finishes the victim; the agent does not touch it


def test_live_trainers_are_left_alone(trainers, pidfds) -> None:
    assert detect_kill([p.pid for p in trainers], pidfds) is None
    assert all(p.poll() is None for p in trainers)


def test_a_reaped_kill_is_seen_through_the_pidfd(trainers, pidfds) -> None:
    """A victim that is already a zombie (the kernel finished) is found without ``/proc``."""

    victim, peer = trainers
    victim.send_signal(signal.SIGKILL)
    os.waitid(os.P_PID, victim.pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped
    detection = detect_kill([p.pid for p in trainers], pidfds)
    assert detection is not None and detection.root_pid == victim.pid
    assert peer.wait(timeout=30) == -signal.SIGKILL
