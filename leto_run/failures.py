"""The pieces of failure handling that need no agent: classify a failure, judge a hang,
stop healthy workers for a group restart.

Each takes its collaborators (the state manager, the epoch board, the health probe, the
event log, the processes) as arguments, so it can be driven from a test on CPU. The agent
(``leto_run.agent``) runs the recovery path with them and ``leto_run.policy.decide``.
"""

from __future__ import annotations

import logging
import os
import signal

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing import PContext
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from leto import contract
from leto.config import CheckpointConfig
from leto.device_health import NvmlHealth
from leto.epoch import EpochBoard
from leto.events import EventLog, Kind
from leto.health import FailureClass, HangWatch, proc_state
from leto.pool.process import StateManagerProcess
from leto_run.agent_state import close_processes

logger = logging.getLogger(__name__)


def classify(
    result: RunResult,
    *,
    state_manager: StateManagerProcess | None,
    epochs: EpochBoard,
    device_health: NvmlHealth,
    events: EventLog,
    killed_seen: bool,
) -> FailureClass:
    """FF when the state manager is gone, a trainer reported its hardware unusable or
    NVML reports a new fatal condition on a local GPU; HOF when a trainer was killed by
    a signal (its hardware is then usable; ``killed_seen``: the agent saw it through a
    pidfd); ERROR when a script raised (an in-place retry would raise again)."""
    if state_manager is None or not state_manager.alive():
        return FailureClass.FF
    if any(epochs.check([contract.fatal(rank)]) for rank in result.failures):
        return FailureClass.FF
    problems = device_health.check()
    if problems:
        events.emit(Kind.DEVICE_UNHEALTHY, problems=problems)
        logger.error("GPU health check failed: %s", "; ".join(problems))
        return FailureClass.FF
    # Killed by a signal (seen first through a pidfd, or any signal but the SIGTERM torch
    # sends a failed trainer's peers): on CPU the hardware is still usable.
    if killed_seen or any(
        f.exitcode < 0 and f.exitcode != -int(signal.SIGTERM) for f in result.failures.values()
    ):
        return FailureClass.HOF
    return FailureClass.ERROR


def kill_hung(hangs: HangWatch, worker_group: WorkerGroup, events: EventLog, gen: int) -> None:
    """SIGKILL the hung active (``HangWatch.culprit``); it is then recovered as a crash."""
    stalls = hangs.check()
    if not stalls:
        return
    states = {w.local_rank: proc_state(w.id) for w in worker_group.workers}  # a stopped peer first
    stall = hangs.culprit(stalls, states)
    if stall is None:
        return
    worker = worker_group.workers[stall.slot]
    events.emit(
        Kind.HANG_DETECTED,
        rank=worker.global_rank,
        gen=gen,
        idle_s=round(stall.idle_s, 3),
        timeout_s=stall.limit_s,
        proc_state=states[stall.slot],
    )
    logger.warning(
        "rank %d made no progress for %.1f s: killing it", worker.global_rank, stall.idle_s
    )
    try:
        os.kill(worker.id, signal.SIGKILL)
    except ProcessLookupError:
        pass
    hangs.arm()  # one verdict per stall; the kill is seen by the agent's pidfds


def log_group_restart(
    reason: str, remaining_restarts: int, max_restarts: int, checkpoint: CheckpointConfig | None
) -> None:
    """Say where training resumes after the restart, or that the job fails."""
    if remaining_restarts > 0:
        where = (
            f"loading the newest complete checkpoint in {checkpoint.dir}"
            if checkpoint is not None
            else "no checkpoint is configured (leto.checkpoint): training restarts from step 0"
        )
        logger.warning("group restart: %s; %s", reason, where)
    else:
        logger.error(
            "the job fails (no restarts left, --max-restarts %d): %s", max_restarts, reason
        )


def stop_for_restart(worker_group: WorkerGroup, pcontext: PContext) -> RunResult:
    """Healthy workers of a job that restarts: SIGKILL and reap them, report them failed."""
    pids = pcontext.pids()
    close_processes(pcontext, signal.SIGKILL)
    failures = {
        w.global_rank: ProcessFailure(
            local_rank=w.local_rank,
            pid=pids[w.local_rank],
            exitcode=-int(signal.SIGKILL),
            error_file="",
        )
        for w in worker_group.workers
    }
    return RunResult(state=WorkerState.FAILED, failures=failures)
