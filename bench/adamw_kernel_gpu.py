"""The fused RMU AdamW kernel (undo copy + AdamW) against torch's fused AdamW, same shapes.

One piece per parameter of the GPT of ``bench/recovery_gpu.py`` (1.1 B parameters, float32
state), the kernel's launch variants (``ALIGN``: 16-byte vector accesses; ``BLOCK``
elements per program; ``num_warps``), torch's ``AdamW(fused=True).step()`` over tensors of
the same shapes, and a device copy of the same bytes as the kernel moves (the rate
ceiling). Times are CUDA-event medians; ``GB/s`` counts the words each moves (kernel: read
p, g, m, v, write undo p, m, v and new p, m, v = 10 words per element; torch: 7).

    python bench/adamw_kernel_gpu.py [--small] [--reps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from triton_kernels import adamw_rmu


def gpt_numels(vocab: int, dim: int, layers: int, seq: int) -> list[int]:
    block = [dim, dim, dim, dim, 3 * dim * dim, 3 * dim, dim * dim, dim]  # ln1, ln2, attn
    block += [4 * dim * dim, 4 * dim, 4 * dim * dim, dim]  # mlp
    return [vocab * dim, seq * dim, *block * layers, dim, dim, vocab * dim]


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    numels = gpt_numels(256, 64, 2, 16) if args.small else gpt_numels(32000, 2048, 20, 512)
    device = torch.device("cuda")
    offs, at = [], 0
    for n in numels:
        offs.append(at)
        at += -(-n // 16) * 16
    total = at
    state = torch.randn(3 * total, device=device)
    state[2 * total :].abs_()
    grads = torch.randn(total, device=device)
    undo = torch.empty(3 * total, device=device)
    most = sum(-(-n // 1024) for n in numels) * 4  # flags for the smallest BLOCK
    flags = torch.zeros(most, dtype=torch.int64, device=device)
    hyper = {
        "lr": 1e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.1,
        "decoupled": True,
    }
    elems = sum(numels)
    print(f"{len(numels)} pieces, {elems / 1e9:.3f} G elements, {torch.cuda.get_device_name()}")

    def kernel(block: int, warps: int, align: bool) -> None:
        flag = 0
        for o, n in zip(offs, numels, strict=True):
            offsets = (o, total + o, 2 * total + o, o, o, total + o, 2 * total + o)
            a, meta = adamw_rmu._launch_args(
                (state, grads, undo, flags), offsets, n, flag, 7, step=3.0, **hyper
            )
            meta.update(BLOCK_SIZE=block, num_warps=warps)
            if not align:
                meta["ALIGN"] = 1
            adamw_rmu._adamw_undo_kernel[(-(-n // block),)](*a, **meta)
            flag += -(-n // block)

    # the vector variant computes the same bits as the scalar one
    n0 = numels[0] + 3  # a length that is not a multiple of 4 takes ALIGN=1 anyway
    outs = []
    for align in (False, True):
        st, gr = state[: 3 * total].clone(), grads.clone()
        un, fl = torch.zeros_like(undo), torch.zeros_like(flags)
        offsets = (0, total, 2 * total, 0, 0, total, 2 * total)
        a, meta = adamw_rmu._launch_args((st, gr, un, fl), offsets, n0 - 3, 0, 7, step=3.0, **hyper)
        if not align:
            meta["ALIGN"] = 1
        adamw_rmu._adamw_undo_kernel[(-(-(n0 - 3) // 1024),)](*a, **meta)
        outs.append((st, un, fl))
    same = all(torch.equal(x, y) for x, y in zip(*outs, strict=True))
    print(f"ALIGN=4 == ALIGN=1 bit for bit: {same}")
    del outs, st, gr, un, fl
    rows = []
    for block, warps, align in (
        (1024, 4, False),
        (1024, 4, True),
        (2048, 4, True),
        (2048, 8, True),
        (4096, 8, True),
        (4096, 16, True),
    ):
        ms = timed(lambda b=block, w=warps, al=align: kernel(b, w, al), args.reps)
        rows.append((f"leto kernel BLOCK={block} warps={warps} ALIGN={4 if align else 1}", ms, 10))
    params = [torch.randn(n, device=device) for n in numels]
    for prm in params:
        prm.grad = torch.randn_like(prm)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    rows.append(("torch AdamW(fused=True)", timed(opt.step, args.reps), 7))
    src = torch.empty(5 * elems, device=device)
    dst = torch.empty_like(src)
    rows.append(("device copy, 10 words/element", timed(lambda: dst.copy_(src), args.reps), 10))
    torch_ms = rows[-2][1]
    for name, ms, words in rows:
        rate = words * 4 * elems / ms / 1e6
        print(f"{name:<44} {ms:8.2f} ms  {rate:7.0f} GB/s  {ms / torch_ms:5.2f}x torch")


if __name__ == "__main__":
    main()
