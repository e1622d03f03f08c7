"""The trainer's side of the controller: memory reports, and a reclaim request on an OOM.

Why the hook is a retry of the compute phase, and not one inside PyTorch's allocator
(read in torch 2.13's ``c10/cuda/CUDACachingAllocator.cpp`` and ``torch/cuda/memory.py``):

* ``torch._C._cuda_attach_out_of_memory_observer``: the caching allocator calls its
  observers once an allocation has failed (after freeing its cached blocks and retrying
  ``cudaMalloc``) and then raises ``OutOfMemoryError`` regardless. An observer may learn
  of the OOM, it cannot make the allocation succeed; blocking in it until the shadow is
  gone would still end in the raise.
* ``CUDAPluggableAllocator`` / ``MemPool`` with our own malloc: a malloc that blocks
  until the shadow is reclaimed and then retries would be transparent, but it replaces the
  caching allocator for the whole process (set before the first allocation, which leto
  does not own), or only covers allocations inside a ``use_mem_pool`` scope, and it would
  wait for another process inside a kernel-launching call with the GIL held.
* Retrying the compute phase (forward, backward) is exact and local: leto's step protocol
  already makes model state read-only there (a failure in it costs a re-run), the OOM
  arrives as a Python exception at a known point, and the re-run starts from the step's
  retained RNG with the retained gradients zeroed. It costs the partial step, as the
  recomputation after a kill does. The update itself does not allocate with the model's
  size under ``consistency: rmu``: its undo and parity buffers are preallocated regions.
"""

from __future__ import annotations

import logging
import os
import time

from leto.events import EventLog, Kind
from leto.health import Heartbeat
from leto.preinit import board
from leto.preinit.config import PreinitConfig
from leto.preinit.probe import CudaProbe, MemoryProbe

logger = logging.getLogger(__name__)

_POLL_S = 0.002


class OomGuard:
    """Reports this active trainer's memory and asks its agent for the shadows' memory."""

    def __init__(
        self,
        heartbeat: Heartbeat | None,
        probe: MemoryProbe | None,
        config: PreinitConfig,
        events: EventLog,
        rank: int,
    ) -> None:
        self._hb, self.probe, self.config, self.events, self.rank = (
            heartbeat,
            probe,
            config,
            events,
            rank,
        )
        self.reclaims = 0

    def shadow_level(self) -> int:
        """Level of the live shadows on this node (0: none, or not under leto-run's agent)."""
        return 0 if self._hb is None else self._hb.word(board.SHADOW_LEVEL)

    def shadow_ready(self) -> bool:
        """This rank's shadow is pre-initialised (it holds its device memory now)."""
        return (
            self.shadow_level() > 0 and self._hb is not None and board.shadow_ready(self._hb.word)
        )

    def shadow_pid(self) -> int:
        """Pid of this rank's ready shadow (0: none announced since the agent spawned one)."""
        return 0 if self._hb is None or not self.shadow_ready() else self._hb.word(board.SHADOW_PID)

    def shadows_given_up(self) -> bool:
        """The agent stopped relaunching this node's shadows (they kept dying): none will be ready."""
        return self._hb is not None and self._hb.word(board.SHADOWS_GIVEN_UP) > 0

    def announce_ready(self, generation: int) -> None:
        """Called by a shadow of ``generation`` once it waits for promotion."""
        if self._hb is not None:
            self._hb.set_word(board.SHADOW_PID, os.getpid())
            self._hb.set_word(board.SHADOW_READY, generation)

    def shadows_hold_memory(self) -> bool:
        """The node's shadows hold device memory (L2, L3; L1 shadows have no CUDA context)."""
        return self.shadow_level() >= 2

    def can_reclaim(self) -> bool:
        return self.config.reclaim_on_oom and self.shadows_hold_memory()

    def report(self) -> None:
        """After a committed step: publish this rank's memory for the level choice (without
        a probe, only that a step committed: the agent relaunches reclaimed shadows then)."""
        if self._hb is None:
            return
        if self.probe is not None:
            for index, value in zip(board.MEM_WORDS, self.probe.read().words(), strict=True):
                self._hb.set_word(index, value)
        self._hb.set_word(board.MEM_SEQ, self._hb.word(board.MEM_SEQ) + 1)

    def demand(self, nbytes: int) -> None:
        """An emulated activation peak (an injected ``oom`` fault, CPU runs)."""
        if self.probe is not None:
            self.probe.demand(nbytes)

    def reclaim(self, step: int) -> int:
        """Ask the agent to kill the shadows; block until they are reaped and, on a GPU,
        until their memory shows as free. Returns the level reclaimed (0: none was left)."""
        hb = self._hb
        if hb is None:
            return 0
        t0 = time.perf_counter()
        cuda = isinstance(self.probe, CudaProbe)
        free_before = self.probe.free_bytes() if cuda else 0
        n = hb.word(board.OOM_REQUEST) + 1
        hb.set_word(board.OOM_REQUEST, n)
        deadline = time.monotonic() + self.config.reclaim_timeout_s
        while hb.word(board.OOM_ACK) < n:
            hb.beat()  # waiting on the agent is progress, not a hang
            if time.monotonic() > deadline:
                logger.error(
                    "[rank %d step %d] the agent did not reclaim the shadows in %.0f s",
                    self.rank,
                    step,
                    self.config.reclaim_timeout_s,
                )
                return 0
            time.sleep(_POLL_S)
        level = hb.word(board.OOM_RECLAIMED)
        reaped_s = time.perf_counter() - t0
        freed = 0
        if cuda and level >= 2:  # L1 shadows hold no device memory
            assert self.probe is not None
            deadline = time.monotonic() + self.config.free_wait_s
            while (
                freed := self.probe.free_bytes() - free_before
            ) <= 0 and time.monotonic() < deadline:
                hb.beat()
                time.sleep(_POLL_S)
        self.reclaims += level > 0
        self.events.emit(
            Kind.OOM_RETRY,
            rank=self.rank,
            step=step,
            reclaimed_level=level,
            reaped_s=reaped_s,
            wait_s=time.perf_counter() - t0,
            freed_bytes=freed,
        )
        return level
