"""The first fused RMU updates of a fresh process, after a shadow's kernel warm-up, by part.

What a promoted trainer's first update pays that a steady one does not: the updater's
construction (chunk plan, piece tables, gap indices, pinned scalars) and each part of the
first updates, synchronised (``begin``: the step's scalars; ``gaps``: the gathered gap
save; ``kernel``: one fused launch per chunk; ``rest``: step counters, marker, flush). A
Llama-shaped parameter set (two AdamW groups, ``fused=True``), float32 state on one GPU.

    python bench/first_update_gpu.py [--dim 2048 --layers 14 --vocab 32000] [--no-warm-up]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from leto.preinit import warmup
from leto.updater import fused as fused_mod
from tests.updater.rig import Rig, no_faults

CHUNK = 256 << 20


def llama_params(vocab: int, dim: int, layers: int, mlp: int, kv: int) -> nn.Module:
    shapes = [(vocab, dim)]
    for _ in range(layers):
        shapes += [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (mlp, dim), (mlp, dim), (dim, mlp)]
        shapes += [(dim,), (dim,)]
    shapes += [(dim,), (vocab, dim)]
    net = nn.Module()
    net.ps = nn.ParameterList(nn.Parameter(torch.randn(s) * 0.02) for s in shapes)
    return net


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-warm-up", action="store_true")
    p.add_argument(
        "--device", default="cuda", help="cpu: a check of the bench (TRITON_INTERPRET=1)"
    )
    args = p.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    net = llama_params(args.vocab, args.dim, args.layers, 5632 * args.dim // 2048, args.dim // 2)
    rig = Rig.build(
        net, erasure=None, chunk_bytes=CHUNK, fused=True, device=args.device, optimizer=optimizer
    )
    rig.grads[: rig.grads.numel() // 4 * 4].view(torch.float32).normal_(0, 1e-3)
    n = sum(p.numel() for p in net.parameters())
    print(f"{len(rig.layout.params)} parameters, {n / 1e9:.3f} G elements")
    if not args.no_warm_up:
        t0 = time.perf_counter()
        target = warmup.WarmupTarget.plan(
            device=dev,
            layout=rig.layout,
            optimizer=rig.opt,
            erasure=None,
            rmu=True,
            chunk_bytes=CHUNK,
            fused=True,
        )
        report = warmup.warm_up(target)
        print(f"warm-up {1e3 * (time.perf_counter() - t0):.1f} ms: {report.calls}")

    parts: dict[str, float] = defaultdict(float)

    def timed(name: str, fn):
        def run(*a, **k):
            sync()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            sync()
            parts[name] += 1e3 * (time.perf_counter() - t0)
            return out

        return run

    fc = fused_mod.FusedChunks
    fc.begin = timed("begin", fc.begin)  # type: ignore[method-assign]
    fc.save_gaps = timed("gaps", fc.save_gaps)  # type: ignore[method-assign]
    fc.apply = timed("kernel", fc.apply)  # type: ignore[method-assign]
    sync()
    t0 = time.perf_counter()
    up = rig.updater(no_faults())
    sync()
    print(f"updater built in {1e3 * (time.perf_counter() - t0):.1f} ms, {len(up.chunks)} chunks")
    for step in range(args.steps):
        rig.grads_ready(1e-4)
        parts.clear()
        sync()
        t0 = time.perf_counter()
        up.run(step)
        sync()
        total = 1e3 * (time.perf_counter() - t0)
        rest = total - sum(parts.values())
        shown = ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
        print(f"update {step}: {total:.1f} ms ({shown}, rest {rest:.1f})")


if __name__ == "__main__":
    main()
