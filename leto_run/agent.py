"""LetoAgent: torch.distributed.elastic's LocalElasticAgent plus in-place recovery.

The base class keeps what torchrun users rely on: rendezvous, the worker environment,
logs, ``--max-restarts`` and exit codes. Leto adds, per node:

* a state manager (spawned once per group attempt) that retains model state;
* for every local rank, an active trainer and a shadow trainer: the same script with
  ``LETO_ROLE=active|shadow`` and a generation number. Each generation is one torch
  ``PContext``, so logs, redirects and tee behave exactly as torchrun's;
* failure handling in ``_monitor_workers`` (the decision in ``leto_run/policy.py``, the
  classification and hang verdicts in ``leto_run/failures.py``, the runtime state in
  ``leto_run/agent_state.py``, the shadows in ``leto_run/shadows.py``), job-wide through the recovery epoch
  (``leto.epoch``): the agent that sees a failure classifies it (``leto.health``: HOF =
  killed by a signal or hung; FF = reported fatal by the trainer, or a dead state
  manager; ERROR = the script raised) and publishes one record per generation in the
  job's store. Every agent polls that record: on ``in_place`` it SIGKILLs its surviving
  actives (stuck in collectives; they must not touch retained state again) and only then
  sets its own ranks' ``promote/{gen}/{rank}`` keys; on ``restart`` it takes torchrun's
  group restart and the trainers load the newest checkpoint (``leto.checkpoint``).
  A plain torchrun script never enters this: it gets torchrun's behaviour unchanged;
* hang detection: a shared-memory heartbeat per local rank (``leto.health``); a rank
  without progress for ``hang_timeout_s`` is SIGKILLed and handled as the crash it is;
* the pre-initialisation controller (``leto.preinit``): an active's OOM request on the
  heartbeat board makes the agent kill and reap its shadows, answer, and relaunch them at
  the highest level that fits once every active has reported the retried step's memory.

Shadows are spawned only after every local active has called ``leto.init()``, so a plain
torchrun script never sees one. Replacements after a recovery are spawned right after the
promotion (forked from the warm fork server), so a failure in the promoted generation's
first steps finds them (they start their device after its first step); where a node has no shadows at all, a cold generation attaches to
the retained state (``leto_run.policy``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, LogsDest, PContext

from leto import contract, faults, kernels, priority
from leto.config import LetoConfig
from leto.contract import ENV_CHECKPOINT, ROLE_ACTIVE, ROLE_SHADOW
from leto.device_health import NvmlHealth
from leto.epoch import EpochBoard, EpochRecord
from leto.events import ENV_EVENTS_FILE, EventLog, EventTail, Kind
from leto.forkserver import ForkServer
from leto.health import ENV_HEARTBEAT, FailureClass, HangWatch, HeartbeatBoard
from leto.pool.process import StateManagerProcess
from leto.preinit.controller import PreinitController
from leto.preinit.levels import ShadowLevel
from leto.summary import Summary
from leto_run.agent_state import (
    Attempt,
    Phase,
    Recovery,
    close_processes,
    detect_kill,
)
from leto_run.failures import classify, kill_hung, log_group_restart, stop_for_restart
from leto_run.policy import Action, FailureFacts, decide
from leto_run.shadows import Shadows, pids_of
from leto_run.warm_start import started_warm, warm_spawns

logger = logging.getLogger(__name__)


# torch >= 2.10 builds each worker's env through this method; older releases copy the
# agent's own environment into the workers, so there the LETO_* variables are overlaid.
_HAS_ENV_HOOK = hasattr(LocalElasticAgent, "_set_local_rank_env")


@contextlib.contextmanager
def _environ_overlay(extra: dict[str, str] | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra or {}}
    os.environ.update(extra or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class GenerationLogsSpecs(DefaultLogsSpecs):
    """torchrun's log layout with one folder per trainer generation: ``attempt_0/gen_1/0/``."""

    generation = 0
    """The generation being spawned (set by the agent; envs may not carry it)."""
    launch = 0
    """Its launch (> 0: relaunched after a reclaim, in ``gen_1.1/``)."""

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        gen = f"{self.generation}.{self.launch}" if self.launch else str(self.generation)
        tagged = {
            rank: {
                **env,
                "TORCHELASTIC_RESTART_COUNT": f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}_gen{gen}",
            }
            for rank, env in envs.items()
        }
        return super().reify(tagged)


COLD_LAUNCH = 1 << 16
"""The launch number of a cold generation: the same on every node (its process group's
store prefix), distinct from the relaunches of the shadow generation it replaces."""


class LetoAgent(LocalElasticAgent):
    """A LocalElasticAgent whose worker group survives trainer failures in place.

    Its runtime state is the :class:`~leto_run.agent_state.Phase` and the current
    :class:`~leto_run.agent_state.Attempt`; what outlives a group attempt (the state
    manager, the heartbeat board, the faults that fired) is kept here.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: DefaultLogsSpecs,
        leto: LetoConfig,
        events: EventLog,
        **kwargs: Any,
    ) -> None:
        super().__init__(spec, logs_specs=logs_specs, **kwargs)
        self._leto = leto
        self._events = events
        self._summary = Summary(keep_recoveries=4)
        """This node's recoveries phase by phase (``leto.summary``), for ``recovery_done``."""
        self._tail = (
            None if events.path is None else EventTail(events.path, os.path.getsize(events.path))
        )
        """The events file from where this job began (the trainers' events feed the summary)."""
        self._job_token = contract.new_token()
        """The job's secret: every store key lives under it (``leto.contract``)."""
        self._device_health = NvmlHealth()
        """GPU fatal-condition counters, baselined now (no CUDA context: NVML only)."""
        self._phase = Phase.STOPPED
        self._attempt: Attempt | None = None
        """The current group attempt's state (``_start_workers`` builds a fresh one)."""
        self._sm: StateManagerProcess | None = None
        """The state manager: reset by a group restart, stopped with the agent."""
        self._board: HeartbeatBoard | None = None
        """Heartbeats and shadow words of every local rank, kept across group attempts."""
        self._worker_store: dist.TCPStore | None = None
        """The attempt's worker store, hosted by the leader node's agent."""
        self._spawn_env: dict[str, str] = {}
        self._fired: set[int] = set()
        """Faults claimed in any attempt (a group restart does not fire them again)."""
        self._erased: set[int] = set()
        """Faults whose page losses were injected."""
        self._restart_reason = ""
        self._shadows = Shadows(
            spawn=self._spawn_shadow_generation,
            events=events,
            shadow_level=leto.shadow_level,
            deaths_limit=leto.preinit.shadow_deaths_limit,
        )
        """This node's shadows (spawn, watch, reclaim, relaunch) of the current attempt."""
        self.forkserver: ForkServer | None = None
        """Set by launch: workers start from it (warm starts and restarts)."""
        self._leto_job = False
        """Whether this job's trainers joined Leto (``leto.init()``): its later workers are
        Leto trainers too, forked with the compiler loaded (``leto.forkserver``)."""
        self.recoveries = 0
        """Failures answered in place (shadow generations promoted), less those a group
        restart answered before the promoted trainers all stepped."""
        self.restarts = 0
        self._fresh_starts = 0
        """Group restarts before every rank's state was retained (``Action.FRESH_START``),
        which ``--max-restarts`` does not count."""
        self.config_error: str | None = None
        """The ``ConfigError`` a trainer stopped on (``contract.config_error``): the job ends
        with it, as one line, without restarts."""

    @property
    def _current(self) -> Attempt:
        assert self._attempt is not None, "no group attempt has started"
        return self._attempt

    def _to(self, phase: Phase) -> None:
        """Move to ``phase``; raises ``InvalidTransitionError`` where the table forbids it."""
        self._phase = self._phase.to(phase)

    # -- worker environment: the one seam torch offers inside _start_workers -----------------
    def _set_local_rank_env(
        self, worker_env: dict[str, str | None], local_rank: int, spec: WorkerSpec
    ) -> None:
        super()._set_local_rank_env(worker_env, local_rank, spec)
        worker_env.update(self._spawn_env)

    def _spawn(
        self,
        worker_group: WorkerGroup,
        role: contract.Role,
        generation: int,
        level: int | None = None,
        launch: int = 0,
    ) -> PContext:
        """Start one generation of trainers for every local rank; returns its PContext."""
        assert self._sm is not None
        generation_env = contract.GenerationEnv(
            role=role,
            generation=generation,
            pool_socket=self._sm.socket_path,
            shadow_level=level or self._leto.shadow_level,
            shadow_launch=launch,
            consistency=self._leto.consistency,
            rmu_chunk_bytes=self._leto.rmu_chunk_bytes or 0,  # 0: the trainer's device decides
            rmu_fused=self._leto.rmu_fused,
            lend_activations=self._leto.lend_activation_memory,
            digest=self._leto.digest,
            deterministic=self._leto.deterministic,
            erasure=self._leto.erasure,
            preinit=self._leto.preinit,
            job_token=self._job_token,
        )
        self._spawn_env = {
            **generation_env.to_environ(),
            **(kernels.deterministic_env(os.environ) if self._leto.deterministic else {}),
            faults.ENV_FAULTS: faults.encode(self._leto.faults),
            faults.ENV_FAULTS_FIRED: ",".join(map(str, sorted(self._fired))),
            ENV_EVENTS_FILE: str(self._events.path or ""),
            ENV_HEARTBEAT: self._board.path if self._board is not None else "",
            ENV_CHECKPOINT: json.dumps(dataclasses.asdict(self._leto.checkpoint))
            if self._leto.checkpoint
            else "",
        }
        if isinstance(self._logs_specs, GenerationLogsSpecs):
            self._logs_specs.generation, self._logs_specs.launch = generation, launch
        active = self._pcontext
        try:
            with (
                # Every worker forks from the warm server; Leto trainers (shadows, and the
                # workers of a job whose trainers joined Leto) from its compiler server.
                warm_spawns(self.forkserver, compiler=role == ROLE_SHADOW or self._leto_job),
                _environ_overlay(None if _HAS_ENV_HOOK else self._spawn_env),
            ):
                super()._start_workers(worker_group)
            return self._pcontext  # type: ignore[return-value]
        finally:
            if role == ROLE_SHADOW:
                self._pcontext = active

    def _spawn_shadow_generation(
        self, worker_group: WorkerGroup, gen: int, level: ShadowLevel, launch: int
    ) -> PContext:
        return self._spawn(worker_group, ROLE_SHADOW, gen, level=int(level), launch=launch)

    # -- template methods of the elastic agent -----------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """torch's rendezvous, then a fresh worker store for this group attempt.

        torch hands workers the agent's long-lived store, so after a group restart a plain
        ``init_process_group("gloo")`` meets the previous attempt's keys and fails
        ("connectFullMesh ... Connection refused"). The leader agent hosts a new TCPStore
        per attempt and publishes its port through the rendezvous store; every node's
        workers get it as MASTER_PORT. Old attempts' stores are closed with them.
        """
        super()._rendezvous(worker_group)
        key = contract.worker_store_port(self._restart_count())
        rdzv_store = worker_group.store
        if worker_group.group_world_size > 1 and not os.environ.get(contract.ENV_JOB_SECRET):
            # Every node needs the same token: the leader's (see leto.contract).
            if worker_group.group_rank == 0:
                rdzv_store.compare_set(contract.RDZV_TOKEN_KEY, "", self._job_token)
            self._job_token = rdzv_store.get(contract.RDZV_TOKEN_KEY).decode()
        if worker_group.group_rank == 0:
            self._worker_store = dist.TCPStore(
                worker_group.master_addr,
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=300),
            )
            rdzv_store.set(key, str(self._worker_store.port))
        worker_group.master_port = int(rdzv_store.get(key))

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self._sm is None or not self._sm.alive():
            self._sm = StateManagerProcess.start()
        else:
            self._sm.reset()  # a group restart never resumes on possibly stale state
        raw = dist.TCPStore(
            worker_group.master_addr,
            worker_group.master_port,
            is_master=False,
            timeout=timedelta(seconds=60),
        )
        store = dist.PrefixStore(contract.store_prefix(self._restart_count(), self._job_token), raw)
        if self._board is None:
            self._board = HeartbeatBoard(worker_group.spec.local_world_size)
        self._attempt = Attempt(
            raw_store=raw,
            store=store,
            epochs=EpochBoard(store, f"{worker_group.master_addr}:{worker_group.master_port}"),
            hangs=HangWatch(
                self._board, self._leto.hang_timeout_s, self._leto.first_step_timeout_s
            ),
            preinit=PreinitController(self._leto.preinit, self._leto.shadow_level, self._board),
        )
        self._to(Phase.STARTING)
        pcontext = self._spawn(worker_group, ROLE_ACTIVE, 0)
        self._events.emit(
            Kind.WORKERS_STARTED,
            restart=self._restart_count(),
            **pids_of(worker_group, pcontext),
            warm=started_warm(pcontext),
        )
        return pcontext.pids()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        attempt = self._current
        self._watch_state_manager()
        self._watch_registration(worker_group)
        self._watch_recovery(worker_group)
        if self._phase.uses_leto:
            self._shadows.answer_oom(attempt, worker_group)
        if self._phase.uses_leto:
            # Another node's decision, a store round trip a poll; alone, this agent publishes
            # every record itself and follows it at once.
            record = (
                attempt.epochs.poll(attempt.generation + 1)
                if worker_group.group_world_size > 1
                else None
            )
            if record is not None:  # another node saw a failure: do as it decided
                return self._follow(worker_group, record, None)
            if attempt.detection is None and self._pcontext is not None:
                kill_hung(attempt.hangs, worker_group, self._events, attempt.generation)
        self._detect_killed_active()
        self._shadows.watch(attempt, worker_group)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and (error := self._config_error(result)):
            self.config_error = error
            self._remaining_restarts = 0  # the same settings would stop every attempt
            return result
        if result.state == WorkerState.FAILED and self._phase.uses_leto:
            return self._decide(worker_group, result)
        if result.state == WorkerState.SUCCEEDED:
            self._shadows.retire(self._attempt)
        return result

    def _config_error(self, result: RunResult) -> str | None:
        """The message of the lowest failed rank that stopped on a ``ConfigError``."""
        store = self._current.store
        try:
            for rank in sorted(result.failures):
                key = contract.config_error(rank)
                if store.check([key]):
                    return store.get(key).decode()
        except dist.DistError:  # the store is gone: torch's report says what failed
            return None
        return None

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """torchrun's group restart (counted against --max-restarts), recorded as an event."""
        self.restarts += 1
        if not self._restart_reason and self._phase.uses_leto:
            # torch restarts on a membership change without counting it; when that change is
            # another node's restart decision seen late, count it as that node does, so the
            # nodes' restart counts (and so their worker stores) stay in step.
            record = self._current.epochs.poll(self._current.generation + 1)
            if record is not None and record.action == "restart" and self._remaining_restarts > 0:
                self._remaining_restarts -= 1
                self._restart_reason = f"{record.failure} on node {record.node}: {record.reason}"
        self._events.emit(
            Kind.GROUP_RESTART,
            restart=self._restart_count(),
            reason=self._restart_reason or "worker failure",
            recoveries=self.recoveries,
        )
        self._restart_reason = ""
        super()._restart_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._note_fired_faults()
        if self._attempt is not None:
            self._attempt.actives_stopped()
        self._shadows.retire(self._attempt)
        super()._stop_workers(worker_group)

    def _shutdown(
        self, death_sig: signal.Signals = signal.SIGTERM, *args: Any, **kwargs: Any
    ) -> None:
        self._shadows.retire(self._attempt, death_sig)
        self._to(Phase.STOPPED)
        super()._shutdown(death_sig, *args, **kwargs)

    def run(self, role: str = "default") -> RunResult:
        """The base run loop; the state manager outlives group restarts but not the agent."""
        try:
            return super().run(role)
        finally:
            self._shadows.retire(self._attempt)
            if self._attempt is not None:
                self._attempt.actives_stopped()
            if self._sm is not None:
                self._sm.stop()
                self._sm = None
            self._attempt = None  # its controller's words live in the board
            if self._board is not None:
                self._board.close()
                self._board = None

    # -- the recovery path: detect → stop → decide → promote or restart → recovery_done ------
    def _detect_killed_active(self) -> None:
        """See a trainer killed by a signal without reaping it, and stop its peers at once
        (``agent_state.detect_kill``). Only for leto jobs, and only for deaths by signal
        (HOFs); torch's poll then reports the failure to ``_decide``."""
        attempt = self._current
        if not self._phase.uses_leto or self._pcontext is None or attempt.detection is not None:
            return
        attempt.detection = detect_kill(self._pcontext.pids().values(), attempt.actives)

    def _decide(self, worker_group: WorkerGroup, result: RunResult) -> RunResult:
        """A local failure: publish the job-wide answer (or find a peer's) and follow it."""
        attempt = self._current
        detection = attempt.detection
        failure = classify(
            result,
            state_manager=self._sm,
            epochs=attempt.epochs,
            device_health=self._device_health,
            events=self._events,
            killed_seen=detection is not None,
        )
        epoch = attempt.generation + 1
        if failure is FailureClass.ERROR and worker_group.group_world_size > 1:
            # A trainer on another node died, breaking our collectives: its agent's record
            # is on its way and explains our error.
            record = attempt.epochs.wait(epoch, self._leto.peer_failure_grace_s)
            if record is not None:
                return self._follow(worker_group, record, result)
        failed = {str(rank): f.exitcode for rank, f in result.failures.items()}
        root = [
            w.global_rank
            for w in worker_group.workers
            if detection is not None and w.id == detection.root_pid
        ] or sorted(result.failures)
        detected_t = detection.t if detection is not None else time.time()
        attempt.failures_in_a_row += 1
        ranks = sorted(result.failures)
        self._events.emit(
            Kind.FAILURE_DETECTED,
            ranks=ranks,
            exit_codes=[result.failures[r].exitcode for r in ranks],
            root_ranks=root,
            gen=attempt.generation,
            detected_t=detected_t,
            failure=failure.value,
            in_a_row=attempt.failures_in_a_row,
        )
        decision = decide(self._facts(worker_group, failure))
        record = attempt.epochs.publish(
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
                fresh=decision.action is Action.FRESH_START,
            )
        )
        return self._follow(worker_group, record, result)

    def _facts(self, worker_group: WorkerGroup, failure: FailureClass) -> FailureFacts:
        attempt = self._current
        sm_alive = self._sm is not None and self._sm.alive()
        nodes = range(worker_group.group_world_size)
        return FailureFacts(
            failure=failure,
            in_place_enabled=self._leto.recovery == "in_place",
            state_manager_alive=sm_alive,
            shadows_everywhere=self._local_shadows_ok()
            and attempt.epochs.check([contract.shadows(attempt.generation + 1, n) for n in nodes]),
            multi_node=worker_group.group_world_size > 1,
            failures_without_progress=attempt.failures_in_a_row,
            failure_loop_limit=self._leto.failure_loop_limit,
            retained_everywhere=attempt.epochs.check(
                [contract.retained(r) for r in range(worker_group.workers[0].world_size)]
            ),
            fresh_starts=self._fresh_starts,
            no_shadows_reason=attempt.no_shadows_reason,
            state_manager_exit="" if sm_alive or self._sm is None else str(self._sm.exit_status()),
        )

    def _local_shadows_ok(self) -> bool:
        shadows = self._current.shadows
        return (
            shadows is not None
            and shadows.dead() is None
            and self._sm is not None
            and self._sm.alive()
        )

    def _follow(
        self, worker_group: WorkerGroup, record: EpochRecord, result: RunResult | None
    ) -> RunResult:
        """Act on the job-wide decision for this generation: promote, or restart the group."""
        if record.action == "in_place" and not record.cold and not self._local_shadows_ok():
            if worker_group.group_world_size > 1:
                # The other nodes promote their shadows; then every node follows a cold
                # generation (its trainers must meet in one process group). Until then this
                # node's cold trainers wait in theirs.
                self._current.epochs.publish(
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
            # This node's shadows died since the decision: a cold generation here instead.
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
            # a recovery still unfinished stays counted: the job goes on in place from its state
            self._recover(worker_group, record)
            return RunResult(state=WorkerState.HEALTHY)
        self._to(Phase.RESTARTING)
        if self._current.recovery is not None:
            # a restart answered the promoted trainers before they all stepped: no recovery
            self.recoveries -= 1
            self._current.recovery = None
        self._restart_reason = f"{record.failure} on node {record.node}: {record.reason}"
        if record.fresh:
            # Not counted: torch's loop takes one restart off, and counts attempts as
            # max_restarts - remaining (its TORCHELASTIC_RESTART_COUNT, each attempt's store
            # prefix), so both go up by one.
            worker_group.spec.max_restarts += 1
            self._remaining_restarts += 1
            self._fresh_starts += 1
            logger.warning("fresh start: %s", self._restart_reason)
        else:
            log_group_restart(
                self._restart_reason,
                self._remaining_restarts,
                worker_group.spec.max_restarts - self._fresh_starts,
                self._leto.checkpoint,
            )
        if result is not None and result.state == WorkerState.FAILED:
            return result
        # Our own workers are healthy but the job is restarting: stop them, report them.
        assert self._pcontext is not None
        return stop_for_restart(worker_group, self._pcontext)

    def _recover(self, worker_group: WorkerGroup, record: EpochRecord) -> None:
        """Stop this node's actives and promote the next generation (every node does this):
        its live shadows, or with ``record.cold`` a generation started now, which attaches
        to the retained state as soon as it has started. Replacement shadows are spawned
        at once, so a failure in the promoted generation's first steps finds them."""
        attempt = self._current
        t_detect = attempt.detection.t if attempt.detection is not None else time.time()
        assert self._pcontext is not None
        assert record.epoch == attempt.generation + 1, (record.epoch, attempt.generation)
        epoch = record.epoch
        close_processes(self._pcontext, signal.SIGKILL)
        t_stopped = time.time()
        self._events.emit(Kind.ACTIVES_STOPPED, gen=attempt.generation, stop_s=t_stopped - t_detect)
        attempt.actives_stopped()
        self._inject_erasures()
        level = attempt.preinit.choose("recovery")  # the last actives' peak (reports outlive them)
        if record.cold or attempt.shadows is None:
            self._shadows.retire(self._attempt)
            self._shadows.spawn(
                attempt, worker_group, dataclasses.replace(level, reason="cold"), COLD_LAUNCH
            )
        shadows = attempt.shadows
        assert shadows is not None
        attempt.generation += 1
        t_promote = time.time()
        for worker in worker_group.workers:
            attempt.store.set(contract.promote(attempt.generation, worker.global_rank), str(epoch))
        # Ready shadows are warm: their first step is judged by the hang timeout. Shadows
        # still pre-initialising and cold generations import and build first (the
        # first-step timeout).
        warm = not record.cold and attempt.preinit.ready()
        attempt.shadows = None
        self._pcontext, attempt.actives = shadows.promote()
        attempt.preinit.closed()  # the shadows are the actives now
        attempt.hangs.arm(warm=warm)
        for worker, pid in zip(worker_group.workers, self._pcontext.pids().values(), strict=True):
            worker.id = pid
            priority.raise_promoted(pid)  # one still pre-initialising is a trainer now
        self._events.emit(
            Kind.SHADOWS_PROMOTED,
            gen=attempt.generation,
            epoch=epoch,
            promote_t=t_promote,
            node=worker_group.group_rank,
            cold=record.cold,
        )
        self.recoveries += 1
        attempt.recovery = Recovery(
            gen=attempt.generation,
            epoch=epoch,
            detected_t=t_detect,
            stopped_t=t_stopped,
            cold=record.cold,
        )
        self._to(Phase.RECOVERING)
        self._shadows.spawn(attempt, worker_group, level)

    def _watch_recovery(self, worker_group: WorkerGroup) -> None:
        """When every promoted trainer has stepped once, the recovery is done: its phases
        are the summary's of this node's events (each trainer writes its first step's
        ``step_done`` before it says it stepped)."""
        self._read_events()
        attempt = self._current
        if self._phase is not Phase.RECOVERING:
            return
        recovery = attempt.recovery
        assert recovery is not None
        if attempt.store.check(self._local_keys(worker_group, contract.stepped, recovery.gen)):
            attempt.recovery = None
            self._to(Phase.RUNNING)
            attempt.failures_in_a_row = 0
            self._read_events()
            rec = next(
                (r for r in reversed(self._summary.recoveries()) if r.gen == recovery.gen), None
            )
            self._events.emit(
                Kind.RECOVERY_DONE,
                **dataclasses.asdict(recovery),
                done_t=time.time(),
                phases_s={} if rec is None else rec.phases,
                total_s=None if rec is None else rec.total_s,
            )
            self._shadows.raise_level(attempt, worker_group)

    # -- the rest of the monitoring pass ------------------------------------------------------
    def _restart_count(self) -> int:
        """This attempt's number (group restarts so far, fresh starts included): torch's
        ``TORCHELASTIC_RESTART_COUNT``, so agent and trainers share each attempt's store prefix."""
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    @staticmethod
    def _local_keys(
        worker_group: WorkerGroup, key: Callable[[int, int], str], generation: int
    ) -> list[str]:
        """``key(generation, rank)`` of every local rank (``contract.registered``, ...)."""
        return [key(generation, w.global_rank) for w in worker_group.workers]

    def _watch_state_manager(self) -> None:
        """A dead state manager takes every retained region of the node with it: say so at
        once (the next failure restarts the group; the running trainers go on)."""
        attempt = self._current
        if self._sm is None or attempt.sm_death_seen or self._sm.alive():
            return
        attempt.sm_death_seen = True
        how = str(self._sm.exit_status())
        self._events.emit(Kind.STATE_MANAGER_DIED, how=how, gen=attempt.generation)
        logger.error(
            "the state manager died (%s): in-place recovery is lost on this node; the next failure "
            "restarts the group from the newest checkpoint",
            how,
        )

    def _watch_registration(self, worker_group: WorkerGroup) -> None:
        """Spawn shadows once every local active has joined through ``leto.init()``."""
        if self._phase is not Phase.STARTING or self._leto.recovery != "in_place":
            return
        if self._current.store.check(self._local_keys(worker_group, contract.registered, 0)):
            self._leto_job = True
            self._to(Phase.RUNNING)
            self._shadows.spawn(self._current, worker_group)

    def _read_events(self) -> None:
        """Feed the summary what was appended to the events file since the last call."""
        if self._tail is not None:
            for event in self._tail.new_events():
                self._summary.add(event)

    def _note_fired_faults(self) -> None:
        """Faults are claimed in the attempt's store; remember them across group restarts."""
        if self._attempt is None:
            return
        for i in range(len(self._leto.faults)):
            if i not in self._fired and self._attempt.raw_store.check([contract.fault_claim(i)]):
                self._fired.add(i)

    def _inject_erasures(self) -> None:
        """Page losses scheduled with a fault that has now fired (tests and demos)."""
        erasure = self._leto.erasure
        if erasure is None or self._sm is None:
            return
        raw_store = self._current.raw_store
        pool = self._sm.client()
        try:
            for i, fault in enumerate(self._leto.faults):
                if (
                    fault.erases
                    and i not in self._erased
                    and raw_store.check([contract.fault_claim(i)])
                ):
                    self._erased.add(i)
                    faults.erase_pages(pool, fault, i, erasure, self._events)
        finally:
            pool.close()
