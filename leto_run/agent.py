"""LetoAgent: torch.distributed.elastic's LocalElasticAgent plus in-place recovery.

The base class keeps what torchrun users rely on: rendezvous, the worker environment,
logs, ``--max-restarts`` and exit codes. Leto adds, per node:

* a state manager (spawned once per group attempt) that retains model state;
* for every local rank, an active trainer and a shadow trainer: the same script with
  ``LETO_ROLE=active|shadow`` and a generation number. Each generation is one torch
  ``PContext``, so logs, redirects and tee behave exactly as torchrun's;
* failure handling in ``_monitor_workers``: when an active dies from a signal (a
  hardware-operable failure on CPU) and the script uses the leto API, bump the recovery
  epoch in the store, SIGKILL the surviving actives (they are stuck in collectives and
  must not touch retained state again), promote the shadow generation through the
  store, and report the group HEALTHY. Anything else — a plain torchrun script, a script
  that raised, no shadows, a dead state manager — takes torchrun's group restart.

Shadows are spawned only after every local active has called ``leto.init()``, so a plain
torchrun script never sees one. Replacements after a recovery are spawned once every
promoted trainer has finished its first step, so they never slow the recovery itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import time
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

from leto import faults
from leto.config import LetoConfig
from leto.events import ENV_EVENTS_FILE, EventLog, Kind
from leto.pool.process import StateManagerProcess
from leto.trainer.context import ROLE_ACTIVE, ROLE_SHADOW, store_prefix

logger = logging.getLogger(__name__)


class GenerationLogsSpecs(DefaultLogsSpecs):
    """torchrun's log layout with one folder per trainer generation: ``attempt_0/gen_1/0/``."""

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        tagged = {
            rank: {**env, "TORCHELASTIC_RESTART_COUNT": f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}_gen{env.get('LETO_GENERATION', '0')}"}
            for rank, env in envs.items()
        }
        return super().reify(tagged)


class LetoAgent(LocalElasticAgent):
    """A LocalElasticAgent whose worker group survives trainer failures in place."""

    def __init__(self, spec: WorkerSpec, logs_specs: DefaultLogsSpecs, leto: LetoConfig, events: EventLog, **kwargs: Any) -> None:
        super().__init__(spec, logs_specs=logs_specs, **kwargs)
        self._leto = leto
        self._events = events
        self._sm: StateManagerProcess | None = None
        self._shadows: PContext | None = None
        self._generation = 0
        self._spawn_env: dict[str, str] = {}
        self._store: dist.Store | None = None
        self._uses_leto = False
        self._recovery: dict[str, Any] | None = None
        self._pidfds: dict[int, int] = {}
        self._raw_store: dist.Store | None = None
        self._erased: set[int] = set()
        self._fired: set[int] = set()
        self._worker_store: dist.TCPStore | None = None
        self._detected_t: float | None = None
        self._root_pid: int | None = None
        self.recoveries = 0

    # -- worker environment: the one seam torch offers inside _start_workers -----------------
    def _set_local_rank_env(self, worker_env: dict[str, str | None], local_rank: int, spec: WorkerSpec) -> None:
        super()._set_local_rank_env(worker_env, local_rank, spec)
        worker_env.update(self._spawn_env)

    def _spawn(self, worker_group: WorkerGroup, role: str, generation: int) -> PContext:
        """Start one generation of trainers for every local rank; returns its PContext."""
        assert self._sm is not None
        self._spawn_env = {
            "LETO_ROLE": role,
            "LETO_GENERATION": str(generation),
            "LETO_POOL_SOCKET": self._sm.socket_path,
            "LETO_SHADOW_LEVEL": str(self._leto.shadow_level),
            "LETO_CONSISTENCY": self._leto.consistency,
            "LETO_RMU_CHUNK_BYTES": str(self._leto.rmu_chunk_bytes),
            "LETO_DIGEST": "1" if self._leto.digest else "0",
            faults.ENV_FAULTS: faults.encode(self._leto.faults),
            faults.ENV_FAULTS_FIRED: ",".join(map(str, sorted(self._fired))),
            "LETO_ERASURE": json.dumps(dataclasses.asdict(self._leto.erasure)) if self._leto.erasure else "",
            ENV_EVENTS_FILE: str(self._events.path or ""),
        }
        active = self._pcontext
        try:
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
        if worker_group.group_rank == 0:
            self._worker_store = dist.TCPStore(
                worker_group.master_addr, 0, is_master=True, wait_for_workers=False,
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
            worker_group.master_addr, worker_group.master_port, is_master=False, timeout=timedelta(seconds=60)
        )
        self._raw_store = raw
        self._store = dist.PrefixStore(store_prefix(self._restart_count()), raw)
        self._generation, self._uses_leto, self._recovery = 0, False, None
        pcontext = self._spawn(worker_group, ROLE_ACTIVE, 0)
        self._events.emit(Kind.WORKERS_STARTED, restart=self._restart_count(), pids=pcontext.pids())
        return pcontext.pids()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._watch_registration(worker_group)
        self._watch_recovery(worker_group)
        self._detect_killed_active()
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.FAILED and self._can_recover(result):
            self._recover(worker_group, result)
            return RunResult(state=WorkerState.HEALTHY)
        if result.state == WorkerState.SUCCEEDED:
            self._close_shadows()
        return result

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._note_fired_faults()
        self._close_pidfds()
        self._close_shadows()
        super()._stop_workers(worker_group)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        self._close_shadows(death_sig)
        super()._shutdown(death_sig, timeout)

    def run(self, role: str = "default") -> RunResult:
        """The base run loop; the state manager outlives group restarts but not the agent."""
        try:
            return super().run(role)
        finally:
            self._close_shadows()
            if self._sm is not None:
                self._sm.stop()
                self._sm = None

    # -- leto --------------------------------------------------------------------------------
    def _restart_count(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def _local_keys(self, worker_group: WorkerGroup, what: str, generation: int) -> list[str]:
        return [f"{what}/{generation}/{w.global_rank}" for w in worker_group.workers]

    def _watch_registration(self, worker_group: WorkerGroup) -> None:
        """Spawn shadows once every local active has joined through ``leto.init()``."""
        if self._uses_leto or self._leto.recovery != "in_place" or self._store is None:
            return
        if self._store.check(self._local_keys(worker_group, "registered", 0)):
            self._uses_leto = True
            self._spawn_shadows(worker_group)

    def _spawn_shadows(self, worker_group: WorkerGroup) -> None:
        self._shadows = self._spawn(worker_group, ROLE_SHADOW, self._generation + 1)
        self._events.emit(Kind.SHADOWS_SPAWNED, gen=self._generation + 1, pids=self._shadows.pids())

    def _can_recover(self, result: RunResult) -> bool:
        if not self._uses_leto or self._shadows is None or self._sm is None or not self._sm.alive():
            return False
        if self._shadows.wait(0) is not None:  # a shadow died: the generation is incomplete
            return False
        # Killed by a signal: the hardware is still usable (a HOF on CPU). A script that
        # raised would raise again: that is torchrun's business (restart or fail).
        return any(f.exitcode < 0 for f in result.failures.values())

    def _detect_killed_active(self) -> None:
        """See a trainer killed by a signal without reaping it, and stop its peers at once.

        torch's PContext, on a failure, sends SIGTERM to the survivors and waits for them;
        peers stuck in a collective then take their time. With a pidfd and ``WNOWAIT`` we
        learn of the death first and SIGKILL the survivors, so the base class finds them
        all dead. Only for leto jobs, and only for deaths by signal (HOFs).
        """
        if not self._uses_leto or self._pcontext is None or self._detected_t is not None:
            return
        pids = list(self._pcontext.pids().values())
        for pid in pids:
            fd = self._pidfds.get(pid)
            if fd is None:
                try:
                    fd = self._pidfds[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue
            try:
                info = os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # already reaped by the base class: its business
                continue
            if info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
                self._detected_t, self._root_pid = time.time(), pid
                for other in pids:
                    if other != pid:
                        try:
                            os.kill(other, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                return

    def _close_pidfds(self) -> None:
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
        self._detected_t = self._root_pid = None

    def _recover(self, worker_group: WorkerGroup, result: RunResult) -> None:
        t_detect = self._detected_t or time.time()
        assert self._store is not None and self._pcontext is not None and self._shadows is not None
        failed = {rank: f.exitcode for rank, f in result.failures.items()}
        root = [w.global_rank for w in worker_group.workers if w.id == self._root_pid] or sorted(failed)
        self._events.emit(
            Kind.FAILURE_DETECTED, ranks=failed, root_ranks=root, gen=self._generation, detected_t=t_detect
        )
        epoch = self._store.add("epoch", 1)
        self._events.emit(Kind.EPOCH, epoch=epoch)
        self._pcontext.close(death_sig=signal.SIGKILL, timeout=5)
        t_stopped = time.time()
        self._events.emit(Kind.ACTIVES_STOPPED, gen=self._generation, stop_s=t_stopped - t_detect)
        self._close_pidfds()
        self._inject_erasures()
        self._generation += 1
        t_promote = time.time()
        self._store.set(f"promote/{self._generation}", str(epoch))
        self._pcontext, self._shadows = self._shadows, None
        for worker, pid in zip(worker_group.workers, self._pcontext.pids().values(), strict=True):
            worker.id = pid
        self._events.emit(Kind.SHADOWS_PROMOTED, gen=self._generation, epoch=epoch, promote_t=t_promote)
        self.recoveries += 1
        self._recovery = {"gen": self._generation, "epoch": epoch, "detected_t": t_detect, "stopped_t": t_stopped}

    def _note_fired_faults(self) -> None:
        """Faults are claimed in the attempt's store; remember them across group restarts."""
        if self._raw_store is None:
            return
        for i in range(len(self._leto.faults)):
            if i not in self._fired and self._raw_store.check([f"/leto/faults/{i}"]):
                self._fired.add(i)

    def _inject_erasures(self) -> None:
        """Page losses scheduled with a fault that has now fired (tests and demos)."""
        erasure = self._leto.erasure
        if erasure is None or self._sm is None:
            return
        pool = self._sm.client()
        try:
            for i, fault in enumerate(self._leto.faults):
                if fault.erases and i not in self._erased and self._raw_store.check([f"/leto/faults/{i}"]):
                    self._erased.add(i)
                    faults.erase_pages(pool, fault, i, erasure, self._events)
        finally:
            pool.close()

    def _watch_recovery(self, worker_group: WorkerGroup) -> None:
        """When every promoted trainer has stepped once, the recovery is done: new shadows."""
        if self._recovery is None or self._store is None:
            return
        if self._store.check(self._local_keys(worker_group, "stepped", self._recovery["gen"])):
            recovery, self._recovery = self._recovery, None
            self._events.emit(Kind.RECOVERY_DONE, **recovery, done_t=time.time())
            self._spawn_shadows(worker_group)

    def _close_shadows(self, death_sig: signal.Signals = signal.SIGKILL) -> None:
        if self._shadows is not None:
            self._shadows.close(death_sig=death_sig, timeout=5)
            self._shadows = None
