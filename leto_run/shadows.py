"""This node's shadows: spawn, watch, reclaim for an OOM, relaunch.

:class:`Shadows` acts on the current :class:`~leto_run.agent_state.Attempt` (its
``shadows``, pre-initialisation controller, store and counters) and is handed the rest
explicitly: how to start one generation of shadow processes (``spawn``, the agent's torch
``PContext`` launch), the event log and the settings it reads. Every teardown goes through
``ShadowGeneration.retire``. The agent (``leto_run.agent``) calls it from its monitoring
pass and around a promotion.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from collections.abc import Callable

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.multiprocessing import PContext

from leto import contract
from leto.events import EventLog, Kind
from leto.preinit.controller import ShadowState
from leto.preinit.levels import LevelChoice, ShadowLevel
from leto_run.agent_state import Attempt, ShadowGeneration

logger = logging.getLogger(__name__)

Spawn = Callable[[WorkerGroup, int, ShadowLevel, int], PContext]
"""Start shadows of generation ``gen`` at ``level`` as launch ``launch`` for every local
rank (``spawn(worker_group, gen, level, launch)``); returns their PContext."""


def pids_of(worker_group: WorkerGroup, pcontext: PContext) -> dict[str, list[int]]:
    """A generation's processes for its event: ``pids[i]`` is global rank ``ranks[i]``'s."""
    pids = pcontext.pids()
    return {
        "pids": [pids[w.local_rank] for w in worker_group.workers],
        "ranks": [w.global_rank for w in worker_group.workers],
    }


class Shadows:
    """Keeps the next generation's shadows of this node alive, or says why it cannot."""

    def __init__(
        self, *, spawn: Spawn, events: EventLog, shadow_level: int, deaths_limit: int
    ) -> None:
        self._spawn = spawn
        self._events = events
        self._shadow_level = shadow_level
        """The configured level (``leto.shadow_level``)."""
        self._deaths_limit = deaths_limit
        """``preinit.shadow_deaths_limit``: deaths in a row before no more relaunches."""

    def spawn(
        self,
        attempt: Attempt,
        worker_group: WorkerGroup,
        choice: LevelChoice | None = None,
        launch: int | None = None,
    ) -> None:
        """Spawn the next generation's shadows at ``choice``'s level (default: the configured
        one), as launch ``launch`` (default: the next of this generation)."""
        gen = attempt.generation + 1
        choice = choice or LevelChoice(level=ShadowLevel(self._shadow_level), reason="configured")
        level = choice.level
        if launch is None:
            launch = attempt.launches.get(gen, -1) + 1
        attempt.launches[gen] = launch
        attempt.no_shadows_reason = ""
        self._events.emit(Kind.SHADOW_LEVEL, gen=gen, **dataclasses.asdict(choice))
        pcontext = self._spawn(worker_group, gen, level, launch)
        attempt.shadows = ShadowGeneration(gen=gen, level=level, launch=launch, pcontext=pcontext)
        attempt.preinit.spawned(level, gen)
        self._events.emit(
            Kind.SHADOWS_SPAWNED,
            gen=gen,
            **pids_of(worker_group, pcontext),
            level=int(level),
            launch=launch,
        )
        attempt.store.set(contract.shadows(gen, worker_group.group_rank), "1")

    @staticmethod
    def retire(attempt: Attempt | None, death_sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop this node's shadows, if any, for a reason other than a reclaim."""
        if attempt is None:
            return
        if attempt.shadows is not None:
            attempt.shadows.retire(death_sig)
            attempt.shadows = None
        attempt.preinit.closed()

    def watch(self, attempt: Attempt, worker_group: WorkerGroup) -> None:
        """A shadow that died before promotion (crash, OOM kill, SIGKILL): retract its
        generation's readiness and relaunch it at the same level, unless shadows keep dying
        (``preinit.shadow_deaths_limit`` in a row before becoming ready): then none, and the
        next failure restarts the group. The whole local generation goes: at L3 its shadows
        share a process group that a dead member breaks."""
        ctrl, shadows = attempt.preinit, attempt.shadows
        if shadows is None or ctrl.state is not ShadowState.LIVE or attempt.detection is not None:
            return
        dead = shadows.dead()
        if dead is None:
            if attempt.shadow_deaths and ctrl.ready():
                attempt.shadow_deaths = 0  # a replacement made it: in-place recovery is back
            return
        local_rank, end = dead
        gen, level = shadows.gen, int(shadows.level)
        attempt.store.delete_key(contract.shadows(gen, worker_group.group_rank))  # not ready
        attempt.shadows = None
        pids = shadows.retire()
        ctrl.closed()  # clears the ready words on the board
        attempt.shadow_deaths += 1
        rank = worker_group.workers[local_rank].global_rank
        self._events.emit(
            Kind.SHADOW_DIED,
            gen=gen,
            rank=rank,
            level=level,
            pid=pids[local_rank],
            signal=end.signal,
            exitcode=end.exitcode,
            deaths=attempt.shadow_deaths,
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
        elif attempt.shadow_deaths >= self._deaths_limit:
            why = f"shadows died {attempt.shadow_deaths} times in a row before becoming ready"
        if why:
            attempt.no_shadows_reason = f"rank {rank}'s shadow died; not relaunched ({why})"
            ctrl.gave_up()
            self._events.emit(
                Kind.SHADOWS_GIVEN_UP,
                gen=gen,
                rank=rank,
                level=level,
                deaths=attempt.shadow_deaths,
                reason=why,
            )
            logger.error("%s: the next failure restarts the group", attempt.no_shadows_reason)
            return
        self.spawn(
            attempt, worker_group, LevelChoice(level=ShadowLevel(level), reason="shadow_died")
        )

    def raise_level(self, attempt: Attempt, worker_group: WorkerGroup) -> None:
        """The replacements were spawned at promotion, at the level the previous actives'
        peak allowed; the fresh actives have now reported theirs (a transient peak, e.g. an
        OOM's, is gone): relaunch the shadows higher when a higher level fits. Single node
        only (a node's shadows cannot join the others' group alone)."""
        ctrl = attempt.preinit
        if ctrl.state is not ShadowState.LIVE or worker_group.group_world_size > 1:
            return
        choice = ctrl.choose("recovery")
        if choice.level <= ctrl.level:
            return
        self.retire(attempt)
        attempt.store.delete_key(contract.shadows(attempt.generation + 1, worker_group.group_rank))
        self.spawn(attempt, worker_group, choice)

    def answer_oom(self, attempt: Attempt, worker_group: WorkerGroup) -> None:
        """Answer actives' OOMs by reclaiming the shadows; relaunch them when it is known
        what fits (every active committed the retried step and reported its memory)."""
        ctrl = attempt.preinit
        if attempt.detection is not None:
            return  # during a failure the actives are being stopped anyway
        slots = ctrl.requests()
        if slots:
            self._reclaim(attempt, worker_group, slots)
        if ctrl.relaunch_due():
            if worker_group.group_world_size > 1:
                # The shadows of every node share one process group; relaunching this node's
                # alone would not join it. Until the next recovery a HOF restarts the group.
                logger.warning(
                    "shadows reclaimed on a multi-node job: not relaunched until the next recovery"
                )
                ctrl.closed()
                return
            self.spawn(attempt, worker_group, ctrl.choose("oom"))

    def _reclaim(self, attempt: Attempt, worker_group: WorkerGroup, slots: list[int]) -> None:
        """SIGKILL this node's shadows, reap them, then answer the waiting trainers."""
        ctrl, shadows = attempt.preinit, attempt.shadows
        ranks = [worker_group.workers[s].global_rank for s in slots]
        level = 0
        if shadows is not None and ctrl.state is ShadowState.LIVE:
            level, t0 = int(shadows.level), time.time()
            attempt.shadows = None
            pids = shadows.retire()
            ctrl.reclaimed()
            # not ready for a HOF
            attempt.store.delete_key(contract.shadows(shadows.gen, worker_group.group_rank))
            self._events.emit(
                Kind.SHADOW_RECLAIMED,
                gen=shadows.gen,
                level=level,
                ranks=ranks,
                pids=list(pids.values()),
                reclaim_s=time.time() - t0,
                reclaims=ctrl.reclaims,
            )
        ctrl.answer(slots, level)
