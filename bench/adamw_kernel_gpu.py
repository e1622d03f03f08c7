"""The fused RMU AdamW kernel (undo copy + AdamW) against torch's fused AdamW, same shapes.

One piece per parameter of the GPT of ``bench/recovery_gpu.py`` (1.1 B parameters, float32
state): the kernel as the updater launches it (one launch over a chunk's piece table; here
one chunk of every piece, and one chunk per piece as a chunk size of one parameter would
give), torch's ``AdamW(fused=True).step()`` over tensors of the same shapes, and a device
copy of the same bytes as the kernel moves (the rate ceiling). The kernel runs two ways:
keeping its undo image (what the erasure parity folds from) and dropping a done block's
undo words from the L2 (``discard``, the default without erasure), which must compute the
same bits. Device times are CUDA-event medians; ``host ms`` is the median host time to
enqueue one call (what a step pays on the CPU); ``GB/s`` counts the words each asks for
(kernel: read p, g, m, v, write undo p, m, v and new p, m, v = 10 words per element, of
which the discard keeps the 3 undo words from the memory where they are still in the L2;
torch: 7).

    python bench/adamw_kernel_gpu.py [--small] [--reps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from triton_kernels import adamw_rmu


def gpt_numels(vocab: int, dim: int, layers: int, seq: int) -> list[int]:
    block = [dim, dim, dim, dim, 3 * dim * dim, 3 * dim, dim * dim, dim]  # ln1, ln2, attn
    block += [4 * dim * dim, 4 * dim, 4 * dim * dim, dim]  # mlp
    return [vocab * dim, seq * dim, *block * layers, dim, dim, vocab * dim]


def timed(fn, reps: int) -> tuple[float, float]:
    """(device ms, host ms to enqueue) medians of ``fn``."""
    fn()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), statistics.median(host)


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
    blocks = sum(adamw_rmu.num_blocks(n) for n in numels)
    flags = torch.zeros(blocks, dtype=torch.int64, device=device)
    done = torch.zeros(blocks, dtype=torch.int64, device=device)
    row = adamw_rmu.scalar_row(
        lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True, step=3.0
    )
    scalars = torch.tensor([row], dtype=torch.float64).to(torch.float32).to(device)
    elems = sum(numels)
    print(f"{len(numels)} pieces, {elems / 1e9:.3f} G elements, {torch.cuda.get_device_name()}")

    def pieces(sizes: list[int], starts: list[int]) -> list:
        rows, first = [], 0
        for o, n in zip(starts, sizes, strict=True):
            offsets = (o, total + o, 2 * total + o, o, o, total + o, 2 * total + o)
            rows.append((offsets, n, first, 0))
            first += adamw_rmu.num_blocks(n)
        return rows

    one = adamw_rmu.PieceTable.build(pieces(numels, offs), device)
    each = [
        adamw_rmu.PieceTable.build(pieces([n], [o]), device)
        for o, n in zip(offs, numels, strict=True)
    ]

    scale = torch.ones(1, dtype=torch.float32, device=device)  # no clipping
    adamw_rmu.check_operands(state, grads, scale, undo, flags, done)
    tokens = iter(range(1, 1 << 30))  # a launch skips the blocks done with its token

    def chunk(table: adamw_rmu.PieceTable, discard: bool = False) -> None:
        adamw_rmu.adamw_chunk(
            state, grads, scale, undo, flags, done, table, scalars, next(tokens), discard
        )

    def per_piece() -> None:  # each table's flags start at 0: a token per launch
        for t in each:
            chunk(t)

    # one launch over every piece computes the same bits as a launch per piece, and as one
    # that drops its undo words (the state; the undo image it leaves is undefined)
    outs = []
    for run in (lambda: chunk(one), per_piece, lambda: chunk(one, discard=True)):
        state_at, undo_at = state.clone(), undo.clone()
        run()
        outs.append(state.cpu())
        state.copy_(state_at)
        undo.copy_(undo_at)
        del state_at, undo_at
    print(f"one launch == one launch per piece, bit for bit: {torch.equal(outs[0], outs[1])}")
    print(f"discarding == keeping the undo image, bit for bit: {torch.equal(outs[0], outs[2])}")
    del outs
    rows = [
        (
            f"leto kernel, 1 launch over {len(numels)} pieces",
            *timed(lambda: chunk(one), args.reps),
            10,
        ),
        (
            "leto kernel, 1 launch, undo dropped (discard)",
            *timed(lambda: chunk(one, discard=True), args.reps),
            10,
        ),
        (f"leto kernel, {len(numels)} launches", *timed(per_piece, args.reps), 10),
    ]
    params = [torch.randn(n, device=device) for n in numels]
    for prm in params:
        prm.grad = torch.randn_like(prm)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    rows.append(("torch AdamW(fused=True)", *timed(opt.step, args.reps), 7))
    del params, opt
    for t in (state, grads, undo):  # the copy's 10 words per element fit an 80 GB card then
        t.set_()
    torch.cuda.empty_cache()
    src = torch.empty(5 * elems, device=device)
    dst = torch.empty_like(src)
    rows.append(("device copy, 10 words/element", *timed(lambda: dst.copy_(src), args.reps), 10))
    torch_ms = rows[-2][1]
    print(f"{'':<44} {'ms':>8}     {'host ms':>7}  {'GB/s':>7}")
    for name, ms, host, words in rows:
        rate = words * 4 * elems / ms / 1e6
        print(
            f"{name:<44} {ms:8.2f} ms  {host:7.2f}  {rate:7.0f} GB/s  {ms / torch_ms:5.2f}x torch"
        )


if __name__ == "__main__":
    main()
