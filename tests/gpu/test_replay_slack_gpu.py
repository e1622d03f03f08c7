"""The forward replay leaves the caching allocators what a promoted trainer's first step
asks for beyond the replay's own blocks (``leto.preinit.replay._first_step_slack``): free
small-block memory on the device and page-locked host blocks of every small size class, so
that step asks neither the driver for a segment nor for page-locked memory."""

from __future__ import annotations

import torch
from torch import nn

from leto.preinit import replay as rp


def test_the_first_step_finds_small_blocks_and_page_locked_blocks_cached() -> None:
    device = torch.device("cuda", 0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    spec = rp.ForwardSpec.of((torch.zeros(4, 64, device=device),), {})
    rp.replay(model, spec, device)
    stats = torch.cuda.memory_stats(device)
    free_small = (
        stats["reserved_bytes.small_pool.current"] - stats["allocated_bytes.small_pool.current"]
    )
    assert free_small >= rp.SMALL_SLACK_BYTES
    segments = stats["segment.small_pool.current"]
    host = torch.cuda.host_memory_stats()["num_host_alloc"]
    small = [torch.empty(100_000, dtype=torch.uint8, device=device) for _ in range(64)]
    pinned = [
        torch.empty(1 << b, dtype=torch.uint8, pin_memory=True)
        for b in rp.PINNED_BINS
        for _ in range(rp.PINNED_PER_BIN)
    ]
    assert torch.cuda.memory_stats(device)["segment.small_pool.current"] == segments
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == host
    del small, pinned
