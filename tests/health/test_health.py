"""HangWatch verdicts from a real shared-memory board and a fake clock."""

from __future__ import annotations

import os

from leto.health import HangWatch, Heartbeat, HeartbeatBoard


def test_stall_limits_before_and_after_the_first_step() -> None:
    board = HeartbeatBoard(2)
    now = [100.0]
    try:
        watch = HangWatch(
            board, hang_timeout_s=5.0, first_step_timeout_s=30.0, clock=lambda: now[0]
        )
        hb0, hb1 = Heartbeat(board.path, 0), Heartbeat(board.path, 1)
        now[0] += 20.0  # slow first step: no verdict yet
        assert watch.check() == []
        hb0.stepped()
        hb1.beat()
        assert watch.check() == []
        now[0] += 6.0  # rank 0 has stepped: 5 s limit; rank 1 has not: 30 s limit
        (stall,) = watch.check()
        assert (stall.slot, stall.limit_s) == (0, 5.0) and stall.idle_s == 6.0
        hb0.beat()
        assert watch.check() == []
        now[0] += 25.0
        assert [s.slot for s in watch.check()] == [1, 0]  # longest idle first
        watch.arm()  # a new generation: counters zeroed, clocks restarted
        assert board.read(0) == (0, 0) and watch.check() == []
    finally:
        board.close()


def test_finished_ranks_are_not_watched() -> None:
    board = HeartbeatBoard(2)
    try:
        watch = HangWatch(board, hang_timeout_s=5.0, first_step_timeout_s=30.0)
        assert watch.watched() == 2
        Heartbeat(board.path, 1).finished()
        assert watch.watched() == 1
    finally:
        board.close()


def test_dying_signal_reads_a_kill_before_the_reap() -> None:
    import signal
    import subprocess
    import sys

    from leto.health import dying_signal

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert dying_signal(child.pid) is None  # alive
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(
            os.P_PID, child.pid, os.WEXITED | os.WNOWAIT
        )  # a zombie: PF_EXITING and code stay
        assert dying_signal(child.pid) == signal.SIGKILL
    finally:
        child.kill()
        child.wait()
    ok = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, ok.pid, os.WEXITED | os.WNOWAIT)
    try:
        assert dying_signal(ok.pid) is None  # a normal exit is not a death by signal
    finally:
        ok.wait()


def test_proc_state_reads_the_state_letter() -> None:
    import signal
    import subprocess
    import sys

    from leto.health import proc_state

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        os.waitid(os.P_PID, child.pid, os.WSTOPPED | os.WNOWAIT)
        assert proc_state(child.pid) == "T"
    finally:
        child.kill()
        child.wait()
    assert proc_state(child.pid) == "?"  # reaped: gone


def test_culprit_waits_for_a_slow_peer_and_blames_a_stopped_rank() -> None:
    board = HeartbeatBoard(2)
    now = [100.0]
    try:
        watch = HangWatch(board, hang_timeout_s=5.0, first_step_timeout_s=5.0, clock=lambda: now[0])
        slow = Heartbeat(board.path, 1)
        now[0] += 6.0
        slow.beat()  # rank 1 still makes progress; rank 0 waits for it in a collective
        (waiting,) = watch.check()
        assert waiting.slot == 0 and watch.culprit([waiting], {0: "S"}) is None
        now[0] += 6.0  # now both are stalled: rank 0 idle longest, rank 1 stopped
        stalls = watch.check()
        assert [s.slot for s in stalls] == [0, 1]
        assert watch.culprit(stalls, {0: "S", 1: "T"}).slot == 1
        assert watch.culprit(stalls, {0: "S", 1: "S"}).slot == 0  # no stopped one: the longest idle
    finally:
        board.close()


def test_a_stopped_rank_is_blamed_before_its_stalled_peer_and_a_warm_first_step_uses_the_hang_timeout() -> (
    None
):
    board = HeartbeatBoard(2)
    now = [100.0]
    try:
        watch = HangWatch(
            board, hang_timeout_s=5.0, first_step_timeout_s=600.0, clock=lambda: now[0]
        )
        watch.arm(warm=True)  # promoted shadows: their first step is held to the hang timeout
        stopped = Heartbeat(board.path, 1)
        now[0] += 3.0
        stopped.beat()  # rank 1 beat last, then was stopped; rank 0 waits for it in a collective
        now[0] += 3.0
        (peer,) = watch.check()
        assert peer.slot == 0 and peer.limit_s == 5.0
        blamed = watch.culprit([peer], {0: "S", 1: "T"})
        assert blamed is not None and blamed.slot == 1  # not past its limit yet, but stopped
        watch.arm(warm=False)  # a cold generation: the first-step timeout again
        now[0] += 6.0
        assert watch.check() == []
    finally:
        board.close()
