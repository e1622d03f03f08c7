"""The agent's failure policy: classify a failure, decide once for the whole job, follow.

A mixin of :class:`~leto_run.agent.LetoAgent` (it uses the agent's state: the state
manager, the shadow generation, the epoch board, the heartbeat watch). The decision is a
record in the recovery epoch (``leto.epoch``); every node's agent follows the same record:

* ``in_place`` — stop the local actives, promote the local shadows (``LetoAgent._recover``);
* ``restart`` — torchrun's group restart; trainers then load the newest checkpoint.

A node that cannot follow a plain ``in_place`` record (its shadows died since) follows it
with a cold generation; on a multi-node job it also publishes a cold ``in_place`` record for
the next epoch, which every node then follows. A multi-node agent whose trainers only raised (a peer's death breaks collectives)
first waits ``peer_failure_grace_s`` for the record that explains them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from typing import TYPE_CHECKING

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from leto import contract
from leto.epoch import EpochRecord
from leto.events import Kind
from leto.health import FailureClass, proc_state
from leto_run.policy import Action, FailureFacts, decide

if TYPE_CHECKING:
    from leto_run.agent import LetoAgent

    _Base = LetoAgent
else:
    _Base = object

logger = logging.getLogger(__name__)


class FailurePolicy(_Base):
    """Classification, the job-wide decision and hang verdicts for :class:`LetoAgent`."""

    def _classify(self, result: RunResult) -> FailureClass:
        """FF when the state manager is gone, a trainer reported its hardware unusable or
        NVML reports a new fatal condition on a local GPU; HOF when a trainer was killed by
        a signal (its hardware is then usable); ERROR when a script raised (an in-place
        retry would raise again)."""
        assert self._epochs is not None
        if self._sm is None or not self._sm.alive():
            return FailureClass.FF
        if any(self._epochs.check([contract.fatal(rank)]) for rank in result.failures):
            return FailureClass.FF
        problems = self._device_health.check()
        if problems:
            self._events.emit(Kind.DEVICE_UNHEALTHY, problems=problems)
            logger.error("GPU health check failed: %s", "; ".join(problems))
            return FailureClass.FF
        # Killed by a signal (seen first through a pidfd, or any signal but the SIGTERM torch
        # sends a failed trainer's peers): on CPU the hardware is still usable.
        if self._detected_t is not None or any(
            f.exitcode < 0 and f.exitcode != -int(signal.SIGTERM) for f in result.failures.values()
        ):
            return FailureClass.HOF
        return FailureClass.ERROR

    def _local_shadows_ok(self) -> bool:
        return (
            self._shadows is not None
            and self._dead_shadow() is None
            and self._sm is not None
            and self._sm.alive()
        )

    def _all_shadows_ready(self, worker_group: WorkerGroup) -> bool:
        assert self._epochs is not None
        nodes = range(worker_group.group_world_size)
        return self._local_shadows_ok() and self._epochs.check(
            [contract.shadows(self._generation + 1, n) for n in nodes]
        )

    def _decide(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        """A local failure: publish the job-wide answer (or find a peer's) and follow it."""
        assert self._epochs is not None
        failure = self._classify(result)
        epoch = self._generation + 1
        if self._recovery is not None:  # the promoted trainers failed before all stepped once
            self.recoveries -= 1
            self._recovery = None
        if failure is FailureClass.ERROR and worker_group.group_world_size > 1:
            # A trainer on another node died, breaking our collectives: its agent's record
            # is on its way and explains our error.
            record = self._epochs.wait(epoch, self._leto.peer_failure_grace_s)
            if record is not None:
                return self._follow(worker_group, record, result)
        failed = {str(rank): f.exitcode for rank, f in result.failures.items()}
        root = [w.global_rank for w in worker_group.workers if w.id == self._root_pid] or sorted(
            result.failures
        )
        detected_t = self._detected_t or time.time()
        self._failures_in_a_row += 1
        ranks = sorted(result.failures)
        self._events.emit(
            Kind.FAILURE_DETECTED,
            ranks=ranks,
            exit_codes=[result.failures[r].exitcode for r in ranks],
            root_ranks=root,
            gen=self._generation,
            detected_t=detected_t,
            failure=failure.value,
            in_a_row=self._failures_in_a_row,
        )
        decision = decide(self._facts(worker_group, failure))
        record = self._epochs.publish(
            EpochRecord(
                epoch=epoch,
                action="in_place" if decision.action.in_place else "restart",
                failure=failure.value,
                node=worker_group.group_rank,
                ranks=failed,
                root_ranks=root,
                reason=decision.reason,
                detected_t=detected_t,
                cold=decision.action is Action.PROMOTE_COLD,
            )
        )
        return self._follow(worker_group, record, result)

    def _facts(self, worker_group: WorkerGroup, failure: FailureClass) -> FailureFacts:
        sm_alive = self._sm is not None and self._sm.alive()
        return FailureFacts(
            failure=failure,
            in_place_enabled=self._leto.recovery == "in_place",
            state_manager_alive=sm_alive,
            shadows_everywhere=self._all_shadows_ready(worker_group),
            multi_node=worker_group.group_world_size > 1,
            failures_without_progress=self._failures_in_a_row,
            failure_loop_limit=self._leto.failure_loop_limit,
            no_shadows_reason=self._no_shadows_reason,
            state_manager_exit="" if sm_alive or self._sm is None else str(self._sm.exit_status()),
        )

    def _follow(
        self, worker_group: WorkerGroup, record: EpochRecord, result: RunResult | None
    ) -> RunResult:
        """Act on the job-wide decision for this generation: promote, or restart the group."""
        assert self._epochs is not None
        if record.action == "in_place" and not record.cold and not self._local_shadows_ok():
            if worker_group.group_world_size == 1:
                # This node's shadows died since the decision: a cold generation instead.
                record = dataclasses.replace(record, cold=True)
            else:
                # The other nodes promote their shadows; then every node follows a cold
                # generation (its trainers must meet in one process group). Until then this
                # node's cold trainers wait in theirs.
                self._epochs.publish(
                    EpochRecord(
                        epoch=record.epoch + 1,
                        action="in_place",
                        failure=record.failure,
                        node=worker_group.group_rank,
                        reason=f"node {worker_group.group_rank} has no live shadows",
                        detected_t=time.time(),
                        cold=True,
                    )
                )
                record = dataclasses.replace(record, cold=True)
        self._events.emit(
            Kind.EPOCH,
            epoch=record.epoch,
            action=record.action,
            failure=record.failure,
            node=record.node,
            remote=record.node != worker_group.group_rank,
            cold=record.cold,
            reason=record.reason,
            detected_t=record.detected_t,
            root_ranks=record.root_ranks,
        )
        if record.action == "in_place":
            self._recover(worker_group, record)
            return RunResult(state=WorkerState.HEALTHY)
        self._restart_reason = f"{record.failure} on node {record.node}: {record.reason}"
        if self._remaining_restarts > 0:
            where = (
                f"loading the newest complete checkpoint in {self._leto.checkpoint.dir}"
                if self._leto.checkpoint is not None
                else "no checkpoint is configured (leto.checkpoint): training restarts from step 0"
            )
            logger.warning("group restart: %s; %s", self._restart_reason, where)
        else:
            logger.error(
                "the job fails (no restarts left, --max-restarts %d): %s",
                worker_group.spec.max_restarts,
                self._restart_reason,
            )
        if result is not None and result.state == WorkerState.FAILED:
            return result
        # Our own workers are healthy but the job is restarting: stop them, report them.
        assert self._pcontext is not None
        pids = self._pcontext.pids()
        self._pcontext.close(death_sig=signal.SIGKILL, timeout=5)
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

    def _watch_hangs(self, worker_group: WorkerGroup) -> None:
        """Kill the hung active (``HangWatch.culprit``); it is then recovered as a crash."""
        if self._hangs is None or self._detected_t is not None or self._pcontext is None:
            return
        stalls = self._hangs.check()
        if not stalls:
            return
        states = {
            w.local_rank: proc_state(w.id) for w in worker_group.workers
        }  # a stopped peer first
        stall = self._hangs.culprit(stalls, states)
        if stall is None:
            return
        worker = worker_group.workers[stall.slot]
        self._events.emit(
            Kind.HANG_DETECTED,
            rank=worker.global_rank,
            gen=self._generation,
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
        self._hangs.arm()  # one verdict per stall; the kill is seen by _detect_killed_active
