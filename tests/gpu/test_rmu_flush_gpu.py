"""The RMU's flush on a GPU: tier 2 encoded by the Triton kernel from the working parity
on the device, tier-1 copies on a side stream; the host tiers equal a full re-encode of
the data by the PyTorch engine, and a kill inside the flush (copies still in flight) with
torn host tiers and lost pages finishes exactly like the fault-free GPU run.
The CPU twin is tests/updater/test_flush.py."""

from __future__ import annotations

import pytest
import torch

from leto.erasure import ErasureConfig
from leto.retained.marker import Phase
from tests.updater.rig import Killed, Rig, kill_at, model, no_faults
from tests.updater.test_flush import assert_parity_is_fresh
from tests.updater.test_rmu import _step

# ~5 MiB of state: 5 groups of D=16 pages of 64 KiB, ~6 chunks of 256 KiB of parameters
ERASURE = ErasureConfig(page_bytes=65536, data_pages=16, tier1_parity=4, tier2_parity=2)
CHUNK = 256 << 10


def _rig() -> Rig:
    return Rig.build(
        model(dim=256), erasure=ERASURE, chunk_bytes=CHUNK, backend="auto", device="cuda"
    )


def test_gpu_flush_parity_equals_a_full_reencode() -> None:
    rig = _rig()
    assert rig.protected.groups[0]._on_device() and len(rig.updater(no_faults()).chunks) >= 3
    for s in range(3):
        _step(rig, s, no_faults())
        assert_parity_is_fresh(rig)


def test_gpu_kill_in_the_flush_with_torn_tiers_and_lost_pages_finishes_exactly() -> None:
    ref = _rig()
    for s in range(3):
        _step(ref, s, no_faults())
    rig = _rig()
    _step(rig, 0, no_faults())
    with pytest.raises(Killed):
        _step(rig, 1, kill_at(1, "flush"))
    torch.cuda.synchronize()  # the dead process's queued copies are gone with it; here they land
    assert rig.marker.phase == Phase.FLUSHING
    for g in rig.protected.groups:
        g.tier1[: g.tier1.numel() // 3].fill_(0x5A)
        g.tier2.fill_(0xA5)
    updater = rig.updater(no_faults())
    updater.prepare()
    lost = rig.erase_pages(ERASURE.tier1_parity, seed=1)
    d = ERASURE.data_pages
    for i, g in enumerate(updater.working_groups()):
        g.rebuild([p - i * d for p in lost if i * d <= p < (i + 1) * d])
    assert updater.resume(1) == "flush"
    assert_parity_is_fresh(rig)
    lost = rig.erase_pages(ERASURE.tier1_parity, seed=2)
    for i, g in enumerate(rig.protected.groups):
        g.tier1_page(1).zero_()
        assert not g.rebuild(
            [p - i * d for p in lost if i * d <= p < (i + 1) * d], [1]
        ).tier2_reencoded
    _step(rig, 2, no_faults())
    assert torch.equal(rig.state, ref.state)
    for g, r in zip(rig.protected.groups, ref.protected.groups, strict=True):
        assert torch.equal(g.tier1, r.tier1) and torch.equal(g.tier2, r.tier2)
