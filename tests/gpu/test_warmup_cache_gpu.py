"""A shadow's warm-ups and the blocks its forward replay keeps for the first step
(``leto.preinit.model_warmup``): a later warm-up returns the cache only if it grew it, so
a warm-up that ran on meta (the sharded clip) or within the kept blocks leaves them kept."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from leto.preinit import model_warmup

MIB = 1 << 20


def test_a_later_warm_up_keeps_the_replay_s_blocks_unless_it_grew_the_cache() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    site = SimpleNamespace(device=device)

    def free() -> int:  # cached, not allocated (a test run before may leave some in use)
        return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

    def alloc(nbytes: int) -> None:
        torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)  # freed at once

    base = free()
    replay = model_warmup._run(site, lambda: alloc(64 * MIB), 64 * MIB, keep_cache=True)
    assert replay.ran and free() >= base + 64 * MIB
    on_meta = model_warmup._run(site, lambda: torch.ones(8, device="meta") * 2, 0, keep_cache=False)
    assert on_meta.ran and free() >= base + 64 * MIB
    within = model_warmup._run(site, lambda: alloc(32 * MIB), 32 * MIB, keep_cache=False)
    assert within.ran and free() >= base + 64 * MIB and model_warmup.cached_free(device)
    grew = model_warmup._run(site, lambda: alloc(256 * MIB), 256 * MIB, keep_cache=False)
    assert grew.ran and free() < base + 64 * MIB and grew.kept_bytes < base + 64 * MIB
