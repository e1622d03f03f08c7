"""Fault injection, shipped in the package so demos, tests and real clusters share it.

A schedule of :class:`~leto.config.FaultSpec` (kill rank r at step s in phase p) reaches
every trainer through ``LETO_FAULTS`` (JSON). Each fault fires once per job: before the
SIGKILL the trainer records it in the rendezvous store, so the re-run of the interrupted
step on the promoted trainer does not fire it again. ``injected`` counts what this process
fired (it is always 0 after a kill, so tests count ``fault_injected`` events instead).
Tests that drive a trainer or an updater in process schedule kills with
:meth:`FaultInjector.fail_at` and make :attr:`FaultInjector.stop` raise.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from dataclasses import asdict

from leto.config import PHASES, FaultSpec
from leto.contract import ENV_POOL_SOCKET
from leto.erasure.config import ErasureConfig
from leto.errors import ConfigError
from leto.events import EventLog, Kind
from leto.pool.client import PoolClient

ENV_FAULTS = "LETO_FAULTS"
ENV_FAULTS_FIRED = "LETO_FAULTS_FIRED"  # ids that fired in an earlier group attempt


def encode(faults: list[FaultSpec]) -> str:
    return json.dumps([asdict(f) for f in faults])


def decode(text: str) -> list[FaultSpec]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{ENV_FAULTS} is not valid JSON: {e}") from None
    return [FaultSpec(**item) for item in items]


class FaultInjector:
    """Kills this process (or raises an OOM) at the scheduled (step, phase) points of its rank."""

    def __init__(
        self,
        rank: int,
        faults: list[FaultSpec],
        events: EventLog,
        claim: Callable[[int], bool],
        fired: frozenset[int] = frozenset(),
    ) -> None:
        """``claim(i)`` marks fault i as fired job-wide; False when it already fired."""
        self.rank = rank
        self.events = events
        self._claim = claim
        self._mine = [(i, f) for i, f in enumerate(faults) if f.rank == rank and i not in fired]
        self.injected = 0
        self.step = -1
        self.report_fatal: Callable[[], None] = lambda: None
        """Called before the kill of a ``kind: fatal`` fault (the trainer tells its agent)."""
        self.break_device: Callable[[], None] = lambda: None
        """Called before the kill of a ``kind: device`` fault (marks this rank's device bad)."""
        self.shadow_present: Callable[[], bool] = lambda: False
        """``kind: oom`` faults fire only while this is true (the node's shadows hold device memory)."""
        self.on_oom: Callable[[int], None] = lambda nbytes: None
        """Called with a ``kind: oom`` fault's ``oom_bytes`` before it raises."""
        self.wait_for_shadow: Callable[[], None] = lambda: None
        """Returns once this rank's shadow is ready (faults with ``shadow_ready_steps_before``)."""
        self.kill_shadow: Callable[[], None] = lambda: None
        """Kills this rank's ready shadow, returns once the agent retracted it (``kind: kill_shadow``)."""
        self.drop_region: Callable[[str], None] = self._drop_region
        """Drops a retained region of this rank from the state manager (``drop_region``)."""
        self.stop: Callable[[FaultSpec], None] = _signal_self
        """Ends this process once a fault fired: SIGKILL (SIGSTOP for ``kind: hang``). A test
        that drives a trainer or an updater in process raises instead: what the fault
        interrupted stays as a kill would leave it."""

    @classmethod
    def from_env(cls, rank: int, events: EventLog, claim: Callable[[int], bool]) -> FaultInjector:
        fired = frozenset(int(i) for i in os.environ.get(ENV_FAULTS_FIRED, "").split(",") if i)
        return cls(rank, decode(os.environ.get(ENV_FAULTS, "[]")), events, claim, fired)

    def fail_at(
        self,
        rank: int,
        step: int,
        phase: str = "forward",
        *,
        point: str | None = None,
        chunk: int | None = None,
    ) -> FaultInjector:
        """Chainable: schedule a kill of ``rank`` at ``step``'s ``phase`` as a
        :class:`~leto.config.FaultSpec` would (``point``, ``chunk``: where inside the update;
        chunk None: the first one reached), for tests that drive a trainer or an updater in
        process; they set :attr:`step` as the trainer does and :attr:`stop` to raise."""
        if rank == self.rank:
            spec = FaultSpec(rank=rank, step=step, phase=phase, point=point, chunk=chunk)  # type: ignore[arg-type]
            self._mine.append((len(self._mine) + 1000, spec))
        return self

    def scheduled(self, phase: str, *, chunk: int | None = None) -> bool:
        """Whether a fault of this rank may fire at this step's ``phase`` (at any of its
        sub-points; in ``chunk``, where given): work that an ``on_fire`` emulation reads back
        is kept for it."""
        return any(
            f.step == self.step
            and f.phase == phase
            and (chunk is None or f.chunk is None or f.chunk == chunk)
            for _, f in self._mine
        )

    def point(
        self,
        phase: str,
        *,
        at: str | None = None,
        chunk: int | None = None,
        on_fire: Callable[[], None] | None = None,
    ) -> None:
        """Called by the trainer at each phase point of the current step.

        ``at`` / ``chunk`` name a sub-point of the update (``FaultSpec.point`` / ``chunk``);
        ``on_fire`` runs just before the kill (e.g. to scribble over a half-written buffer,
        as an aborted kernel or copy would leave it).
        """
        if phase not in PHASES:
            raise ValueError(phase)
        for _, fault in self._mine:
            n = fault.shadow_ready_steps_before
            if n and phase == "forward" and self.step == fault.step - n:
                self.wait_for_shadow()  # the shadow maps the regions ahead; the kill lands n steps on
        for i, fault in self._mine:
            if fault.step != self.step or fault.phase != phase or fault.point != at:
                continue
            if fault.chunk is not None and fault.chunk != chunk:
                continue
            if fault.kind == "oom" and not self.shadow_present():
                continue  # emulates the shadows' footprint: without it the allocation would fit
            if fault.kind == "shadow_crash":
                continue  # fired by the shadows themselves (shadow_launched)
            if fault.kind == "kill_shadow":
                self.wait_for_shadow()  # a ready shadow is the one to kill (before the claim)
            if self._claim(i):
                self.injected += 1
                if on_fire is not None and fault.kind != "oom":  # the emulated aftermath first:
                    on_fire()  # the event then times the kill itself
                self.events.emit(
                    Kind.FAULT_INJECTED,
                    rank=self.rank,
                    step=self.step,
                    phase=phase,
                    fault=i,
                    point=at,
                    chunk=chunk,
                    fault_kind=fault.kind,
                )
                if fault.kind == "oom":
                    self._raise_oom(fault)
                if fault.kind == "kill_shadow":
                    self.kill_shadow()
                    continue
                if fault.kind == "fatal":
                    self.report_fatal()
                elif fault.kind == "device":
                    self.break_device()
                if fault.drop_region is not None:
                    self.drop_region(fault.drop_region)
                self.stop(fault)

    def _drop_region(self, name: str) -> None:
        pool = PoolClient(os.environ[ENV_POOL_SOCKET])
        try:
            pool.free(self.rank, name)
        finally:
            pool.close()

    def recovery_point(self, point: str, step: int) -> None:
        """Called by a promoted trainer inside its recovery, before it resumes at ``step``
        (``phase: recovery`` faults; the step loop has not set ``self.step`` yet)."""
        for i, fault in self._mine:
            if (
                fault.phase == "recovery"
                and fault.point == point
                and fault.step == step
                and self._claim(i)
            ):
                self.injected += 1
                self.events.emit(
                    Kind.FAULT_INJECTED,
                    rank=self.rank,
                    step=step,
                    phase="recovery",
                    fault=i,
                    point=point,
                    chunk=None,
                    fault_kind=fault.kind,
                )
                self.stop(fault)

    def shadow_launched(self) -> None:
        """Called by a shadow during its pre-initialisation: a ``kind: shadow_crash`` fault of
        this rank kills it, at every launch (a shadow that cannot start; never claimed)."""
        for i, fault in self._mine:
            if fault.kind == "shadow_crash":
                self.injected += 1
                self.events.emit(
                    Kind.FAULT_INJECTED,
                    rank=self.rank,
                    step=self.step,
                    phase="preinit",
                    fault=i,
                    point=None,
                    chunk=None,
                    fault_kind=fault.kind,
                )
                self.stop(fault)  # kind shadow_crash: SIGKILL

    def _raise_oom(self, fault: FaultSpec) -> None:
        import torch

        self.on_oom(fault.oom_bytes)
        raise torch.OutOfMemoryError(
            f"injected: rank {self.rank} step {self.step} {fault.phase}: an allocation does not fit "
            "beside this node's shadows"
        )

    @property
    def pending(self) -> bool:
        return bool(self._mine)


def _signal_self(fault: FaultSpec) -> None:
    os.kill(os.getpid(), signal.SIGSTOP if fault.kind == "hang" else signal.SIGKILL)


def erase_pages(
    pool: PoolClient, fault: FaultSpec, fault_id: int, erasure: ErasureConfig, events: EventLog
) -> None:
    """Lose the pages a fault asks for, at recovery time (the agent calls this on its node).

    Device pages come from the rank's model state ("state"): the state manager closes the
    fds of the chunks that hold them, so their memory is gone once no trainer maps them
    and the promoted trainer's page-map query finds them. Host pages come from its tier-1
    parity ("state.p1"): punched out of the memfd and made inaccessible to the probe. The
    choice is deterministic in the fault's index.
    """
    from leto.erasure.protection import pages_to_erase

    for region, count, group_pages in (
        (fault.erase_device_region, fault.erase_device_pages, erasure.data_pages),
        ("state.p1", fault.erase_host_pages, erasure.tier1_parity),
    ):
        spec = pool.describe(fault.rank, region)
        if not count or spec is None:
            continue
        total = spec.nbytes // erasure.page_bytes
        pages = pages_to_erase(total, count, group_pages, fault.erase_group, seed=fault_id)
        pages = pool.erase(fault.rank, region, erasure.page_bytes, pages)
        events.emit(Kind.PAGES_ERASED, rank=fault.rank, region=region, pages=pages, fault=fault_id)
