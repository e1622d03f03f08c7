"""A step's compute phase (forward and backward): lent activation memory, OOM retries.

On CUDA the phase allocates from the updater's idle buffers (``leto.pool.lend``: rmu's undo
buffer, needed only after backward). An out-of-memory error while the node has shadows is
theirs to pay for: the shadows are reclaimed (``leto.preinit.guard.OomGuard.reclaim``, which
also says why this is the hook into PyTorch's allocator), the step is brought back to the
start of its compute phase and run again — the same step, bit for bit, since model state is
read-only here. A step may call ``compute`` more than once (gradient accumulation, one call
per micro-batch): gradients are zeroed once per step, so a retry runs this step's earlier
calls again before the failed one, each from the RNG state it started with (whatever the
script drew between calls is not drawn again). A compute phase whose collectives the other
ranks would not repeat is never retried.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from leto.errors import LetoError
from leto.pool.lend import ActivationLender
from leto.trainer.rng import rng_blob, set_rng_blob

if TYPE_CHECKING:
    from leto.preinit.guard import OomGuard
    from leto.trainer.grad_sync import GradSync

logger = logging.getLogger(__name__)

T = TypeVar("T")


def lends(lendable: dict[str, torch.Tensor], device: torch.device, asked: bool | None) -> bool:
    """Whether the compute phase borrows the updater's idle buffers: on CUDA, unless
    ``leto.lend_activation_memory`` (``asked``) is false."""
    return bool(lendable) and device.type == "cuda" and asked is not False


class ComputePhase:
    """Runs one rank's compute phases, lending memory and retrying after a reclaim."""

    def __init__(
        self,
        *,
        rank: int,
        device: torch.device,
        guard: OomGuard,
        grad_sync: Callable[[], GradSync],
        restart: Callable[[], None],
        lent: dict[str, torch.Tensor],
        lend_asked: bool | None,
        launched: Callable[[], bool] = lambda: False,
    ) -> None:
        """``guard``: this trainer's side of the pre-initialisation controller; ``grad_sync``:
        the context's as it is now (a model-parallel one turns retries off); ``restart``:
        brings the step back to the start of its compute phase (buffers, zeroed gradients;
        the RNG is set here). ``lent``: the regions to lend to activations (empty: none), built into a
        lender at the first phase; ``lend_asked``: ``leto.lend_activation_memory`` (True: a
        lender that cannot be built is an error, else a warning). ``launched``: whether this
        step's backward launched gradient all-reduces (``leto.trainer.grad_buckets``)."""
        self.rank, self.device, self.guard = rank, device, guard
        self.launched = launched
        self.grad_sync, self.restart = grad_sync, restart
        self.lent, self.lend_asked = lent, lend_asked
        self.lender: ActivationLender | None = None
        """The lender, once the first phase has built it."""
        self._step = -1
        self._calls: list[tuple[Callable[[], object], torch.Tensor]] = []
        """This step's compute calls so far, each with the RNG state it began with."""

    @property
    def lending(self) -> bool:
        return bool(self.lent)

    def stop_lending(self, why: str) -> None:
        """Lend nothing from now on (before the first phase); ``why`` is logged."""
        if self.lent:
            logger.info("[rank %d] not lending the undo buffer: %s", self.rank, why)
        self.lent = {}

    def run(self, step: int, fn: Callable[[], T]) -> T:
        """``fn`` as step ``step``'s compute phase; its result."""
        if self.lent and self.lender is None:
            try:
                self.lender = ActivationLender(self.device, self.lent)
            except LetoError as e:  # no C compiler, a torch without MemPool: lend only if asked to
                if self.lend_asked:
                    raise
                logger.warning(
                    "[rank %d] not lending the undo buffer to activations: %s", self.rank, e
                )
                self.lent = {}
        if step != self._step:
            self._step, self._calls = step, []
        rng = rng_blob(self.device)  # host only: ~30 microseconds
        retry = False
        while True:
            try:
                with self.lender.lending() if self.lender is not None else contextlib.nullcontext():
                    if retry:  # the step's earlier calls, then this one, each from its RNG
                        for again, began in self._calls:
                            set_rng_blob(began, self.device)
                            again()
                        set_rng_blob(rng, self.device)
                    result = fn()
                self._calls.append((fn, rng))
                return result
            except torch.OutOfMemoryError as e:
                if not self.guard.can_reclaim():
                    raise
                if why := self._not_repeated():
                    e.add_note(
                        f"rank {self.rank} step {step}: not retried after reclaiming the "
                        f"shadows: {why} the other ranks would not repeat"
                    )
                    raise
                message = str(e).splitlines()[0] if str(e) else "out of memory"
            # Out of the except block: the traceback, and with it the failed attempt's
            # activations and autograd graph, is released before the reclaim.
            if self.device.type == "cuda":  # device memory held in reference cycles, cached blocks
                gc.collect()
                torch.cuda.empty_cache()
            logger.warning(
                "[rank %d step %d] %s: reclaiming the shadows and retrying",
                self.rank,
                step,
                message,
            )
            if not self.guard.reclaim(step):
                raise torch.OutOfMemoryError(f"{message} (no shadows left to reclaim)")
            self.restart()
            retry = True

    def _not_repeated(self) -> str:
        """The collectives of this compute phase that the other ranks would not repeat with
        a retry on this rank ("" when there are none): a model-parallel forward's (a narrowed
        ``grad_sync`` group says so), or an overlapped backward's bucket all-reduces."""
        sync = self.grad_sync()
        if sync.group is not None:
            return "a model-parallel forward runs collectives"
        if sync.collectives_in_backward:
            return "an overlapped backward runs bucket all-reduces"
        if self.launched():
            return "this step's backward launched gradient all-reduces"
        return ""
