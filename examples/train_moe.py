"""Train the demo GPT with mixture-of-experts MLPs, routed top-1 as Hugging Face's Mixtral
block does: a loop over the experts that skips one no token was routed to.

    leto-run --nproc-per-node 2 examples/train_moe.py --steps 40

With few tokens per step, some experts get none on a rank, and some on every rank: their
parameters have no gradient that step, and torch's AdamW (after ``zero_grad()``, which
leaves such a ``.grad`` None) leaves them alone: no weight decay, no moment decay, no step
count. Leto's update skips them the same way, also when it finishes an update a failure
interrupted (``leto.retained.presence``). ``--plain`` runs the same loop without Leto
(under torchrun), for the comparison.

``--fp16`` trains under float16 autocast with its dynamic loss scale
(``torch.amp.GradScaler``): the script scales its loss in ``compute`` and hands the scaler
to ``ctx.retain``; ``state.step()`` unscales, skips a step whose gradients overflowed (the
first steps' do, until the scale has backed off) and updates the scale, as torch's
``scaler.step`` and ``scaler.update`` do.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from train_gpt import GPT, batch

import leto


class TopOneMoE(nn.Module):
    """``experts`` two-layer MLPs; each token goes to its router's top expert, scaled by the
    router's probability."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(experts)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(flat), dim=-1)
        weight, choice = probs.max(dim=-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            (rows,) = torch.nonzero(choice == e, as_tuple=True)
            if rows.numel() == 0:  # no token: the expert is not in this step's graph
                continue
            routed = expert(flat[rows]) * weight[rows, None]
            out = out.index_add(0, rows, routed.to(out.dtype))  # fp16 under autocast
        return out.reshape(x.shape)


def build(args: argparse.Namespace) -> GPT:
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq, args.dropout)
    for block in model.blocks:
        block.mlp = TopOneMoE(args.dim, args.experts)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    for name, default in (("vocab", 256), ("dim", 32), ("layers", 2), ("heads", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--seq", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--plain", action="store_true", help="torch alone (run it under torchrun)")
    p.add_argument("--fp16", action="store_true", help="float16 autocast and a GradScaler")
    p.add_argument("--init-scale", type=float, default=2.0**16, help="the GradScaler's first scale")
    p.add_argument("--growth-interval", type=int, default=2000, help="the GradScaler's")
    args = p.parse_args()
    if args.steps < 1:
        p.exit(2, f"{p.prog}: error: --steps must be >= 1, got {args.steps}\n")
    torch.set_num_threads(1)
    if args.plain:
        plain(args)
        return

    ctx = leto.init()
    torch.manual_seed(args.seed)
    with ctx.init_device(ctx.device):
        model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scaler = grad_scaler(args, ctx.device)
    state = ctx.retain(model, opt, scaler=scaler)
    for step in state.steps(args.steps):
        x, y = batch(step, ctx.rank, args, ctx.device)

        def compute(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            with torch.autocast(ctx.device.type, torch.float16, enabled=args.fp16):
                loss = model(x, y)
            (loss if scaler is None else scaler.scale(loss)).backward()
            return loss

        loss = state.compute(compute)
        state.step(max_grad_norm=1.0, loss=loss)
    print(f"rank {ctx.rank} parameters |sum| {digest(model)!r}")


def grad_scaler(
    args: argparse.Namespace, device: torch.device | str
) -> torch.amp.GradScaler | None:
    if not args.fp16:
        return None
    return torch.amp.GradScaler(
        torch.device(device).type, init_scale=args.init_scale, growth_interval=args.growth_interval
    )


def digest(model: nn.Module) -> float:
    """What both runs print at the end (equal when they trained alike)."""
    return sum(float(p.detach().double().abs().sum()) for p in model.parameters())


def plain(args: argparse.Namespace) -> None:
    """The same job with torch alone: DDP leaves an expert that no rank's tokens reached
    without a gradient, and AdamW skips it."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(args.seed)
    model = build(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    scaler = grad_scaler(args, "cpu")
    rank = dist.get_rank()
    for step in range(args.steps):
        x, y = batch(step, rank, args, "cpu")
        opt.zero_grad()
        with torch.autocast("cpu", torch.float16, enabled=args.fp16):
            loss = ddp(x, y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    print(f"rank {rank} parameters |sum| {digest(model)!r}")
    # both ranks tear gloo down together: without it a rank aborted at exit now and then
    # ("terminate called without an active exception", gloo's teardown)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
