"""The overlapped gradient mean (``leto.trainer.grad_buckets``) over NCCL, on one GPU: a
world of one, so the all-reduces change nothing, but the launches from autograd's device
thread, ``ReduceOp.AVG`` and the stream waits at the end of backward are NCCL's. The
reduction over several ranks is tests/trainer/test_grad_buckets.py's, over gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.trainer.test_grad_buckets import _case


@pytest.fixture
def nccl_world_of_one():
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    yield device
    dist.destroy_process_group()


def test_buckets_launch_during_backward_over_nccl(nccl_world_of_one):
    device = nccl_world_of_one
    one = _case(0, passes=1, expected=1, extra=True, device=device)
    assert one["exact"] and one["launched_in_backward"] == [True] and one["buckets"] > 2
    more = _case(0, passes=2, expected=1, extra=True, device=device)
    assert more["close"] and more["launched_in_backward"] == [True, True]
    late = _case(0, passes=1, expected=1, extra=True, unfreeze=True, device=device)
    assert late["close"]
