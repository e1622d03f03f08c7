"""LetoAgent: torch.distributed.elastic's LocalElasticAgent plus in-place recovery.

The base class keeps what torchrun users rely on: rendezvous, the worker environment,
logs, ``--max-restarts`` and exit codes. Leto adds, per node:

* a state manager (spawned once per group attempt) that retains model state;
* for every local rank, an active trainer and a shadow trainer: the same script with
  ``LETO_ROLE=active|shadow`` and a generation number. Each generation is one torch
  ``PContext``, so logs, redirects and tee behave exactly as torchrun's;
* failure handling in ``_monitor_workers`` (the decision in ``leto_run/policy.py``, its
  facts and the epoch in ``leto_run/failures.py``), job-wide through the recovery epoch
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
first steps finds them; where a node has no shadows at all, a cold generation attaches to
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
from collections.abc import Iterator
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

from leto import contract, faults, kernels
from leto.config import LetoConfig
from leto.device_health import NvmlHealth
from leto.epoch import EpochBoard, EpochRecord
from leto.events import ENV_EVENTS_FILE, EventLog, EventTail, Kind
from leto.health import ENV_HEARTBEAT, HangWatch, HeartbeatBoard, dying_signal
from leto.pool.process import StateManagerProcess
from leto.preinit.controller import PreinitController, ShadowState
from leto.preinit.levels import LevelChoice, ShadowLevel
from leto.summary import Summary
from leto.trainer.context import ENV_CHECKPOINT, ROLE_ACTIVE, ROLE_SHADOW
from leto_run.failures import FailurePolicy
from leto_run.warm_start import ForkServer, warm_spawns

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


@dataclasses.dataclass(frozen=True, slots=True)
class Recovery:
    """A recovery in progress: promoted, waiting for every promoted trainer's first step."""

    gen: int
    epoch: int
    detected_t: float
    stopped_t: float
    cold: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ProcessExit:
    """How a watched process ended: by ``signal``, or with ``exitcode`` (both None: it was
    reaped elsewhere, e.g. by torch's PContext, and its status is gone)."""

    signal: int | None = None
    exitcode: int | None = None


def _pids_of(worker_group: WorkerGroup, pcontext: PContext) -> dict[str, list[int]]:
    """A generation's processes for its event: ``pids[i]`` is global rank ``ranks[i]``'s."""
    pids = pcontext.pids()
    return {
        "pids": [pids[w.local_rank] for w in worker_group.workers],
        "ranks": [w.global_rank for w in worker_group.workers],
    }


class LetoAgent(FailurePolicy, LocalElasticAgent):
    """A LocalElasticAgent whose worker group survives trainer failures in place."""

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
        self._sm: StateManagerProcess | None = None
        self._shadows: PContext | None = None
        self._generation = 0
        self._spawn_env: dict[str, str] = {}
        self._store: dist.Store | None = None
        self._uses_leto = False
        self._recovery: Recovery | None = None
        self._failures_in_a_row = 0
        """HOFs since a generation last committed a step (``leto.failure_loop_limit``)."""
        self._job_token = contract.new_token()
        """The job's secret: every store key lives under it (``leto.contract``)."""
        self._sm_death_seen = False
        self._pidfds: dict[int, int] = {}
        self._raw_store: dist.Store | None = None
        self._erased: set[int] = set()
        self._fired: set[int] = set()
        self._worker_store: dist.TCPStore | None = None
        self._detected_t: float | None = None
        self._root_pid: int | None = None
        self._epochs: EpochBoard | None = None
        self._board: HeartbeatBoard | None = None
        self._hangs: HangWatch | None = None
        self._device_health = NvmlHealth()
        """GPU fatal-condition counters, baselined now (no CUDA context: NVML only)."""
        self._restart_reason = ""
        self._preinit: PreinitController | None = None
        self._launches: dict[int, int] = {}
        self._shadow_deaths = 0
        """Shadow generations that died in a row before every shadow became ready."""
        self._no_shadows_reason = ""
        """Why this node has no shadows although the job uses them (the group-restart reason)."""
        self.forkserver: ForkServer | None = None
        """Set by launch: group restarts start their workers from it (warm restarts)."""
        self.recoveries = 0
        self.restarts = 0

    # -- worker environment: the one seam torch offers inside _start_workers -----------------
    def _set_local_rank_env(
        self, worker_env: dict[str, str | None], local_rank: int, spec: WorkerSpec
    ) -> None:
        super()._set_local_rank_env(worker_env, local_rank, spec)
        worker_env.update(self._spawn_env)

    def _spawn(
        self,
        worker_group: WorkerGroup,
        role: str,
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
                # Shadows and restarts fork from the warm server (the first actives do not
                # wait for it to import torch).
                warm_spawns(
                    self.forkserver if role == ROLE_SHADOW or self._restart_count() > 0 else None
                ),
                _environ_overlay(None if _HAS_ENV_HOOK else self._spawn_env),
            ):
                super()._start_workers(worker_group)
            return self._pcontext  # type: ignore[return-value]
        finally:
            if role == ROLE_SHADOW:
                self._pcontext = active

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
        key = f"leto/worker_store/{self._restart_count()}"
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
        self._raw_store = raw
        self._store = dist.PrefixStore(
            contract.store_prefix(self._restart_count(), self._job_token), raw
        )
        self._generation, self._uses_leto, self._recovery = 0, False, None
        self._failures_in_a_row, self._sm_death_seen = 0, False
        self._epochs = EpochBoard(
            self._store, f"{worker_group.master_addr}:{worker_group.master_port}"
        )
        if self._board is None:
            self._board = HeartbeatBoard(worker_group.spec.local_world_size)
        self._hangs = HangWatch(
            self._board, self._leto.hang_timeout_s, self._leto.first_step_timeout_s
        )
        self._preinit = PreinitController(self._leto.preinit, self._leto.shadow_level, self._board)
        self._launches, self._shadow_deaths, self._no_shadows_reason = {}, 0, ""
        pcontext = self._spawn(worker_group, ROLE_ACTIVE, 0)
        self._events.emit(
            Kind.WORKERS_STARTED,
            restart=self._restart_count(),
            **_pids_of(worker_group, pcontext),
            warm=self.forkserver is not None and self._restart_count() > 0,
        )
        return pcontext.pids()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._watch_state_manager()
        self._watch_registration(worker_group)
        self._watch_recovery(worker_group)
        self._watch_preinit(worker_group)
        if self._uses_leto and self._epochs is not None:
            record = self._epochs.poll(self._generation + 1)
            if record is not None:  # another node saw a failure: do as it decided
                return self._follow(worker_group, record, None)
            self._watch_hangs(worker_group)
        self._detect_killed_active()
        self._watch_shadows(worker_group)
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and self._uses_leto and self._epochs is not None:
            return self._decide(worker_group, result)
        if result.state == WorkerState.SUCCEEDED:
            self._close_shadows()
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """torchrun's group restart (counted against --max-restarts), recorded as an event."""
        self.restarts += 1
        if not self._restart_reason and self._uses_leto and self._epochs is not None:
            # torch restarts on a membership change without counting it; when that change is
            # another node's restart decision seen late, count it as that node does, so the
            # nodes' restart counts (and so their worker stores) stay in step.
            record = self._epochs.poll(self._generation + 1)
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
        self._close_pidfds()
        self._close_shadows()
        super()._stop_workers(worker_group)

    def _shutdown(
        self, death_sig: signal.Signals = signal.SIGTERM, *args: Any, **kwargs: Any
    ) -> None:
        self._close_shadows(death_sig)
        super()._shutdown(death_sig, *args, **kwargs)

    def run(self, role: str = "default") -> RunResult:
        """The base run loop; the state manager outlives group restarts but not the agent."""
        try:
            return super().run(role)
        finally:
            self._close_shadows()
            if self._sm is not None:
                self._sm.stop()
                self._sm = None
            self._preinit = None  # its words live in the board
            if self._board is not None:
                self._board.close()
                self._board = None

    # -- leto --------------------------------------------------------------------------------
    def _restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def _local_keys(self, worker_group: WorkerGroup, what: str, generation: int) -> list[str]:
        key = {"registered": contract.registered, "stepped": contract.stepped}[what]
        return [key(generation, w.global_rank) for w in worker_group.workers]

    def _watch_state_manager(self) -> None:
        """A dead state manager takes every retained region of the node with it: say so at
        once (the next failure restarts the group; the running trainers go on)."""
        if self._sm is None or self._sm_death_seen or self._sm.alive():
            return
        self._sm_death_seen = True
        how = str(self._sm.exit_status())
        self._events.emit(Kind.STATE_MANAGER_DIED, how=how, gen=self._generation)
        logger.error(
            "the state manager died (%s): in-place recovery is lost on this node; the next failure "
            "restarts the group from the newest checkpoint",
            how,
        )

    def _watch_registration(self, worker_group: WorkerGroup) -> None:
        """Spawn shadows once every local active has joined through ``leto.init()``."""
        if self._uses_leto or self._leto.recovery != "in_place" or self._store is None:
            return
        if self._store.check(self._local_keys(worker_group, "registered", 0)):
            self._uses_leto = True
            self._spawn_shadows(worker_group)

    def _spawn_shadows(
        self,
        worker_group: WorkerGroup,
        choice: LevelChoice | None = None,
        launch: int | None = None,
    ) -> None:
        """Spawn the next generation's shadows at ``choice``'s level (default: the configured
        one), as launch ``launch`` (default: the next of this generation)."""
        assert self._store is not None and self._preinit is not None
        gen = self._generation + 1
        choice = choice or LevelChoice(
            level=ShadowLevel(self._leto.shadow_level), reason="configured"
        )
        level = choice.level
        if launch is None:
            launch = self._launches.get(gen, -1) + 1
        self._launches[gen] = launch
        self._no_shadows_reason = ""
        self._events.emit(Kind.SHADOW_LEVEL, gen=gen, **dataclasses.asdict(choice))
        self._shadows = self._spawn(worker_group, ROLE_SHADOW, gen, level=int(level), launch=launch)
        self._preinit.spawned(level)
        self._events.emit(
            Kind.SHADOWS_SPAWNED,
            gen=gen,
            **_pids_of(worker_group, self._shadows),
            level=int(level),
            launch=launch,
        )
        self._store.set(contract.shadows(gen, worker_group.group_rank), "1")

    def _detect_killed_active(self) -> None:
        """See a trainer killed by a signal without reaping it, and stop its peers at once.

        torch's PContext, on a failure, sends SIGTERM to the survivors and waits for them;
        peers stuck in a collective then take their time. With a pidfd and ``WNOWAIT`` we
        learn of the death first and SIGKILL the survivors, so the base class finds them
        all dead; ``dying_signal`` sees it even before the victim is a zombie, while the
        kernel still tears down its memory and CUDA context, so the survivors' teardowns
        overlap the victim's instead of following it. Only for leto jobs, and only for deaths
        by signal (HOFs).
        """
        if not self._uses_leto or self._pcontext is None or self._detected_t is not None:
            return
        pids = list(self._pcontext.pids().values())
        for pid in pids:
            try:
                end = self._exit_of(pid)
            except OSError:  # no pidfds (e.g. gVisor): the base class's poll still sees it
                return
            if end is not None and end.signal is not None:
                self._detected_t, self._root_pid = time.time(), pid
                for other in pids:
                    if other != pid:
                        try:
                            os.kill(other, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                return

    def _exit_of(self, pid: int) -> ProcessExit | None:
        """How ``pid`` (a child) ended, without reaping it; None while it lives. A signal is
        seen already while the kernel tears the process down (``dying_signal``). Raises
        OSError when pidfds are unavailable."""
        fd = self._pidfds.get(pid)
        if fd is None:
            try:
                fd = self._pidfds[pid] = os.pidfd_open(pid)
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

    def _drop_pidfds(self, pids: Iterator[int] | list[int]) -> None:
        for pid in pids:
            fd = self._pidfds.pop(pid, None)
            if fd is not None:
                os.close(fd)

    def _dead_shadow(self) -> tuple[int, ProcessExit] | None:
        """The first local shadow (local rank, how it ended) that is gone, else None."""
        if self._shadows is None:
            return None
        for local_rank, pid in self._shadows.pids().items():
            try:
                end = self._exit_of(pid)
            except OSError:  # no pidfds: torch's poll (it reaps) is all there is
                result = self._shadows.wait(0)
                if result is None:
                    return None
                failure = min(result.failures.values(), key=lambda f: f.timestamp, default=None)
                return (failure.local_rank if failure else local_rank), ProcessExit(
                    exitcode=failure.exitcode if failure else 0
                )
            if end is not None:
                return local_rank, end
        return None

    def _watch_shadows(self, worker_group: WorkerGroup) -> None:
        """A shadow that died before promotion (crash, OOM kill, SIGKILL): retract its
        generation's readiness and relaunch it at the same level, unless shadows keep dying
        (``preinit.shadow_deaths_limit`` in a row before becoming ready): then none, and the next
        failure restarts the group. The whole local generation goes: at L3 its shadows share
        a process group that a dead member breaks."""
        ctrl = self._preinit
        if (
            self._shadows is None
            or ctrl is None
            or ctrl.state is not ShadowState.LIVE
            or self._detected_t is not None
        ):
            return
        dead = self._dead_shadow()
        if dead is None:
            if self._shadow_deaths and ctrl.ready():
                self._shadow_deaths = 0  # a replacement made it: in-place recovery is back
            return
        assert self._store is not None
        local_rank, end = dead
        gen, level, pids = self._generation + 1, int(ctrl.level), self._shadows.pids()
        self._store.delete_key(
            contract.shadows(gen, worker_group.group_rank)
        )  # not ready for a HOF
        self._shadows.close(death_sig=signal.SIGKILL, timeout=5)  # returns once reaped
        self._shadows = None
        self._drop_pidfds(list(pids.values()))
        ctrl.closed()  # clears the ready words on the board
        self._shadow_deaths += 1
        rank = worker_group.workers[local_rank].global_rank
        self._events.emit(
            Kind.SHADOW_DIED,
            gen=gen,
            rank=rank,
            level=level,
            pid=pids[local_rank],
            signal=end.signal,
            exitcode=end.exitcode,
            deaths=self._shadow_deaths,
        )
        logger.warning(
            "rank %d's shadow (gen %d, level %d, pid %d) died before promotion (%s)",
            rank,
            gen,
            level,
            pids[local_rank],
            f"signal {end.signal}" if end.signal is not None else f"exit code {end.exitcode}",
        )
        why = ""
        if worker_group.group_world_size > 1:
            # As after a reclaim: the shadows of every node share one process group.
            why = "multi-node job: a node's shadows cannot be relaunched alone"
        elif self._shadow_deaths >= self._leto.preinit.shadow_deaths_limit:
            why = f"shadows died {self._shadow_deaths} times in a row before becoming ready"
        if why:
            self._no_shadows_reason = f"rank {rank}'s shadow died; not relaunched ({why})"
            ctrl.gave_up()
            self._events.emit(
                Kind.SHADOWS_GIVEN_UP,
                gen=gen,
                rank=rank,
                level=level,
                deaths=self._shadow_deaths,
                reason=why,
            )
            logger.error("%s: the next failure restarts the group", self._no_shadows_reason)
            return
        self._spawn_shadows(
            worker_group, LevelChoice(level=ShadowLevel(level), reason="shadow_died")
        )

    def _close_pidfds(self) -> None:
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        self._detected_t = self._root_pid = None

    def _recover(self, worker_group: WorkerGroup, record: EpochRecord) -> None:
        """Stop this node's actives and promote the next generation (every node does this):
        its live shadows, or with ``record.cold`` a generation started now, which attaches
        to the retained state as soon as it has started. Replacement shadows are spawned
        at once, so a failure in the promoted generation's first steps finds them."""
        t_detect = self._detected_t or time.time()
        assert self._store is not None and self._pcontext is not None and self._preinit is not None
        assert record.epoch == self._generation + 1, (record.epoch, self._generation)
        epoch = record.epoch
        self._pcontext.close(death_sig=signal.SIGKILL, timeout=5)
        t_stopped = time.time()
        self._events.emit(Kind.ACTIVES_STOPPED, gen=self._generation, stop_s=t_stopped - t_detect)
        self._close_pidfds()
        self._inject_erasures()
        level = self._preinit.choose("recovery")  # the last actives' peak (reports outlive them)
        if record.cold or self._shadows is None:
            self._close_shadows()
            self._spawn_shadows(
                worker_group, dataclasses.replace(level, reason="cold"), launch=COLD_LAUNCH
            )
        assert self._shadows is not None
        self._generation += 1
        t_promote = time.time()
        for worker in worker_group.workers:
            self._store.set(contract.promote(self._generation, worker.global_rank), str(epoch))
        # Ready shadows are warm: their first step is judged by the hang timeout. Shadows
        # still pre-initialising and cold generations import and build first (the
        # first-step timeout).
        warm = not record.cold and self._preinit.ready()
        self._pcontext, self._shadows = self._shadows, None
        self._preinit.closed()  # the shadows are the actives now
        if self._hangs is not None:
            self._hangs.arm(warm=warm)
        for worker, pid in zip(worker_group.workers, self._pcontext.pids().values(), strict=True):
            worker.id = pid
        self._events.emit(
            Kind.SHADOWS_PROMOTED,
            gen=self._generation,
            epoch=epoch,
            promote_t=t_promote,
            node=worker_group.group_rank,
            cold=record.cold,
        )
        self.recoveries += 1
        self._recovery = Recovery(
            gen=self._generation,
            epoch=epoch,
            detected_t=t_detect,
            stopped_t=t_stopped,
            cold=record.cold,
        )
        self._spawn_shadows(worker_group, level)

    def _note_fired_faults(self) -> None:
        """Faults are claimed in the attempt's store; remember them across group restarts."""
        if self._raw_store is None:
            return
        for i in range(len(self._leto.faults)):
            if i not in self._fired and self._raw_store.check([contract.fault_claim(i)]):
                self._fired.add(i)

    def _inject_erasures(self) -> None:
        """Page losses scheduled with a fault that has now fired (tests and demos)."""
        erasure = self._leto.erasure
        if erasure is None or self._sm is None:
            return
        pool = self._sm.client()
        try:
            for i, fault in enumerate(self._leto.faults):
                if (
                    fault.erases
                    and i not in self._erased
                    and self._raw_store.check([contract.fault_claim(i)])
                ):
                    self._erased.add(i)
                    faults.erase_pages(pool, fault, i, erasure, self._events)
        finally:
            pool.close()

    def _watch_recovery(self, worker_group: WorkerGroup) -> None:
        """When every promoted trainer has stepped once, the recovery is done: its phases
        are the summary's of this node's events (each trainer writes its first step's
        ``step_done`` before it says it stepped)."""
        self._read_events()
        if self._recovery is None or self._store is None:
            return
        if self._store.check(self._local_keys(worker_group, "stepped", self._recovery.gen)):
            recovery, self._recovery = self._recovery, None
            self._failures_in_a_row = 0
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
            self._raise_shadow_level(worker_group)

    def _read_events(self) -> None:
        """Feed the summary what was appended to the events file since the last call."""
        if self._tail is not None:
            for event in self._tail.new_events():
                self._summary.add(event)

    def _raise_shadow_level(self, worker_group: WorkerGroup) -> None:
        """The replacements were spawned at promotion, at the level the previous actives'
        peak allowed; the fresh actives have now reported theirs (a transient peak, e.g. an
        OOM's, is gone): relaunch the shadows higher when a higher level fits. Single node
        only (a node's shadows cannot join the others' group alone)."""
        ctrl = self._preinit
        if ctrl is None or ctrl.state is not ShadowState.LIVE or worker_group.group_world_size > 1:
            return
        choice = ctrl.choose("recovery")
        if choice.level <= ctrl.level:
            return
        self._close_shadows()
        assert self._store is not None
        self._store.delete_key(contract.shadows(self._generation + 1, worker_group.group_rank))
        self._spawn_shadows(worker_group, choice)

    def _close_shadows(self, death_sig: signal.Signals = signal.SIGKILL) -> None:
        if self._shadows is not None:
            self._drop_pidfds(list(self._shadows.pids().values()))
            self._shadows.close(death_sig=death_sig, timeout=5)
            self._shadows = None
        if self._preinit is not None:
            self._preinit.closed()

    def _watch_preinit(self, worker_group: WorkerGroup) -> None:
        """Answer actives' OOMs by reclaiming the shadows; relaunch them when it is known
        what fits (every active committed the retried step and reported its memory)."""
        ctrl = self._preinit
        if ctrl is None or not self._uses_leto or self._detected_t is not None:
            return  # during a failure the actives are being stopped anyway
        slots = ctrl.requests()
        if slots:
            self._reclaim_shadows(worker_group, slots)
        if ctrl.relaunch_due():
            if worker_group.group_world_size > 1:
                # The shadows of every node share one process group; relaunching this node's
                # alone would not join it. Until the next recovery a HOF restarts the group.
                logger.warning(
                    "shadows reclaimed on a multi-node job: not relaunched until the next recovery"
                )
                ctrl.closed()
                return
            self._spawn_shadows(worker_group, ctrl.choose("oom"))

    def _reclaim_shadows(self, worker_group: WorkerGroup, slots: list[int]) -> None:
        """SIGKILL this node's shadows, reap them, then answer the waiting trainers."""
        assert self._preinit is not None and self._store is not None
        ranks = [worker_group.workers[s].global_rank for s in slots]
        level = 0
        if self._shadows is not None and self._preinit.state is ShadowState.LIVE:
            level, t0, pids = int(self._preinit.level), time.time(), self._shadows.pids()
            self._drop_pidfds(list(pids.values()))
            self._shadows.close(death_sig=signal.SIGKILL, timeout=5)  # returns once reaped
            self._shadows = None
            self._preinit.reclaimed()
            gen = self._generation + 1
            self._store.delete_key(
                contract.shadows(gen, worker_group.group_rank)
            )  # not ready for a HOF
            self._events.emit(
                Kind.SHADOW_RECLAIMED,
                gen=gen,
                level=level,
                ranks=ranks,
                pids=list(pids.values()),
                reclaim_s=time.time() - t0,
                reclaims=self._preinit.reclaims,
            )
        self._preinit.answer(slots, level)
