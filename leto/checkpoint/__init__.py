"""The checkpoint kept for fatal failures (FFs): asynchronous torch.distributed.checkpoint.

In-place recovery covers hardware-operable failures (HOFs). What it cannot cover — a
device that is gone, retained state that cannot be rebuilt, a dead state manager —
restarts the worker group the torchrun way, and the new trainers load the newest complete
checkpoint. Since only FFs need it, the interval comes from Young's formula with the FF
rate: ``sqrt(2 C MTTF_FF)`` where ``MTTF_FF = MTTF / (1 - h)`` (the paper's §8.1), with
``C`` the time the save blocks training (staging; the write runs in a background thread).

What is saved is exactly the retained state, as DCP keys: ``model.<fqn>`` (parameters),
``buffer.<fqn>``, ``optim.<fqn>.<key>`` (AdamW step, exp_avg, exp_avg_sq) — replicated
across data-parallel ranks, so DCP writes them once — and ``rng.rank<r>`` per rank. It is
loaded in place into the retained views, so the restarted run is bit-identical to the
fault-free run from the checkpoint's step on.

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
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from leto.errors import ProtocolError
from leto.events import Kind
from leto.sim.closed_form import young_interval_iters

if TYPE_CHECKING:
    from leto.config import CheckpointConfig
    from leto.trainer.state import RetainedState

logger = logging.getLogger(__name__)

COMPLETE = "LETO_COMPLETE"
_PREFIX = "step_"


def young_interval_steps(cost_s: float, iteration_s: float, config: CheckpointConfig) -> int:
    """Young's interval for the FF rate, in whole steps (at least 1)."""
    steps = young_interval_iters(cost_s, config.ff_mttf_s, max(iteration_s, 1e-9))
    return 1 if steps < 1 else (1 << 62 if math.isinf(steps) else round(steps))


def named_views(state: RetainedState) -> dict[str, torch.Tensor]:
    """The retained state as DCP keys → views of retained memory (no copy)."""
    region = state.state_bytes
    pnames = {id(p): n for n, p in state.model.named_parameters(remove_duplicate=False)}
    bnames = {id(b): n for n, b in state.model.named_buffers(remove_duplicate=False)}
    views: dict[str, torch.Tensor] = {}
    for p, pslot, oslots in zip(state.params, state.layout.params, state.layout.optim, strict=True):
        name = pnames.get(id(p))
        if name is None:
            raise ProtocolError("the optimizer holds a parameter that is not in the model; cannot name it")
        views[f"model.{name}"] = pslot.view(region)
        for key, slot in oslots.items():
            views[f"optim.{name}.{key}"] = slot.view(region)
    for b, slot in zip(state.buffers, state.layout.buffers, strict=True):
        views[f"buffer.{bnames[id(b)]}"] = slot.view(region)
    views[f"rng.rank{state.ctx.rank}"] = state.layout.rng.view(region)
    return views


def newest_complete(root: Path) -> int | None:
    """The step of the newest checkpoint whose save finished on every rank."""
    steps = [int(d.name[len(_PREFIX):]) for d in _dirs(root) if (d / COMPLETE).exists()]
    return max(steps, default=None)


def _dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [d for d in root.iterdir() if d.is_dir() and d.name.startswith(_PREFIX) and d.name[len(_PREFIX):].isdigit()]


class Checkpointer:
    """Saves the retained state asynchronously at committed step boundaries; restores it."""

    def __init__(self, config: CheckpointConfig, state: RetainedState) -> None:
        self.config = config
        self.state = state
        self.ctx = state.ctx
        self.root = Path(config.dir)
        self.root.mkdir(parents=True, exist_ok=True)
        # The save's collectives run in a background thread: never on the training group.
        self._pg = dist.new_group(backend="gloo")
        self._views = named_views(state)
        self._pending: tuple[int, Future[Any], float] | None = None
        self.interval_steps = config.interval_steps
        self._last_commit: float | None = None
        self._iter_s: float | None = None
        atexit.register(self.close)

    def path(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:09d}"

    # -- save ---------------------------------------------------------------------------------
    def committed(self) -> None:
        """After each committed step (marker at IDLE(t+1)): save when the interval is due."""
        step = self.state.marker.step
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
        t0 = time.perf_counter()
        self._reap(block=True)  # one save in flight at a time
        staged = {k: v.clone() for k, v in self._views.items()}  # the cut: state at IDLE(step)
        response = dcp.async_save(staged, checkpoint_id=str(self.path(step)), process_group=self._pg)
        future = getattr(response, "upload_completion", response)
        cost_s = time.perf_counter() - t0
        self._pending = (step, future, cost_s)
        return cost_s

    def _agree_interval(self, cost_s: float, iter_s: float) -> int:
        """Every rank must save at the same steps: agree on the slowest measurement."""
        measured = torch.tensor([cost_s, iter_s], dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX)
        steps = young_interval_steps(float(measured[0]), float(measured[1]), self.config)
        if self.ctx.rank == 0:
            logger.info(
                "checkpoint interval: %d steps (Young, C=%.4f s, T_iter=%.4f s, FF MTTF=%.0f s)",
                steps, float(measured[0]), float(measured[1]), self.config.ff_mttf_s,
            )
        return steps

    def _reap(self, block: bool) -> None:
        if self._pending is None:
            return
        step, future, cost_s = self._pending
        if not block and not future.done():
            return
        self._pending = None
        future.result()
        if self.ctx.rank != 0:
            return
        # Rank 0 coordinates the save: its future completes after the metadata is written,
        # that is, after every rank's data is on disk.
        (self.path(step) / COMPLETE).write_text(json.dumps({"step": step, "t": time.time()}))
        self.ctx.events.emit(
            Kind.CHECKPOINT_SAVED, rank=0, step=step, cost_s=cost_s, interval_steps=self.interval_steps
        )
        self._prune()

    def _prune(self) -> None:
        complete = sorted(int(d.name[len(_PREFIX):]) for d in _dirs(self.root) if (d / COMPLETE).exists())
        keep_from = complete[-self.config.keep] if len(complete) >= self.config.keep else 0
        for d in _dirs(self.root):
            if int(d.name[len(_PREFIX):]) < keep_from:
                shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        """Wait for the save in flight (at exit, so the last checkpoint is complete)."""
        try:
            self._reap(block=True)
        except Exception as e:  # noqa: BLE001 - at exit, a failed save is only worth a log line
            logger.warning("the last checkpoint did not complete: %s", e)

    # -- restore ------------------------------------------------------------------------------
    def restore(self) -> int | None:
        """Load the newest complete checkpoint into the retained state; its step, or None."""
        choice: list[int | None] = [newest_complete(self.root) if self.ctx.rank == 0 else None]
        dist.broadcast_object_list(choice, src=0)  # every rank loads the same one
        step = choice[0]
        if step is None:
            return None
        t0 = time.perf_counter()
        dcp.load(self._views, checkpoint_id=str(self.path(step)), process_group=self._pg)
        self.state._encode("state")  # the RMU updates parity incrementally: it must match the load
        self.state.marker.initialise(self.state.layout.digest, step=step)
        self.ctx.events.emit(
            Kind.CHECKPOINT_LOADED, rank=self.ctx.rank, step=step, load_s=time.perf_counter() - t0,
            gen=self.ctx.env.generation, restart=self.ctx.env.restart_count,
        )
        if self.ctx.env.digest:
            self.state.emit_digest()
        return step
