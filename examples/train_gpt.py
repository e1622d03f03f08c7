"""Train a tiny GPT with the leto API (the demo's script; 2 ranks on CPU with gloo).

    leto-run --nproc-per-node 2 examples/train_gpt.py --steps 40

Data is deterministic synthetic tokens keyed by (step, rank), dropout draws from the
global RNG (which leto retains), so a run with failures is bit-identical to one without.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import leto


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float, bias: bool = True) -> None:
        super().__init__()
        self.ln1, self.ln2 = (
            nn.LayerNorm(dim, elementwise_affine=bias),
            nn.LayerNorm(dim, elementwise_affine=bias),
        )
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, bias=bias, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim, bias=bias),
            nn.GELU(),
            nn.Linear(4 * dim, dim, bias=bias),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab: int,
        dim: int,
        layers: int,
        heads: int,
        seq: int,
        dropout: float,
        bias: bool = True,
    ) -> None:
        """``bias=False``: matrices only (no biases, no LayerNorm affine), for Muon."""
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout, bias) for _ in range(layers))
        self.ln, self.head = (
            nn.LayerNorm(dim, elementwise_affine=bias),
            nn.Linear(dim, vocab, bias=False),
        )
        self.register_buffer(
            "mask", torch.triu(torch.full((seq, seq), float("-inf")), 1), persistent=False
        )

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x, self.mask[:t, :t])
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


OPTIMIZERS = {
    # fused=True: what a careful user runs (torch's fused kernel on CPU, Leto's on CUDA)
    "adamw": lambda m, lr: torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.1, fused=True),
    "sgd": lambda m, lr: torch.optim.SGD(
        m.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=0.01
    ),
    "rmsprop": lambda m, lr: torch.optim.RMSprop(
        m.parameters(), lr=lr, momentum=0.9, centered=True, weight_decay=0.01
    ),
    "nadam": lambda m, lr: torch.optim.NAdam(m.parameters(), lr=lr, weight_decay=0.01),
    "adam-amsgrad": lambda m, lr: torch.optim.Adam(
        m.parameters(), lr=lr, amsgrad=True, weight_decay=0.01
    ),
    # matrices only: the model is built without vectors (no biases, no LayerNorm affine)
    "muon": lambda m, lr: torch.optim.Muon(m.parameters(), lr=lr),
    "muon+adamw": lambda m, lr: muon_and_adamw(m, lr),
}
"""``--optimizer`` choices: any torch.optim optimizer is retained (leto.retained.optim_state)."""


def muon_and_adamw(model: GPT, lr: float) -> leto.ChainedOptimizer:
    """Muon for the blocks' matrices, AdamW for embeddings, head, biases and norms (Muon takes
    2-D parameters only, and is not meant for embeddings), chained into one optimizer."""
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return leto.ChainedOptimizer(
        [
            torch.optim.Muon(hidden, lr=lr),
            torch.optim.AdamW(rest, lr=lr, weight_decay=0.1, fused=True),
        ]
    )


def batch(
    step: int, rank: int, args: argparse.Namespace, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic tokens: the data position is the step itself."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    data = to_device(torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g), device)
    return data[:, :-1], data[:, 1:]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``; onto a GPU from page-locked memory without waiting for the device
    (what a ``DataLoader(pin_memory=True)`` and a ``non_blocking`` copy do): a copy from
    pageable memory would wait for every kernel queued before it, every step."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up then cosine decay (the paper's Appendix A.1 schedule)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class ActivationBallast:
    """GPU memory-pressure demo (``--oom-ballast-step``): at one step, a transient activation
    held through forward and backward that fits only without the shadows' footprint.

    First attempt (once the shadows are ready and hold their memory): the free memory plus
    ``--oom-ballast-over-mib``, so it cannot be allocated. The retry, after the reclaim:
    at least as much, and all but 1 GiB of what is free then, so that the shadows cannot
    come back at their old level whatever their size. The ballast is never read: the
    step's arithmetic is the same with or without it.
    """

    def __init__(self, ctx: leto.Context, args: argparse.Namespace) -> None:
        self.ctx, self.step, self.over_bytes = (
            ctx,
            args.oom_ballast_step,
            args.oom_ballast_over_mib << 20,
        )
        self.enabled = self.step >= 0 and ctx.device.type == "cuda"
        self.free_with_shadows: int | None = None

    def hold(self, step: int) -> torch.Tensor | None:
        if not self.enabled or step != self.step:
            return None
        if self.free_with_shadows is None:
            deadline = time.monotonic() + 300
            while not self.ctx.preinit.shadow_ready() and time.monotonic() < deadline:
                if self.ctx.heartbeat is not None:
                    self.ctx.heartbeat.beat()  # waiting on purpose, not hung
                time.sleep(0.05)
            torch.cuda.empty_cache()  # cached blocks would otherwise serve part of it
            free = self.free_with_shadows = torch.cuda.mem_get_info(self.ctx.device)[0]
            nbytes = free + self.over_bytes
        else:
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(self.ctx.device)[0]
            nbytes = max(self.free_with_shadows + self.over_bytes, free - (1 << 30))
        print(
            f"[rank {self.ctx.rank} step {step}] ballast {nbytes >> 20} MiB, free {free >> 20} MiB, "
            f"shadows ready: {self.ctx.preinit.shadow_ready()}",
            file=sys.stderr,
            flush=True,
        )
        return torch.empty(nbytes, dtype=torch.uint8, device=self.ctx.device)


def forward_backward(
    model: GPT,
    x: torch.Tensor,
    y: torch.Tensor,
    ballast: torch.Tensor | None,
    args: argparse.Namespace,
) -> torch.Tensor:
    """One micro-batch's forward and backward; its loss, scaled by ``1/--grad-accum``."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=args.bf16):
        loss = model(x, y)
    if args.grad_accum > 1:
        loss = loss / args.grad_accum
    loss.backward()
    return loss.detach()  # the graph goes now, not with the step's last micro-batch


def data_steps(step: int, args: argparse.Namespace) -> range:
    """The data positions of step ``step``'s micro-batches (``--grad-accum``)."""
    return range(step * args.grad_accum, (step + 1) * args.grad_accum)


def step_loss(losses: list[torch.Tensor]) -> torch.Tensor:
    """The step's loss from its micro-batches' (scaled) losses: the one itself, or their sum."""
    return losses[0] if len(losses) == 1 else torch.stack(losses).sum()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per step, their gradients summed before one update (the loss "
        "of each scaled by 1/N)",
    )
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--bf16", action="store_true", help="bf16 autocast compute (fp32 master weights)"
    )
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw")
    p.add_argument(
        "--compile",
        nargs="?",
        const="blocks",
        choices=("blocks", "model"),
        help="torch.compile each block (torchtitan's way; the default), or the model whole",
    )
    p.add_argument(
        "--oom-ballast-step",
        type=int,
        default=-1,
        metavar="STEP",
        help="GPU: at STEP, hold a transient activation of the free memory plus "
        "--oom-ballast-over-mib (it fits only once the shadows are reclaimed)",
    )
    p.add_argument(
        "--oom-ballast-over-mib",
        type=int,
        default=256,
        metavar="MIB",
        help="how far the ballast exceeds the free memory (less than the shadows' footprint)",
    )
    args = p.parse_args()
    for flag, value in (("--steps", args.steps), ("--grad-accum", args.grad_accum)):
        if value < 1:  # one line, as leto-run's errors (argparse's error adds the usage)
            p.exit(2, f"{p.prog}: error: {flag} must be >= 1, got {value}\n")
    torch.set_num_threads(1)

    ctx = leto.init()  # a shadow pre-initialises here; it waits for promotion in retain()
    torch.manual_seed(args.seed)
    with ctx.init_device(ctx.device):
        model = GPT(
            args.vocab,
            args.dim,
            args.layers,
            args.heads,
            args.seq,
            args.dropout,
            bias=args.optimizer != "muon",
        )
    opt = OPTIMIZERS[args.optimizer](model, args.lr)
    if args.compile == "blocks":
        for block in model.blocks:
            block.compile()
    elif args.compile == "model":
        model = torch.compile(model)
    state = ctx.retain(model, opt)
    ballast = ActivationBallast(ctx, args)
    for step in state.steps(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        micro = [
            batch(micro_step, ctx.rank, args, ctx.device) for micro_step in data_steps(step, args)
        ]

        def compute(step: int = step, micro: list = micro) -> torch.Tensor:
            held = ballast.hold(step)
            return step_loss([forward_backward(model, x, y, held, args) for x, y in micro])

        loss = state.compute(compute)
        state.step(max_grad_norm=1.0, loss=loss)


if __name__ == "__main__":
    main()
