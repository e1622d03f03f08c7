"""Module buffers in retained memory: a version counter of their own, an undo copy per step.

Parameters and buffers live in one flat "state" region. Tensors viewed from one base share
its autograd version counter, so an in-place update of any buffer in forward (BatchNorm's
``num_batches_tracked.add_(1)``) would make autograd refuse every parameter saved for
backward. :func:`own_view` gives each slot a tensor of its own over the same bytes (a
storage of its own wrapping the slot's address: not an autograd view, so its own counter).

Buffers are the one part of model state that the compute phase writes (running statistics).
A step that is re-run after a failure must start from the buffers as they were at its start,
or the update would be applied twice; a step whose optimizer update is finished keeps what
its forward wrote. :class:`BufferUndo` copies the buffers' bytes into a retained region at
the start of every step and tags the copy with the step, written after the copy (in stream
order on a GPU), so a copy torn by a kill is never taken for a good one::

    begin(t):  tag <- 0;  undo <- buffers;  tag <- t        forward(t) writes the buffers
    resume at s:  tag == s  -> buffers <- undo    (step s's forward may have written them)
                  otherwise -> buffers as they are (step s's forward never began)
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch.nn.modules.batchnorm import _NormBase

from leto.errors import ConfigError, UnrecoverableStateError
from leto.pool import cuda_vmm
from leto.retained.slot import Slot

TAG_BYTES = 64
"""Bytes before the copy in the undo region (the tag word, padded to an aligned offset)."""
_TAG = 0x4C425546 << 32  # "LBUF": a zeroed (fresh or lost) region never reads as a tag
_STEP_MASK = (1 << 32) - 1


def own_view(region: torch.Tensor, slot: Slot) -> torch.Tensor:
    """``slot`` of the uint8 ``region`` as a tensor of its own over the same memory: its own
    storage (so ``torch.save`` of a state dict mixing dtypes works) and its own autograd
    version counter. It keeps ``region`` alive."""
    n = slot.nbytes
    if n == 0:
        return torch.empty(slot.shape, dtype=slot.dtype, device=region.device)
    ptr = region.data_ptr() + slot.offset
    if ptr % torch.empty((), dtype=slot.dtype).element_size():
        raise ValueError(f"slot at byte {slot.offset} is not aligned for {slot.dtype}")
    if region.is_cuda:
        memory = cuda_vmm.array_interface(ptr, n)
        memory.region = region  # torch holds the interface object as long as the storage
        raw = torch.as_tensor(memory, device=region.device)
    else:
        memory = (ctypes.c_ubyte * n).from_address(ptr)
        memory.region = region  # torch.frombuffer holds the buffer object
        raw = torch.frombuffer(memory, dtype=torch.uint8)
    return raw.view(slot.dtype).view(slot.shape)


class BufferUndo:
    """The buffers' bytes at the start of the current step, in a retained region."""

    def __init__(
        self,
        state: torch.Tensor,
        slots: tuple[Slot, ...],
        region: torch.Tensor,
        lost_chunks: Callable[[], list[int]],
    ) -> None:
        """``state``: the state region; ``slots``: the buffers' slots in it (not empty);
        ``region``: the retained undo region (:meth:`region_bytes`); ``lost_chunks()``: the
        region's lost chunks (``RegionMemory.lost_chunks``), checked before its copy is
        trusted after a failure."""
        self.start, nbytes = self.span(slots)
        if region.numel() < self.region_bytes(nbytes):
            raise ValueError(f"undo region of {region.numel()} bytes is too small for {nbytes}")
        self.slots = slots
        self.live = state[self.start : self.start + nbytes]
        self._tag = region[:8].view(torch.int64)
        self._copy = region[TAG_BYTES : TAG_BYTES + nbytes]
        self._lost_chunks = lost_chunks

    @staticmethod
    def span(slots: tuple[Slot, ...]) -> tuple[int, int]:
        """(byte offset, bytes) of the state region that holds every buffer (0, 0 if none)."""
        if not slots:
            return 0, 0
        start = min(s.offset for s in slots)
        return start, max(s.offset + s.nbytes for s in slots) - start

    @staticmethod
    def region_bytes(nbytes: int) -> int:
        return TAG_BYTES + nbytes

    def save(self, step: int) -> None:
        """Copy the buffers as they are at the start of ``step``."""
        self._tag.fill_(0)
        self._copy.copy_(self.live)
        self._tag.fill_(_TAG | step)

    def saved_step(self) -> int | None:
        """The step whose start the copy holds, or None (never saved, or torn by a kill)."""
        if self._lost_chunks():  # a zeroed replacement: whether forward began is unknowable
            raise UnrecoverableStateError(
                "the retained copy of the module buffers lost device pages; "
                "restart the job from a checkpoint"
            )
        word = int(self._tag.item())
        return word & _STEP_MASK if word & ~_STEP_MASK == _TAG else None

    def restore(self, step: int) -> bool:
        """Bring the buffers back to the start of ``step`` if its forward may have written
        them (the copy is tagged ``step``); True when they were restored."""
        if self.saved_step() != step:
            return False
        self.live.copy_(self._copy)
        return True

    def restart(self) -> None:
        """Back to the start of the current step (a compute retry in the same process)."""
        self.live.copy_(self._copy)

    def changed(self) -> list[int]:
        """Indices of the buffers whose bytes differ from the copy at the start of the step."""
        out = []
        for i, slot in enumerate(self.slots):
            lo = slot.offset - self.start
            if not torch.equal(self.live[lo : lo + slot.nbytes], self._copy[lo : lo + slot.nbytes]):
                out.append(i)
        return out


def refuse_buffer_updates(model: torch.nn.Module) -> None:
    """Under ``leto.erasure``: refuse modules that update buffers in forward. The parity of
    the state region follows the optimizer's writes only, so a rebuilt page next to a
    running statistic would be wrong."""
    for name, module in model.named_modules():
        if isinstance(module, _NormBase) and module.track_running_stats:
            raise ConfigError(
                f"module {name or '<root>'} ({type(module).__name__}) updates its running statistics in "
                "forward, which leto.erasure's parity does not follow: run without leto.erasure, or "
                "build it with track_running_stats=False"
            )
