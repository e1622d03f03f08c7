"""The RMU's flush: tier 2 is encoded from the working parity where it lives (not from the
host copy), both host tiers equal a full re-encode of the data, and a kill inside the flush
— host tiers torn in any combination, pages lost — still finishes bit-identically, after
which a lost host tier-1 page is rebuilt from tier 2."""

from __future__ import annotations

import pytest
import torch

from leto.erasure import ErasureConfig, ProtectionGroup
from leto.retained.marker import Phase
from tests.updater.rig import Killed, Rig, kill_at, model, no_faults
from tests.updater.test_rmu import CHUNK, ERASURE, _reference, _step

TWO_T2 = ErasureConfig(page_bytes=4096, data_pages=8, tier1_parity=4, tier2_parity=2)
T2_WIDER = ErasureConfig(
    page_bytes=4096, data_pages=8, tier1_parity=1, tier2_parity=2
)  # staged outside Q


def fresh_parity(rig: Rig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Both tiers of every group re-encoded from the data, into new host buffers (the
    PyTorch engine, whatever device the data is on)."""
    out = []
    for g in rig.protected.groups:
        t1, t2 = (
            torch.empty(g.tier1.shape, dtype=torch.uint8),
            torch.empty(g.tier2.shape, dtype=torch.uint8),
        )
        fresh = ProtectionGroup(g.config, g.data.cpu(), t1, t2, backend="torch")
        fresh.encode_all()
        out.append((t1, t2))
    return out


def assert_parity_is_fresh(rig: Rig) -> None:
    for i, (g, (t1, t2)) in enumerate(zip(rig.protected.groups, fresh_parity(rig), strict=True)):
        assert torch.equal(g.tier1, t1), f"group {i}: host tier 1 is not the parity of the data"
        assert torch.equal(g.tier2, t2), f"group {i}: host tier 2 is not the parity of tier 1"


@pytest.mark.parametrize("erasure", [ERASURE, TWO_T2, T2_WIDER], ids=["h2=1", "h2=2", "h2>h1"])
def test_host_parity_after_updates_equals_a_full_reencode(
    erasure: ErasureConfig, monkeypatch
) -> None:
    rig = Rig.build(model(), erasure=erasure, chunk_bytes=CHUNK)

    def host_encode(self: ProtectionGroup) -> None:
        raise AssertionError("the flush re-encoded tier 2 from the host copy")

    for s in range(3):
        with monkeypatch.context() as patch:
            patch.setattr(ProtectionGroup, "encode_tier2", host_encode)
            _step(rig, s, no_faults())
        assert_parity_is_fresh(rig)
    assert rig.marker.step == 3 and rig.marker.phase == Phase.IDLE


def test_triton_flush_equals_the_torch_flush() -> None:
    """The kernel path (Triton's interpreter on CPU) leaves the same bytes everywhere."""
    ref = _reference(TWO_T2, steps=2)
    rig = Rig.build(model(), erasure=TWO_T2, chunk_bytes=CHUNK, backend="triton")
    assert rig.protected.groups[0]._on_device(), (
        "TRITON_INTERPRET=1 is set by tests/updater/conftest.py"
    )
    for s in range(2):
        _step(rig, s, no_faults())
    assert torch.equal(rig.state, ref.state)
    for g, r in zip(rig.protected.groups, ref.protected.groups, strict=True):
        assert torch.equal(g.tier1, r.tier1) and torch.equal(g.tier2, r.tier2)


@pytest.mark.parametrize("torn", ["tier1", "tier1+tier2", "tier2"])
def test_kill_in_the_flush_torn_host_tiers_lost_pages_then_tier2_rebuild(torn: str) -> None:
    """Kill inside the flush; the host tiers are left torn (tier 2 as if written before,
    during or after tier 1's copy); H1 data pages per group plus host parity pages are
    lost. Recovery rebuilds the data from Q[sel] and reruns the flush. Then, at IDLE, one
    host tier-1 page per group is lost again, with H1 data pages: tier 2 restores the
    tier-1 page and tier 1 the data; the next step equals the fault-free run."""
    cfg = TWO_T2
    ref = _reference(cfg, steps=3)
    rig = Rig.build(model(), erasure=cfg, chunk_bytes=CHUNK)
    _step(rig, 0, no_faults())
    with pytest.raises(Killed):
        _step(rig, 1, kill_at(1, "flush"))
    assert rig.marker.phase == Phase.FLUSHING
    gen = torch.Generator().manual_seed(3)
    for g in rig.protected.groups:
        if "tier1" in torn:
            g.tier1[: g.tier1.numel() // 3].copy_(
                torch.randint(0, 256, (g.tier1.numel() // 3,), dtype=torch.uint8, generator=gen)
            )
        if "tier2" in torn:
            g.tier2.copy_(torch.randint(0, 256, g.tier2.shape, dtype=torch.uint8, generator=gen))
    # the promoted trainer: prepare, lose pages, rebuild data from the working parity, resume
    updater = rig.updater(no_faults())
    updater.prepare()
    lost = rig.erase_pages(cfg.tier1_parity, seed=1)
    for g in rig.protected.groups:
        g.tier1_page(0).zero_()  # lost host parity pages: left to the rerun flush
        g.tier2_page(1).zero_()
    d = cfg.data_pages
    for i, g in enumerate(updater.working_groups()):
        g.rebuild([p - i * d for p in lost if i * d <= p < (i + 1) * d])
    assert updater.resume(1) == "flush"
    assert rig.marker.step == 2 and rig.marker.phase == Phase.IDLE
    assert_parity_is_fresh(rig)
    # at IDLE: a host tier-1 page and H1 data pages per group lost, rebuilt tier 2 first
    lost = rig.erase_pages(cfg.tier1_parity, seed=2)
    for i, g in enumerate(rig.protected.groups):
        g.tier1_page(2).zero_()
        report = g.rebuild([p - i * d for p in lost if i * d <= p < (i + 1) * d], [2])
        assert not report.tier2_reencoded, "the tier-1 page came from tier 2"
    assert_parity_is_fresh(rig)
    _step(rig, 2, no_faults())
    assert torch.equal(rig.state, ref.state)
    for g, r in zip(rig.protected.groups, ref.protected.groups, strict=True):
        assert torch.equal(g.tier1, r.tier1) and torch.equal(g.tier2, r.tier2)


def test_flush_kill_with_tier2_staged_outside_the_working_parity() -> None:
    """H2 > H1: tier 2 is staged in a temporary buffer; the flush kill still recovers."""
    ref = _reference(T2_WIDER, steps=3)
    rig = Rig.build(model(), erasure=T2_WIDER, chunk_bytes=CHUNK)
    _step(rig, 0, no_faults())
    with pytest.raises(Killed):
        _step(rig, 1, kill_at(1, "flush"))
    updater = rig.updater(no_faults())
    updater.prepare()
    assert updater.resume(1) == "flush"
    _step(rig, 2, no_faults())
    assert torch.equal(rig.state, ref.state)
    assert_parity_is_fresh(rig)
