"""Fine-tune the demo GPT with LoRA adapters: the base model frozen, only the adapters trained.

    leto-run --nproc-per-node 2 examples/finetune_lora.py --steps 40

The base's parameters (``requires_grad=False``, tied embedding and output head as in GPT-2)
are outside the optimizer; Leto retains them with the rest of the model, so a promoted
trainer, which builds its model on the meta device, finds them as they were. The adapters
are in two parameter groups (no weight decay on the ``B`` matrices), under a OneCycleLR
schedule, with two micro-batches of gradient accumulation per step.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from train_gpt import GPT, batch

import leto


class LoRALinear(nn.Module):
    """``base(x) + x A^T B^T * scale``: ``base`` frozen, ``A`` and ``B`` trained (B starts at 0)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base, self.scale = base, alpha / rank
        self.a = nn.Parameter(torch.randn(rank, base.in_features) / base.in_features**0.5)
        self.b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b) * self.scale


def build(args: argparse.Namespace) -> GPT:
    """The base model (seeded: every rank and every shadow builds the same), frozen, with
    adapters on each block's MLP."""
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq, args.dropout)
    model.head.weight = model.tok.weight  # tied, as GPT-2
    model.requires_grad_(False)
    for block in model.blocks:
        block.mlp[0] = LoRALinear(block.mlp[0], args.rank, args.alpha)
        block.mlp[2] = LoRALinear(block.mlp[2], args.rank, args.alpha)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    for name, default in (("vocab", 256), ("dim", 64), ("layers", 4), ("heads", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rank", type=int, default=4, help="the adapters' rank")
    p.add_argument("--alpha", type=float, default=8.0)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    if args.steps < 1:
        p.exit(2, f"{p.prog}: error: --steps must be >= 1, got {args.steps}\n")
    torch.set_num_threads(1)

    ctx = leto.init()
    torch.manual_seed(args.seed)
    with ctx.init_device(ctx.device):
        model = build(args)
    adapters = {n: q for n, q in model.named_parameters() if q.requires_grad}
    opt = torch.optim.AdamW(
        [
            {"params": [q for n, q in adapters.items() if n.endswith(".a")], "weight_decay": 0.01},
            {"params": [q for n, q in adapters.items() if n.endswith(".b")], "weight_decay": 0.0},
        ],
        lr=args.lr,
    )
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps)
    state = ctx.retain(model, opt)
    for step in state.steps(args.steps):

        def compute(step: int = step) -> torch.Tensor:
            total = torch.zeros((), device=ctx.device)
            for micro in range(2):
                x, y = batch(2 * step + micro, ctx.rank, args, ctx.device)
                loss = model(x, y) / 2
                loss.backward()
                total += loss.detach()
            return total

        loss = state.compute(compute)
        state.step(max_grad_norm=1.0, loss=loss)
        schedule.step()


if __name__ == "__main__":
    main()
