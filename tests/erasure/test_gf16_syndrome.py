"""The Horner syndrome kernel equals the PyTorch reference (interpreter on CPU, the GPU
when present), and the syndrome form agrees with the GRS code's parity.

Sizes stay tiny: the interpreter costs 0.1-1 s per MiB.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from leto.erasure import ErasureConfig, ProtectionGroup
from leto.erasure.bitslice import TILE_BYTES, mac_pages
from leto.erasure.rs import GRSCode

pytest.importorskip("triton")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@settings(max_examples=24, deadline=None)
@given(
    st.integers(1, 40),
    st.sampled_from([1, 3, 8, 9, 16, 16]),
    st.integers(1, 5),
    st.integers(1, 2),
    st.integers(0, 2**32 - 1),
    st.booleans(),
    st.sampled_from([4, 8]),
)
@example(20, 16, 5, 1, 1, False, 4)  # H = 16: balanced parts, always tried with both part sizes
@example(20, 16, 5, 1, 2, True, 8)
def test_syndrome_kernel_equals_reference(
    d: int, h: int, k: int, tiles: int, seed: int, in_place: bool, acc: int
) -> None:
    """Any D, H, run and range, in place or not, 4 or 8 syndromes per program (in order, or
    in mirrored pairs when all 16 are launched)."""
    from leto.erasure.engine import scale_table
    from triton_kernels.gf16_syndrome import syndrome_update

    g = torch.Generator().manual_seed(seed)
    k = min(k, d)
    j0 = int(torch.randint(0, d - k + 1, (1,), generator=g))
    n = tiles * TILE_BYTES
    pad = TILE_BYTES  # pages farther apart than the range: strides are exercised

    def rnd(nbytes: int) -> torch.Tensor:
        return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)

    new, old, q_in = rnd(k * (n + pad)), rnd(k * (n + pad)), rnd(h * (n + pad) + pad)
    code = GRSCode(d, h)
    coef = code.check_data[:, j0 : j0 + k].tolist()
    ref = q_in.clone()
    mac_pages(
        coef,
        [new[i * (n + pad) : i * (n + pad) + n] for i in range(k)],
        [ref[pad + p * (n + pad) : pad + p * (n + pad) + n] for p in range(h)],
        accumulate=True,
        srcs_xor=[old[i * (n + pad) : i * (n + pad) + n] for i in range(k)],
    )
    q_dev = q_in.to(DEV)
    q_out = q_dev if in_place else q_dev.clone()
    syndrome_update(
        scale_table(d, code.first_row, DEV),
        code.first_row,
        j0,
        k,
        new.to(DEV).view(torch.int32),
        (n + pad) // 4,
        old.to(DEV).view(torch.int32),
        (n + pad) // 4,
        q_dev.view(torch.int32),
        q_out.view(torch.int32),
        pad // 4,
        (n + pad) // 4,
        h,
        tiles,
        acc=acc,
    )
    assert torch.equal(q_out.cpu(), ref)


def test_syndrome_kernel_refuses_unknown_launch_options() -> None:
    """A misspelt or retired launch option (the session-6 sweep's ``depth``, ``split``) is an
    error, not silently the default shape."""
    from leto.erasure.engine import scale_table
    from triton_kernels.gf16_syndrome import syndrome_update

    w = torch.zeros(TILE_BYTES // 4, dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match="split"):
        syndrome_update(
            scale_table(4, 0, DEV), 0, 0, 1, w, 0, w, 0, w, w.clone(), 0, 0, 1, 1, split=2
        )


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_syndrome_group_update_pages_and_conversions(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A syndrome-form group (the updater's working parity) updated chunk by chunk holds
    the syndromes of the data; ``parity_of`` gives the GRS parity bytes, ``syndromes_of``
    inverts it; a lost data page is rebuilt from the syndromes; lost syndromes are refused."""
    import leto.erasure.engine as erasure_engine

    monkeypatch.setattr(
        erasure_engine, "SYNDROME_KERNEL", True
    )  # the Horner kernel through update_pages,
    monkeypatch.setattr(erasure_engine, "SYNDROME_MIN_PAGES", 1)  # for the short runs below too
    cfg = ErasureConfig(page_bytes=2 * TILE_BYTES, data_pages=8, tier1_parity=9, tier2_parity=0)
    pb = cfg.page_bytes
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (7 * pb,), dtype=torch.uint8, generator=g).to(DEV)
    empty = torch.empty(0, dtype=torch.uint8, device=DEV)
    host = ProtectionGroup(
        cfg, data, torch.empty(9 * pb, dtype=torch.uint8, device=DEV), empty, backend=backend
    )
    host.encode_tier1()
    work = ProtectionGroup(
        cfg,
        data,
        torch.empty(9 * pb, dtype=torch.uint8, device=DEV),
        empty,
        syndromes=True,
        backend=backend,
    )
    work.syndromes_of(host.tier1, work.tier1)
    fresh = ProtectionGroup(
        cfg,
        data,
        torch.empty(9 * pb, dtype=torch.uint8, device=DEV),
        empty,
        syndromes=True,
        backend="torch",
    )
    assert torch.equal(work.tier1, fresh.encode_tier1())
    # a chunk of 3 pages (whole) and a sub-page range of 2 pages, folded in place
    old = data.clone()
    data[2 * pb : 5 * pb] = torch.randint(0, 256, (3 * pb,), dtype=torch.uint8, generator=g).to(DEV)
    work.update_pages(work.tier1, 2, 3, 0, old[2 * pb : 5 * pb], data[2 * pb : 5 * pb])
    old2 = data.clone()
    data.view(7, pb)[5:7, TILE_BYTES:] ^= 0x5A
    work.update_pages(
        work.tier1,
        5,
        2,
        TILE_BYTES,
        old2.view(7, pb)[5:7, TILE_BYTES:],
        data.view(7, pb)[5:7, TILE_BYTES:],
    )
    assert torch.equal(work.tier1, fresh.encode_tier1())
    back = torch.empty_like(work.tier1)
    work.parity_of(work.tier1, back)
    assert torch.equal(back, host.encode_tier1(torch.empty_like(back)))
    want = data.clone()
    data[3 * pb : 4 * pb] = 0
    data[6 * pb : 7 * pb] = 0
    work.rebuild([3, 6])
    assert torch.equal(data, want)
    from leto.errors import UnrecoverableStateError

    with pytest.raises(UnrecoverableStateError, match="syndrome pages"):
        work.rebuild([1], [0])


@pytest.mark.parametrize("syndromes", [False, True])
def test_encode_by_syndromes_equals_the_generic_encode(
    syndromes: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``encode_all`` on the device path (the Horner kernel over every page, then
    ``P = W^-1 S`` and tier 2 where the data lives) writes the same bytes in both tiers as
    the PyTorch engine's product, for a full and a short group."""
    import leto.erasure.engine as erasure_engine

    monkeypatch.setattr(erasure_engine, "SYNDROME_MIN_PAGES", 1)
    cfg = ErasureConfig(page_bytes=2 * TILE_BYTES, data_pages=6, tier1_parity=5, tier2_parity=2)
    pb, g = cfg.page_bytes, torch.Generator().manual_seed(7)
    for pages in (6, 3):
        data = torch.randint(0, 256, (pages * pb,), dtype=torch.uint8, generator=g)
        tiers = {}
        for backend in ("torch", "triton"):
            t1, t2 = (
                torch.full((5 * pb,), 0xAA, dtype=torch.uint8),
                torch.full((2 * pb,), 0x55, dtype=torch.uint8),
            )
            grp = ProtectionGroup(
                cfg, data.to(DEV), t1.to(DEV), t2.to(DEV), backend=backend, syndromes=syndromes
            )
            if backend == "triton":
                assert grp._encode_tier1_by_syndromes() is not None  # the path under test runs
            grp.encode_all()
            tiers[backend] = (grp.tier1.cpu(), grp.tier2.cpu())
        assert torch.equal(tiers["torch"][0], tiers["triton"][0]) and torch.equal(
            tiers["torch"][1], tiers["triton"][1]
        )


@pytest.mark.parametrize("h", [1, 2, 3, 16])
def test_the_check_rows_are_centred_and_any_h_erasures_decode(h: int) -> None:
    """The tier-1 rows are consecutive and centred on 0 (the Horner kernel's cheapest), and
    the code stays MDS: any ``h`` erased pages of a codeword (data and parity mixed) come
    back through the one-pass plan and through the syndromes."""
    import numpy as np

    from leto.erasure.gf16 import mat_mul

    d = 40
    code = GRSCode(d, h)
    rows = [code.first_row + p for p in range(h)]
    assert max(abs(e) for e in rows) <= h // 2 and rows == list(range(rows[0], rows[0] + h))
    g = np.random.default_rng(h)
    data = g.integers(0, 1 << 16, size=(d, 1), dtype=np.int64)
    parity = mat_mul(code.matrix, data)
    word = np.concatenate([data, parity])[:, 0]
    for _ in range(5):
        lost = sorted(g.choice(d + h, size=h, replace=False).tolist())
        ld, lp = [j for j in lost if j < d], [j - d for j in lost if j >= d]
        plan = code.decode_plan(ld, lp)
        src = np.array(
            [word[r.index if r.kind == "data" else d + r.index] for r in plan.sources],
            dtype=np.int64,
        )
        got = mat_mul(plan.matrix, src[:, None])[:, 0] if plan.sources else []
        want = [word[r.index if r.kind == "data" else d + r.index] for r in plan.outputs]
        assert list(got) == want
        sd = code.syndrome_decode(ld, lp)
        zeroed = data.copy()
        zeroed[ld] = 0
        r = mat_mul(code.check_data[: sd.rows], zeroed)
        if sd.parity_sources:
            surv = parity[list(sd.parity_sources)]
            r = r ^ mat_mul(sd.parity_coef, surv)
        back = mat_mul(sd.inverse, r)[:, 0]
        want = [word[o.index if o.kind == "data" else d + o.index] for o in sd.outputs]
        assert list(back) == want
