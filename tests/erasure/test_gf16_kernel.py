"""The Triton kernel equals the PyTorch reference (interpreter on CPU, the GPU when present).

Sizes stay tiny: the interpreter costs 0.1-1 s per MiB.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.erasure import ErasureConfig, ProtectionGroup, engine
from leto.erasure.bitslice import TILE_BYTES, mac_pages

pytest.importorskip("triton")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@settings(max_examples=12, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 2),
    st.integers(0, 2**32 - 1),
    st.booleans(),
    st.booleans(),
)
def test_kernel_equals_reference(
    n_src: int, n_out: int, tiles: int, seed: int, accumulate: bool, delta: bool
) -> None:
    assert engine.resolve_backend("triton", DEV) == "triton"  # not the PyTorch fallback
    g = torch.Generator().manual_seed(seed)
    n = tiles * TILE_BYTES

    def rnd() -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)

    srcs = [rnd() for _ in range(n_src)]
    xors = [rnd() for _ in range(n_src)] if delta else None
    coef = torch.randint(0, 1 << 16, (n_out, n_src), generator=g).tolist()
    outs = [rnd() for _ in range(n_out)]
    ref = [o.clone() for o in outs]
    mac_pages(coef, srcs, ref, accumulate=accumulate, srcs_xor=xors)
    # one buffer per role, so the kernel reaches pages by offset as it does in a group
    src_buf = torch.cat(srcs).to(DEV)
    xor_buf = torch.cat(xors).to(DEV) if xors else None
    out_buf = torch.cat(outs).to(DEV)
    engine.mac(
        coef,
        [src_buf[j * n : (j + 1) * n] for j in range(n_src)],
        [out_buf[o * n : (o + 1) * n] for o in range(n_out)],
        accumulate=accumulate,
        srcs_xor=[xor_buf[j * n : (j + 1) * n] for j in range(n_src)] if xors else None,
        backend="triton",
    )
    assert torch.equal(out_buf.cpu(), torch.cat(ref))


def test_group_on_triton_equals_group_on_torch() -> None:
    """Encode, sub-page update and a mixed rebuild through the kernel give the reference
    bytes."""
    cfg = ErasureConfig(page_bytes=2 * TILE_BYTES, data_pages=6, tier1_parity=3, tier2_parity=1)
    data = torch.randint(0, 256, (5 * cfg.page_bytes,), dtype=torch.uint8)
    tk = ProtectionGroup(
        cfg,
        data.clone().to(DEV),
        torch.empty(3 * cfg.page_bytes, dtype=torch.uint8),
        torch.empty(cfg.page_bytes, dtype=torch.uint8),
        backend="triton",
    )
    ref = ProtectionGroup(
        cfg, data.clone(), torch.empty_like(tk.tier1), torch.empty_like(tk.tier2), backend="torch"
    )
    tk.encode_all()
    ref.encode_all()
    assert torch.equal(tk.tier1, ref.tier1) and torch.equal(tk.tier2, ref.tier2)
    lo, n = 2 * cfg.page_bytes + TILE_BYTES, TILE_BYTES
    new = torch.randint(0, 256, (n,), dtype=torch.uint8)
    for grp in (tk, ref):
        old = grp.data[lo : lo + n].clone()
        grp.data[lo : lo + n] = new.to(grp.data.device)
        grp.update(2, TILE_BYTES, old, grp.data[lo : lo + n])
    assert torch.equal(tk.tier1, ref.tier1) and torch.equal(tk.tier2, ref.tier2)
    want = tk.data.clone()
    tk.data_page(1).zero_()
    tk.data_page(4).zero_()
    tk.tier1_page(2).zero_()
    tk.rebuild([1, 4], [2], [])
    assert torch.equal(tk.data, want) and torch.equal(tk.tier1, ref.tier1)


@settings(max_examples=8, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(1, 2),
    st.integers(0, 2**32 - 1),
    st.booleans(),
    st.booleans(),
    st.sampled_from([1, 2]),
)
def test_kernel_variants_equal_reference(
    n_src: int, n_out: int, tiles: int, seed: int, delta: bool, prefetch: bool, out_block: int
) -> None:
    """The strided (per-chunk) and table forms, with and without the software pipeline,
    equal the reference; masks start at an arbitrary matrix column (``mask_first``)."""
    from leto.erasure.bitslice import plane_masks
    from triton_kernels.gf16_mac import gf16_mac, gf16_mac_strided

    g = torch.Generator().manual_seed(seed)
    n = tiles * TILE_BYTES
    first = int(torch.randint(0, 3, (1,), generator=g))
    coef_all = torch.randint(0, 1 << 16, (n_out, first + n_src), generator=g).tolist()
    coef = [row[first:] for row in coef_all]
    src = torch.randint(0, 256, (n_src, n + 2 * TILE_BYTES), dtype=torch.uint8, generator=g)
    xor = torch.randint(0, 256, (n_src * n,), dtype=torch.uint8, generator=g)
    out = torch.randint(0, 256, (n_out * (n + TILE_BYTES),), dtype=torch.uint8, generator=g)
    srcs = [src[j, TILE_BYTES : TILE_BYTES + n] for j in range(n_src)]
    xors = [xor[j * n : (j + 1) * n] for j in range(n_src)] if delta else None
    outs = [out[o * (n + TILE_BYTES) + TILE_BYTES :][:n] for o in range(n_out)]
    ref = [o.clone() for o in outs]
    mac_pages(coef, srcs, ref, accumulate=True, srcs_xor=xors)
    launch = {"prefetch": int(prefetch), "out_block": out_block, "block_n": 64, "num_warps": 1}
    got = out.clone().to(DEV)
    masks = plane_masks(coef_all).to(DEV)
    s_dev, x_dev = src.to(DEV), xor.to(DEV)
    gf16_mac_strided(
        masks,
        first,
        n_src,
        s_dev[:, TILE_BYTES:].view(torch.int32),
        s_dev.stride(0) // 4,
        got.view(torch.int32),
        TILE_BYTES // 4,
        (n + TILE_BYTES) // 4,
        tiles,
        accumulate=True,
        src2=x_dev.view(torch.int32) if delta else None,
        src2_stride=n // 4,
        **launch,
    )
    got_outs = [got[o * (n + TILE_BYTES) + TILE_BYTES :][:n].cpu() for o in range(n_out)]
    assert all(torch.equal(a, b) for a, b in zip(got_outs, ref, strict=True))
    if delta:
        return  # the table form shares one offset table between the two inputs
    got = out.clone().to(DEV)
    w = s_dev.view(torch.int32)
    src_off = torch.tensor(
        [j * s_dev.stride(0) // 4 + TILE_BYTES // 4 for j in range(n_src)],
        dtype=torch.int64,
        device=DEV,
    )
    dst_off = torch.tensor(
        [(o * (n + TILE_BYTES) + TILE_BYTES) // 4 for o in range(n_out)],
        dtype=torch.int64,
        device=DEV,
    )
    gf16_mac(
        masks[first:].contiguous(),
        w.view(-1),
        src_off,
        got.view(torch.int32),
        dst_off,
        tiles,
        accumulate=True,
        **launch,
    )
    got_outs = [got[o * (n + TILE_BYTES) + TILE_BYTES :][:n].cpu() for o in range(n_out)]
    assert all(torch.equal(a, b) for a, b in zip(got_outs, ref, strict=True))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_update_pages_equals_reencode(backend: str) -> None:
    """Multi-page chunks (flat and [k, n] views, whole and sub-page ranges) folded in by
    ``update_pages`` give the parity of a full re-encode, on both engines."""
    pb = 2 * TILE_BYTES
    cfg = ErasureConfig(page_bytes=pb, data_pages=8, tier1_parity=3, tier2_parity=1)
    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (7 * pb,), dtype=torch.uint8, generator=g).to(DEV)
    grp = ProtectionGroup(
        cfg,
        data,
        torch.empty(3 * pb, dtype=torch.uint8),
        torch.empty(pb, dtype=torch.uint8),
        backend=backend,
    )
    grp.encode_all()
    par = grp.tier1.clone().to(DEV) if backend == "triton" else grp.tier1.clone()
    pages = data.view(7, pb)
    # whole pages 2..4 as a flat chunk
    old = data[2 * pb : 5 * pb].clone()
    data[2 * pb : 5 * pb] = torch.randint(0, 256, (3 * pb,), dtype=torch.uint8, generator=g).to(DEV)
    grp.update_pages(par, 2, 3, 0, old, data[2 * pb : 5 * pb])
    # second tile of pages 4..6 as [k, n] views straight into the data
    old = pages[4:7, TILE_BYTES:].clone()
    pages[4:7, TILE_BYTES:] = torch.randint(
        0, 256, (3, TILE_BYTES), dtype=torch.uint8, generator=g
    ).to(DEV)
    grp.update_pages(par, 4, 3, TILE_BYTES, old, pages[4:7, TILE_BYTES:])
    grp.commit_tier1(par)
    ref = ProtectionGroup(
        cfg,
        data.cpu(),
        torch.empty(3 * pb, dtype=torch.uint8),
        torch.empty(pb, dtype=torch.uint8),
        backend="torch",
    )
    ref.encode_all()
    assert torch.equal(grp.tier1, ref.tier1) and torch.equal(grp.tier2, ref.tier2)
    with pytest.raises(IndexError):
        grp.update_pages(par, 6, 2, 0, old[:2], old[:2])
    with pytest.raises(ValueError):
        grp.update_pages(par, 0, 1, 100, old[0, :TILE_BYTES], old[0, :TILE_BYTES])
