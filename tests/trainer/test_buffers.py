"""Module buffers in retained memory: a version counter per tensor, an undo copy per step.

In process, on CPU: a flat uint8 region stands for the retained "state" region.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from leto.errors import ConfigError
from leto.retained.layout import Layout
from leto.retained.slot import Slot
from leto.trainer.buffers import BufferUndo, own_view, refuse_buffer_updates


def _bn_model() -> nn.Module:
    """The second BatchNorm's ``num_batches_tracked.add_(1)`` comes after the second Linear
    saved its weight for backward."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 2),
    )


def _bind(model: nn.Module, view) -> tuple[torch.Tensor, Layout]:
    """Params and buffers of ``model`` moved into one flat region through ``view``."""
    opt = torch.optim.AdamW(model.parameters())
    params, buffers = list(model.parameters()), list(model.buffers())
    layout = Layout.plan(params, buffers, opt)
    region = torch.zeros(layout.state_bytes, dtype=torch.uint8)
    for p, slot in zip(params, layout.params, strict=True):
        data = view(region, slot)
        data.copy_(p.detach())
        torch.utils.swap_tensors(p, nn.Parameter(data))
    for b, slot in zip(buffers, layout.buffers, strict=True):
        data = view(region, slot)
        data.copy_(b)
        torch.utils.swap_tensors(b, data)
    return region, layout


def test_own_views_have_independent_version_counters() -> None:
    region = torch.zeros(256, dtype=torch.uint8)
    weight, count = Slot(0, (4,), torch.float32), Slot(64, (), torch.int64)
    a, b = own_view(region, weight), own_view(region, count)
    before = a._version
    b.add_(1)  # what BatchNorm's num_batches_tracked.add_(1) does in forward
    assert a._version == before
    assert int(region[64:72].view(torch.int64)) == 1  # the same memory
    shared_a, shared_b = weight.view(region), count.view(region)
    before = shared_a._version
    shared_b.add_(1)
    assert shared_a._version != before  # plain views of one region share their counter


def test_batchnorm_forward_backward_over_retained_views() -> None:
    """BatchNorm's in-place buffer updates no longer invalidate parameters saved for backward."""
    x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
    model = _bn_model()
    _bind(model, own_view)
    nn.functional.cross_entropy(model(x), y).backward()
    assert int(model[1].num_batches_tracked) == 1
    assert all(p.grad is not None for p in model.parameters())
    torch.save(model.state_dict(), io.BytesIO())  # mixed dtypes of one region: saved by the user
    shared = _bn_model()
    _bind(shared, lambda region, slot: slot.view(region))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        nn.functional.cross_entropy(shared(x), y).backward()


def _undo(layout: Layout, region: torch.Tensor) -> tuple[BufferUndo, torch.Tensor]:
    undo = torch.zeros(
        BufferUndo.region_bytes(BufferUndo.span(layout.buffers)[1]), dtype=torch.uint8
    )
    return BufferUndo(region, layout.buffers, undo, list), undo


def test_buffer_undo_brings_back_the_start_of_a_rerun_step() -> None:
    model = _bn_model()
    region, layout = _bind(model, own_view)
    undo, _ = _undo(layout, region)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    undo.save(3)
    model(torch.randn(16, 4))  # step 3's forward updates the running statistics
    assert not torch.equal(model[1].running_mean, start["1.running_mean"])
    assert undo.changed() == list(range(6))  # running_mean, running_var, num_batches_tracked (x2)
    assert not undo.restore(4)  # step 4 never began: what forward(3) wrote is step 4's start
    assert undo.restore(3)
    for k, v in model.state_dict().items():
        assert torch.equal(v, start[k]), k
    assert undo.changed() == []


def test_buffer_undo_torn_copy_is_never_restored() -> None:
    model = _bn_model()
    region, layout = _bind(model, own_view)
    undo, raw = _undo(layout, region)
    undo.save(5)
    raw[:8].zero_()  # a kill between the tag's invalidation and the end of the copy
    assert undo.saved_step() is None
    model(torch.randn(16, 4))
    changed = model[1].running_mean.clone()
    assert not undo.restore(5)
    assert torch.equal(model[1].running_mean, changed)


def test_buffer_undo_refuses_a_lost_copy() -> None:
    from leto.errors import UnrecoverableStateError

    model = _bn_model()
    region, layout = _bind(model, own_view)
    undo = BufferUndo(region, layout.buffers, torch.zeros(4096, dtype=torch.uint8), lambda: [0])
    with pytest.raises(UnrecoverableStateError, match="lost device pages"):
        undo.restore(0)


def test_erasure_refuses_running_statistics_at_retain() -> None:
    with pytest.raises(
        ConfigError, match=r"module 1 \(BatchNorm1d\) updates its running statistics"
    ):
        refuse_buffer_updates(_bn_model())
    refuse_buffer_updates(
        nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2, track_running_stats=False))
    )
