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
@given(st.integers(1, 4), st.integers(1, 5), st.integers(1, 2), st.integers(0, 2**32 - 1),
       st.booleans(), st.booleans())
def test_kernel_equals_reference(n_src: int, n_out: int, tiles: int, seed: int,
                                 accumulate: bool, delta: bool) -> None:
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
    engine.mac(coef, [src_buf[j * n : (j + 1) * n] for j in range(n_src)],
               [out_buf[o * n : (o + 1) * n] for o in range(n_out)], accumulate=accumulate,
               srcs_xor=[xor_buf[j * n : (j + 1) * n] for j in range(n_src)] if xors else None,
               backend="triton")
    assert torch.equal(out_buf.cpu(), torch.cat(ref))


def test_group_on_triton_equals_group_on_torch() -> None:
    """Encode, sub-page update and a mixed rebuild through the kernel give the reference
    bytes."""
    cfg = ErasureConfig(page_bytes=2 * TILE_BYTES, data_pages=6, tier1_parity=3,
                        tier2_parity=1)
    data = torch.randint(0, 256, (5 * cfg.page_bytes,), dtype=torch.uint8)
    tk = ProtectionGroup(cfg, data.clone().to(DEV), torch.empty(3 * cfg.page_bytes,
                         dtype=torch.uint8), torch.empty(cfg.page_bytes, dtype=torch.uint8),
                         backend="triton")
    ref = ProtectionGroup(cfg, data.clone(), torch.empty_like(tk.tier1),
                          torch.empty_like(tk.tier2), backend="torch")
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
