"""The checkpoint kept for fatal failures (FFs): asynchronous torch.distributed.checkpoint.

In-place recovery covers hardware-operable failures (HOFs). What it cannot cover — a
device that is gone, retained state that cannot be rebuilt, a dead state manager —
restarts the worker group the torchrun way, and the new trainers load the newest complete
checkpoint. Since only FFs need it, the interval comes from Young's formula with the FF
rate: ``sqrt(2 C MTTF_FF)`` where ``MTTF_FF = MTTF / (1 - h)`` (the paper's §8.1), with
``C`` the time the save blocks training (staging; the write runs in a background thread).

What is saved is exactly the retained state, as DCP keys: ``model.<fqn>`` (parameters),
``optim.<fqn>.<key>`` (AdamW step, exp_avg, exp_avg_sq) — replicated across data-parallel
ranks, so DCP writes them once — and per rank ``buffer.rank<r>.<fqn>`` (BatchNorm's running
statistics are each rank's own), ``rng.rank<r>`` and ``extras.rank<r>`` (the records of the
stateful objects: schedulers, hyperparameters, a loader; ``leto.trainer.extras``). It is
loaded in place into the retained views, so the restarted run is bit-identical to the
fault-free run from the checkpoint's step on.

A checkpoint that cannot be written (full or read-only disk, any error while staging or in
the background save) is an event (``checkpoint_failed``) and a warning, never the death of
training: the checkpoint only serves the rare FF, and a trainer that died of it would
replay into the same error on every group restart. The next interval tries again.

Survivors' retained state is *not* reused after an FF (see docs/ARCHITECTURE.md): the
failed rank's state is lost with its device, survivors can be mid-update of a step the
failed rank never finished, and with sharded state nothing holds the lost shard. The
checkpoint is the one consistent cut.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from leto.events import EventLog, Kind
from leto.sim.closed_form import young_interval_iters

if TYPE_CHECKING:
    from leto.config import CheckpointConfig

logger = logging.getLogger(__name__)

COMPLETE = "LETO_COMPLETE"
_PREFIX = "step_"


def young_interval_steps(cost_s: float, iteration_s: float, config: CheckpointConfig) -> int:
    """Young's interval for the FF rate, in whole steps (at least 1)."""
    steps = young_interval_iters(cost_s, config.ff_mttf_s, max(iteration_s, 1e-9))
    return 1 if steps < 1 else (1 << 62 if math.isinf(steps) else round(steps))


def complete_steps(root: Path) -> list[int]:
    """The steps of the checkpoints under ``root`` whose save finished on every rank, sorted."""
    return sorted(_step(d) for d in _dirs(root) if (d / COMPLETE).is_file())


def newest_complete(root: Path) -> int | None:
    """The step of the newest checkpoint whose save finished on every rank."""
    return max(complete_steps(root), default=None)


def _step(d: Path) -> int:
    return int(d.name[len(_PREFIX) :])


def _dirs(root: Path) -> list[Path]:
    try:
        entries = list(root.iterdir())
    except OSError:  # missing, not a directory, unreadable: no checkpoint there
        return []
    return [
        d
        for d in entries
        if d.name.startswith(_PREFIX) and d.name[len(_PREFIX) :].isdigit() and d.is_dir()
    ]


def _describe(error: BaseException) -> str:
    """One line: the error itself (DCP's names each failed rank's, with a traceback)."""
    if isinstance(error, CheckpointException):
        return "; ".join(
            f"rank {rank}: {_describe(exc)}"
            for rank, (exc, _trace) in sorted(error.failures.items())
        )[:500]
    return f"{type(error).__name__}: {error}".replace("\n", " ")[:500]


class Checkpointer:
    """Saves named tensors asynchronously at committed step boundaries; restores them.

    ``views`` are the tensors to save and to load into (DCP keys → tensors); ``group`` runs
    the save's collectives in the background thread, never on the training group;
    ``on_loaded(step)`` runs after a restore, once the views hold the checkpoint.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        views: dict[str, torch.Tensor],
        *,
        rank: int,
        group: dist.ProcessGroup,
        events: EventLog,
        generation: int = 0,
        restart_count: int = 0,
        collective_device: torch.device | None = None,
        on_loaded: Callable[[int], None] | None = None,
    ) -> None:
        self.config = config
        self.root = Path(config.dir)
        self.rank = rank
        self.events = events
        self.generation, self.restart_count = generation, restart_count
        self._group = group
        self._views = views
        self._device = collective_device or torch.device("cpu")
        """Where the interval agreement's tensor lives (the default group's device)."""
        self._on_loaded = on_loaded
        self._pending: tuple[int, Future[Any], float] | None = None
        self.interval_steps = config.interval_steps
        self._last_commit: float | None = None
        self._iter_s: float | None = None
        atexit.register(self.close)  # a script that leaves its loop early still completes

    def path(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:09d}"

    # -- save ---------------------------------------------------------------------------------
    def committed(self, step: int) -> None:
        """After each committed step (marker at IDLE(step)): save when the interval is due."""
        now = time.perf_counter()
        if self._last_commit is not None:
            self._iter_s = now - self._last_commit
        self._last_commit = now
        self._reap(block=False)
        if self.interval_steps is None:  # Young: first save measures C, then every rank agrees
            if self._iter_s is not None:
                cost_s = self._save(step)
                self.interval_steps = self._agree_interval(cost_s, self._iter_s)
            return
        if step % self.interval_steps == 0:
            self._save(step)

    def _save(self, step: int) -> float:
        """Stage the cut and start its background save; a failure is reported, not raised."""
        t0 = time.perf_counter()
        self._reap(block=True)  # one save in flight at a time
        if self.rank == 0:  # a re-save of a step must not pass for complete while it runs
            try:
                (self.path(step) / COMPLETE).unlink(missing_ok=True)
            except OSError:
                pass  # the save itself will fail on it and report
        staged: dict[str, torch.Tensor] | None = None
        try:
            staged = {k: v.clone() for k, v in self._views.items()}  # the cut: state at IDLE(step)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: this interval is skipped
            self._failed(step, e)
        # The save is collective: every rank starts it, or none does (no background thread
        # may wait forever on a peer that could not stage).
        if not self._agreed(staged is not None) or staged is None:
            return time.perf_counter() - t0
        try:
            response = dcp.async_save(
                staged, checkpoint_id=str(self.path(step)), process_group=self._group
            )
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - the next interval retries
            self._failed(step, e)
            return time.perf_counter() - t0
        future = getattr(response, "upload_completion", response)
        cost_s = time.perf_counter() - t0
        self._pending = (step, future, cost_s)
        return cost_s

    def _agreed(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        return bool(flag.item())

    def _agree_interval(self, cost_s: float, iter_s: float) -> int:
        """Every rank must save at the same steps: agree on the slowest measurement."""
        measured = torch.tensor([cost_s, iter_s], dtype=torch.float64, device=self._device)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        cost_s, iter_s = (float(x) for x in measured.cpu())
        steps = young_interval_steps(cost_s, iter_s, self.config)
        if self.rank == 0:
            logger.info(
                "checkpoint interval: %d steps (Young, C=%.4f s, T_iter=%.4f s, FF MTTF=%.0f s)",
                steps,
                cost_s,
                iter_s,
                self.config.ff_mttf_s,
            )
        return steps

    def _reap(self, block: bool) -> None:
        if self._pending is None:
            return
        step, future, cost_s = self._pending
        if not block and not future.done():
            return
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - the same on every rank
            self._failed(step, e)
            return
        if self.rank != 0:
            return
        # Rank 0 coordinates the save: its future completes after the metadata is written,
        # that is, after every rank's data is on disk.
        try:
            (self.path(step) / COMPLETE).write_text(json.dumps({"step": step, "t": time.time()}))
        except OSError as e:
            self._failed(step, e)
            return
        self.events.emit(
            Kind.CHECKPOINT_SAVED,
            rank=0,
            step=step,
            cost_s=cost_s,
            interval_steps=self.interval_steps,
        )
        self._prune()

    def _failed(self, step: int, error: BaseException) -> None:
        """A checkpoint that could not be written: an event and one line; training goes on."""
        message = _describe(error)
        logger.warning(
            "[rank %d] checkpoint of step %d in %s failed, training goes on (the next "
            "interval retries): %s",
            self.rank,
            step,
            self.root,
            message,
        )
        self.events.emit(
            Kind.CHECKPOINT_FAILED, rank=self.rank, step=step, error=message, dir=str(self.root)
        )
        if self.rank == 0:  # what was written is of no use; on a full disk it is in the way
            shutil.rmtree(self.path(step), ignore_errors=True)

    def _prune(self) -> None:
        complete = complete_steps(self.root)
        keep_from = complete[-self.config.keep] if len(complete) >= self.config.keep else 0
        for d in _dirs(self.root):
            if _step(d) < keep_from:
                shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        """Wait for the save in flight and mark it complete (the job's last checkpoint)."""
        self._reap(block=True)

    # -- restore ------------------------------------------------------------------------------
    def restore(self) -> int | None:
        """Load the newest complete checkpoint into the views; its step, or None."""
        choice: list[int | None] = [newest_complete(self.root) if self.rank == 0 else None]
        dist.broadcast_object_list(choice, src=0, group=self._group)  # every rank loads one
        step = choice[0]
        if step is None:
            if self.restart_count > 0 and self.rank == 0:
                logger.warning("no checkpoint found in %s: starting from step 0", self.root)
            return None
        t0 = time.perf_counter()
        dcp.load(self._views, checkpoint_id=str(self.path(step)), process_group=self._group)
        load_s = time.perf_counter() - t0
        self.events.emit(
            Kind.CHECKPOINT_LOADED,
            rank=self.rank,
            step=step,
            load_s=load_s,
            gen=self.generation,
            restart=self.restart_count,
        )
        if self._on_loaded is not None:
            self._on_loaded(step)
        return step
