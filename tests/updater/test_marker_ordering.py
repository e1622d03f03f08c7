"""The marker's stream-ordered write path (used on GPU), exercised on CPU.

On a GPU the marker's device view is a CUDA tensor over the same page-locked host memory,
and a write lands only when the kernels queued before it have run. Here the "device view"
is a separate buffer that reaches the memory when the test says so (the queue drains):
until then a successor reading the memory must see the old marker, while the writer
keeps reading its own writes.
"""

from __future__ import annotations

import pytest
import torch

from leto.retained import marker
from leto.retained.marker import MARKER_BYTES, Marker, Phase


def test_writer_reads_its_own_writes_successor_reads_what_landed() -> None:
    memory = torch.zeros(MARKER_BYTES, dtype=torch.uint8)
    queue = torch.zeros(MARKER_BYTES // 8, dtype=torch.int64)  # the stream, not yet drained
    queue.copy_(memory.view(torch.int64))
    writer = Marker(memory, queue)
    writer.initialise(layout_hash=7, step=3)
    assert writer.is_valid() and (writer.step, writer.phase) == (3, Phase.IDLE)
    assert not Marker(memory).is_valid()  # nothing landed yet
    memory.view(torch.int64).copy_(queue)  # the queued fills ran
    writer.record_lrs([0.5, 0.25])
    writer.advance(Phase.GRADS_READY)
    writer.advance(Phase.PARITY_LOADED, sel=0)
    writer.advance(Phase.CHUNK_SAVED, chunk=0)
    landed = Marker(memory)
    assert landed.is_valid() and (landed.step, landed.phase, landed.recorded_lrs()) == (
        3,
        Phase.IDLE,
        [],
    )
    assert (writer.phase, writer.chunk, writer.recorded_lrs()) == (
        Phase.CHUNK_SAVED,
        0,
        [0.5, 0.25],
    )
    memory.view(torch.int64).copy_(queue)
    landed = Marker(memory)
    assert (landed.phase, landed.chunk, landed.recorded_lrs()) == (
        Phase.CHUNK_SAVED,
        0,
        [0.5, 0.25],
    )


def test_a_successor_starts_from_the_memory() -> None:
    memory = torch.zeros(MARKER_BYTES, dtype=torch.uint8)
    Marker(memory).initialise(layout_hash=1, step=9)
    queue = memory.view(torch.int64).clone()
    successor = Marker(memory, queue)
    assert successor.layout_hash() == 1 and successor.step == 9


def test_a_shadow_that_mapped_ahead_reloads_after_promotion() -> None:
    memory = torch.zeros(MARKER_BYTES, dtype=torch.uint8)
    active = Marker(memory)
    active.initialise(layout_hash=1, step=2)
    shadow = Marker(memory, memory.view(torch.int64).clone())  # mapped ahead, at step 2
    active.advance(Phase.GRADS_READY)
    active.advance(Phase.UPDATING)
    active.advance(Phase.IDLE, 3)  # the active went on, then died
    assert shadow.step == 2  # its copy is stale until it reloads
    shadow.reload()
    assert (shadow.step, shadow.phase) == (3, Phase.IDLE)


def test_recorded_lrs_write_only_the_words_that_changed() -> None:
    memory = torch.zeros(MARKER_BYTES, dtype=torch.uint8)
    queue = memory.view(torch.int64)  # a stream that lands at once
    writes: list[int] = []  # the fills that reach the device view
    writer = Marker(memory, queue)
    fill = torch.Tensor.fill_

    def counted_fill(t: torch.Tensor, value: int) -> torch.Tensor:
        writes.append(int(value))
        return fill(t, value)

    torch.Tensor.fill_ = counted_fill  # type: ignore[method-assign]
    try:
        writer.record_lrs([0.5, 0.25])
        assert len(writes) == 3  # the count and both rates
        writes.clear()
        writer.record_lrs([0.5, 0.25])  # a constant schedule: nothing to write
        assert writes == []
        writer.record_lrs([0.5, 0.125])  # one group's rate moved
        assert len(writes) == 1
        writes.clear()
        writer.record_lrs([0.5])  # a group fewer: only the count
        assert len(writes) == 1
    finally:
        torch.Tensor.fill_ = fill  # type: ignore[method-assign]
    assert Marker(memory).recorded_lrs() == [0.5]
    writer.record_lrs([0.5, 0.125])  # the second rate's word still holds 0.125
    assert Marker(memory).recorded_lrs() == [0.5, 0.125]


class _QueuedEvent:
    """A CUDA event's stand-in: ``record`` notes what the stream has queued so far, and
    ``synchronize`` lets the stream run up to there."""

    def __init__(self, memory: torch.Tensor, queue: torch.Tensor) -> None:
        self.memory, self.queue = memory, queue
        self.queued: torch.Tensor | None = None

    def record(self, stream: object = None) -> None:
        self.queued = self.queue.clone()

    def synchronize(self) -> None:
        assert self.queued is not None
        self.memory.view(torch.int64).copy_(self.queued)


def test_wait_landed_returns_once_the_device_has_passed_the_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host may run ahead of a stream-ordered marker; ``wait_landed`` is how it knows
    a successor would read a marker at least that far (before it drops host-side state a
    resume from an earlier one needs). It waits for that write, not for the newest."""
    memory = torch.zeros(MARKER_BYTES, dtype=torch.uint8)
    queue = torch.zeros(MARKER_BYTES // 8, dtype=torch.int64)
    monkeypatch.setattr(marker, "_landmark_event", lambda device: _QueuedEvent(memory, queue))
    writer = Marker(memory, queue)
    writer.initialise(layout_hash=7, step=3)
    memory.view(torch.int64).copy_(queue)

    def landed() -> tuple[int, Phase]:
        return Marker(memory).step, Marker(memory).phase

    writer.wait_landed(Phase.IDLE, 3)  # not this process's write: landed already
    assert landed() == (3, Phase.IDLE)
    for step in (3, 4, 5):  # the host two steps ahead of the device
        writer.advance(Phase.GRADS_READY)
        writer.advance(Phase.UPDATING)
        writer.advance(Phase.IDLE, step + 1)
    writer.wait_landed(Phase.GRADS_READY, 7)  # not written yet
    assert landed() == (3, Phase.IDLE)
    writer.wait_landed(Phase.GRADS_READY, 4)
    assert landed() == (4, Phase.GRADS_READY)  # that write, not the newest
    writer.wait_landed(Phase.IDLE, 5)
    assert landed() == (5, Phase.IDLE)
    for step in (6, 7, 8, 9):  # more writes than the marker keeps events for
        writer.advance(Phase.GRADS_READY)
        writer.advance(Phase.UPDATING)
        writer.advance(Phase.IDLE, step + 1)
    writer.wait_landed(Phase.GRADS_READY, 5)  # its event was recorded again: the oldest kept
    assert landed() == (6, Phase.GRADS_READY)  # steps 6 .. 9 kept


def test_wait_landed_for_a_predecessors_write_returns_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A promoted trainer overwrites records its predecessor wrote: the marker writes those
    waited for were the predecessor's and landed before the successor read the marker, so
    it must not wait for its own later writes instead (a sync of its first steps)."""
    memory = torch.zeros(MARKER_BYTES, dtype=torch.uint8)
    queue = torch.zeros(MARKER_BYTES // 8, dtype=torch.int64)
    Marker(memory).initialise(layout_hash=7, step=5)  # what the predecessor left
    queue.copy_(memory.view(torch.int64))
    monkeypatch.setattr(marker, "_landmark_event", lambda device: _QueuedEvent(memory, queue))
    successor = Marker(memory, queue)
    successor.advance(Phase.GRADS_READY)
    successor.advance(Phase.UPDATING)
    successor.advance(Phase.IDLE, 6)
    successor.wait_landed(Phase.GRADS_READY, 3)  # the predecessor's step 3
    assert (Marker(memory).step, Marker(memory).phase) == (5, Phase.IDLE)
    successor.wait_landed(Phase.GRADS_READY, 5)  # its own
    assert (Marker(memory).step, Marker(memory).phase) == (5, Phase.GRADS_READY)
