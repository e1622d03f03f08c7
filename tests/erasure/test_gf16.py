"""GF(2^16) arithmetic: field laws, tables, bit matrices, bit-sliced layout."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.erasure import gf16
from leto.erasure.bitslice import TILE_BYTES, from_symbols, mac_pages, to_symbols

elem = st.integers(0, 0xFFFF)
nonzero = st.integers(1, 0xFFFF)


def test_tables_cover_the_multiplicative_group() -> None:
    assert sorted(gf16.EXP_NP[: gf16.ORDER - 1].tolist()) == list(range(1, gf16.ORDER))


def _clmul_mod(a: int, b: int) -> int:
    """Schoolbook carry-less product reduced by 0x1100B: independent of the tables."""
    r = 0
    for i in range(16):
        if b >> i & 1:
            r ^= a << i
    for i in range(31, 15, -1):
        if r >> i & 1:
            r ^= gf16.POLY << (i - 16)
    return r


@settings(max_examples=200, deadline=None)
@given(elem, elem, elem)
def test_field_laws(a: int, b: int, c: int) -> None:
    assert gf16.mul(a, b) == _clmul_mod(a, b)
    assert gf16.mul(a, b) == gf16.mul(b, a)
    assert gf16.mul(a, gf16.mul(b, c)) == gf16.mul(gf16.mul(a, b), c)
    assert gf16.mul(a, b ^ c) == gf16.mul(a, b) ^ gf16.mul(a, c)


@settings(max_examples=100, deadline=None)
@given(nonzero)
def test_inverse(a: int) -> None:
    assert gf16.mul(a, gf16.inv(a)) == 1


@settings(max_examples=50, deadline=None)
@given(elem, st.lists(elem, min_size=1, max_size=8))
def test_bitmatrix_is_multiplication(c: int, xs: list[int]) -> None:
    rows = gf16.bitmatrix_rows(c)
    for x in xs:
        y = sum(((rows[i] & x).bit_count() & 1) << i for i in range(16))
        assert y == gf16.mul(c, x)
    assert np.array_equal(gf16.bitmatrix_rows_np(np.array([c]))[0], np.array(rows))


def test_mat_inv_roundtrip() -> None:
    rng = np.random.default_rng(0)
    m = rng.integers(0, 1 << 16, size=(5, 5)).tolist()
    prod = gf16.mat_mul(np.array(m), np.array(gf16.mat_inv(m)))
    assert np.array_equal(prod, np.eye(5, dtype=np.int64))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_symbol_layout_roundtrip(tiles: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (tiles * TILE_BYTES,), dtype=torch.uint8, generator=g)
    sym = to_symbols(x)
    assert sym.numel() == tiles * 1024 and int(sym.max()) < 1 << 16
    assert torch.equal(from_symbols(sym), x)


@settings(max_examples=20, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 2),
    st.integers(0, 2**32 - 1),
    st.booleans(),
)
def test_bitsliced_mac_equals_symbol_arithmetic(
    n_src: int, n_out: int, tiles: int, seed: int, accumulate: bool
) -> None:
    """The bit-sliced CPU engine computes the textbook GF(2^16) linear combination."""
    g = torch.Generator().manual_seed(seed)
    n = tiles * TILE_BYTES
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for _ in range(n_src)]
    coef = torch.randint(0, 1 << 16, (n_out, n_src), generator=g).tolist()
    outs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for _ in range(n_out)]
    before = [to_symbols(o) for o in outs]
    mac_pages(coef, srcs, outs, accumulate=accumulate)
    for o in range(n_out):
        want = before[o].clone() if accumulate else torch.zeros_like(before[o])
        for j in range(n_src):
            want ^= gf16.mul_symbols(to_symbols(srcs[j]), coef[o][j])
        assert torch.equal(to_symbols(outs[o]), want)
