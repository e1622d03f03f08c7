"""Two-tier protection groups: encode, incremental update, rebuild, tolerance, layout."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.erasure import (
    CauchyCode,
    ErasureConfig,
    ProtectionGroup,
    padded_bytes,
    plan_groups,
    split_range,
)
from leto.erasure.bitslice import TILE_BYTES
from leto.errors import ConfigError, UnrecoverableStateError


def make_group(
    d: int, h1: int, h2: int, tiles: int, present: int, seed: int, backend: str = "torch"
):
    pb = tiles * TILE_BYTES
    cfg = ErasureConfig(page_bytes=pb, data_pages=d, tier1_parity=h1, tier2_parity=h2)
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (present * pb,), dtype=torch.uint8, generator=g)
    t1 = torch.empty(h1 * pb, dtype=torch.uint8)
    t2 = torch.empty(h2 * pb, dtype=torch.uint8)
    grp = ProtectionGroup(cfg, data, t1, t2, backend=backend)
    grp.encode_all()
    return grp


def snapshot(grp: ProtectionGroup) -> tuple[torch.Tensor, ...]:
    return grp.data.clone(), grp.tier1.clone(), grp.tier2.clone()


def assert_state(grp: ProtectionGroup, want: tuple[torch.Tensor, ...]) -> None:
    assert torch.equal(grp.data, want[0])
    assert torch.equal(grp.tier1, want[1])
    assert torch.equal(grp.tier2, want[2])


groups = st.tuples(
    st.integers(1, 12),  # D
    st.integers(1, 5),  # H1
    st.integers(0, 2),  # H2
    st.integers(1, 2),  # tiles per page
    st.integers(0, 2**32 - 1),
)


@settings(max_examples=25, deadline=None)
@given(groups, st.data())
def test_decode_any_pattern_within_tolerance(shape, data) -> None:
    """Any <= H1 erased pages (data and tier-1 parity mixed), plus tier-2 losses, rebuild
    bit-exactly."""
    decode_any_pattern(shape, data, "torch")


@settings(max_examples=12, deadline=None)
@given(groups, st.data())
def test_decode_by_syndromes_any_pattern_within_tolerance(shape, data) -> None:
    """The device engine's rebuild (the Horner kernel's syndromes of the survivors, then
    ``M^-1 R``; Triton's interpreter on CPU) restores any pattern the one-pass plan does."""
    calls: list[int] = []
    real = ProtectionGroup._rebuild_t1_by_syndromes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            ProtectionGroup,
            "_rebuild_t1_by_syndromes",
            lambda self, plan: calls.append(plan.rows) or real(self, plan),
        )
        ld, l1, via_tier2 = decode_any_pattern(shape, data, "triton")
    t1_erasures = [] if via_tier2 else l1
    assert calls == (
        [len(ld) + len(t1_erasures)] if ld or t1_erasures else []
    )  # the path under test ran


def decode_any_pattern(shape, data, backend: str) -> tuple[list[int], list[int], bool]:
    d, h1, h2, tiles, seed = shape
    present = data.draw(st.integers(1, d), label="present pages")
    grp = make_group(d, h1, h2, tiles, present, seed, backend)
    want = snapshot(grp)
    n_lost = data.draw(st.integers(1, min(h1, present + h1)), label="erasures")
    pool = [("d", j) for j in range(present)] + [("p", p) for p in range(h1)]
    lost = data.draw(
        st.lists(st.sampled_from(pool), min_size=n_lost, max_size=n_lost, unique=True), label="lost"
    )
    lost2 = data.draw(
        st.lists(st.integers(0, h2 - 1), max_size=h2, unique=True) if h2 else st.just([]),
        label="lost tier 2",
    )
    ld = [j for k, j in lost if k == "d"]
    l1 = [p for k, p in lost if k == "p"]
    for j in ld:
        grp.data_page(j).fill_(0xA5)
    for p in l1:
        grp.tier1_page(p).fill_(0x5A)
    for q in lost2:
        grp.tier2_page(q).fill_(0x33)
    report = grp.rebuild(ld, l1, lost2)
    assert report.data_pages == tuple(sorted(ld))
    assert_state(grp, want)
    return ld, l1, bool(l1 or lost2) and len(l1) + len(lost2) <= h2


@settings(max_examples=25, deadline=None)
@given(groups, st.data())
def test_incremental_updates_equal_full_reencode(shape, data) -> None:
    d, h1, h2, tiles, seed = shape
    grp = make_group(d, h1, h2, tiles, d, seed)
    rng = random.Random(seed)
    for _ in range(data.draw(st.integers(1, 4), label="updates")):
        j = rng.randrange(d)
        t0 = rng.randrange(tiles)
        t1 = rng.randrange(t0 + 1, tiles + 1)
        lo = j * grp.config.page_bytes + t0 * TILE_BYTES
        n = (t1 - t0) * TILE_BYTES
        old = grp.data[lo : lo + n].clone()
        grp.data[lo : lo + n] = torch.randint(0, 256, (n,), dtype=torch.uint8)
        grp.update(j, t0 * TILE_BYTES, old, grp.data[lo : lo + n])
    got = snapshot(grp)
    grp.encode_all()
    assert_state(grp, got)


def test_update_into_then_commit_equals_reencode() -> None:
    grp = make_group(6, 3, 1, 2, 6, 7)
    par = grp.tier1.clone()
    pb = grp.config.page_bytes
    for j in (0, 4):
        old = grp.data_page(j).clone()
        grp.data_page(j).copy_(torch.randint(0, 256, (pb,), dtype=torch.uint8))
        grp.update_into(par, j, 0, old, grp.data_page(j))
    grp.commit_tier1(par)
    got = snapshot(grp)
    grp.encode_all()
    assert_state(grp, got)


@settings(max_examples=15, deadline=None)
@given(groups, st.data(), st.sampled_from(["torch", "triton"]))
def test_beyond_tolerance_raises_and_touches_nothing(shape, data, backend: str) -> None:
    """Both engines' rebuilds (the one-pass plan; the syndromes of the survivors) refuse
    more than H1 erasures before writing a byte."""
    d, h1, h2, tiles, seed = shape
    if d <= h1:
        d = h1 + 1
    grp = make_group(d, h1, h2, tiles, d, seed, backend)
    n_data = data.draw(st.integers(h1 + 1, d), label="lost data pages")
    ld = random.Random(seed).sample(range(d), n_data)
    for j in ld:
        grp.data_page(j).fill_(0)
    before = snapshot(grp)
    with pytest.raises(UnrecoverableStateError, match="checkpoint"):
        grp.rebuild(ld, [], [])
    assert_state(grp, before)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tier1_and_tier2_lost_together_falls_back_to_tier1(backend: str) -> None:
    """More tier-1 + tier-2 losses than tier 2 covers: tier 1 rebuilds its own pages from
    the data when it has the budget, and tier 2 is re-encoded."""
    grp = make_group(8, 4, 1, 1, 8, 3, backend)
    want = snapshot(grp)
    grp.data_page(2).zero_()
    grp.tier1_page(0).zero_()
    grp.tier1_page(3).zero_()
    grp.tier2_page(0).zero_()
    report = grp.rebuild([2], [0, 3], [0])
    assert report.tier2_reencoded
    assert_state(grp, want)
    grp.data_page(1).zero_()
    grp.data_page(2).zero_()
    grp.data_page(5).zero_()
    for p in (0, 1):
        grp.tier1_page(p).zero_()
    grp.tier2_page(0).zero_()
    with pytest.raises(UnrecoverableStateError):
        grp.rebuild([1, 2, 5], [0, 1], [0])


def test_short_group_pads_with_zero_pages() -> None:
    """A 3-page group of a D=8 code has the parity of the same data plus 5 zero pages."""
    short = make_group(8, 2, 1, 1, 3, 11)
    full_data = torch.cat([short.data, torch.zeros(5 * short.config.page_bytes, dtype=torch.uint8)])
    t1, t2 = torch.empty_like(short.tier1), torch.empty_like(short.tier2)
    ProtectionGroup(short.config, full_data, t1, t2, backend="torch").encode_all()
    assert torch.equal(t1, short.tier1) and torch.equal(t2, short.tier2)


def test_cauchy_code_rejects_oversized_groups() -> None:
    with pytest.raises(ConfigError, match="GF"):
        CauchyCode(65530, 16)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"page_bytes": 1000}, "page_bytes"),
        ({"data_pages": 0}, "data_pages"),
        ({"tier1_parity": 0}, "tier1_parity"),
        ({"tier2_parity": -1}, "tier2_parity"),
        ({"data_pages": 65530, "tier1_parity": 16}, "65536"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ErasureConfig(**kwargs)


def test_config_defaults_are_the_papers() -> None:
    cfg = ErasureConfig()
    assert (cfg.page_bytes, cfg.data_pages, cfg.tier1_parity, cfg.tier2_parity) == (
        2 << 20,
        1024,
        16,
        1,
    )
    assert cfg.group_bytes == 2 << 30


def test_layout_helpers() -> None:
    cfg = ErasureConfig(page_bytes=4096, data_pages=4, tier1_parity=2, tier2_parity=1)
    assert padded_bytes(4097, cfg) == 8192
    groups = plan_groups(10 * 4096 + 1, cfg)
    assert [(g.index, g.byte_offset, g.num_pages) for g in groups] == [
        (0, 0, 4),
        (1, 4 * 4096, 4),
        (2, 8 * 4096, 3),
    ]
    spans = split_range(3 * 4096 + 2048, 4096, cfg)
    assert [(s.group, s.page, s.offset, s.nbytes) for s in spans] == [
        (0, 3, 2048, 2048),
        (1, 0, 0, 2048),
    ]
    assert sum(s.nbytes for s in spans) == 4096


def test_update_rejects_unaligned_ranges() -> None:
    grp = make_group(4, 2, 1, 2, 4, 1)
    x = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 KiB"):
        grp.update(0, 0, x, x)
