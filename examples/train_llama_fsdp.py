"""Train a Llama-style model (RMSNorm, rotary attention, SwiGLU) with FSDP2 under leto-run.

    leto-run --nproc-per-node 2 examples/train_llama_fsdp.py --steps 40
    torchrun --nproc-per-node 2 examples/train_llama_fsdp.py --plain --steps 40

The model is built on the meta device, ``fully_shard`` is applied per block and at the
root (torchtitan's recipe), and only a fresh start materialises and initialises it; a
promoted trainer's shards are retained memory. ``--plain`` runs the same model and steps
with torch alone (``torchrun``'s baseline: ``zero_grad``, ``backward``, clipping,
``optimizer.step``). Data is synthetic tokens keyed by (step, rank).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from train_gpt import to_device

import leto


def rotary(seq: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """cos/sin of the rotary embedding, (seq, head_dim / 2, 2)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim)."""
    xr = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[..., 0], rope[..., 1]
    out = torch.stack(
        (xr[..., 0] * cos - xr[..., 1] * sin, xr[..., 0] * sin + xr[..., 1] * cos), dim=-1
    )
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = apply_rotary(q, rope[:t]), apply_rotary(k, rope[:t])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = SwiGLU(dim, hidden)
        self.drop_mlp = False
        """Skip the MLP this step (LayerDrop with a schedule every rank shares): its
        parameters get no gradient on any rank, and torch's optimizer leaves them alone."""

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x if self.drop_mlp else x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        hidden = 256 * ((int(8 * dim / 3) + 255) // 256)  # Llama's SwiGLU width, rounded
        self.tok = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.seq, self.head_dim = seq, dim // heads
        self.register_buffer("rope", rotary(seq, self.head_dim), persistent=False)

    def init_weights(self) -> None:
        """After ``to_empty``: every parameter and the rotary buffer (torchtitan's recipe)."""
        with torch.no_grad():
            self.rope.copy_(rotary(self.seq, self.head_dim))
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    nn.init.trunc_normal_(m.weight, std=0.02)
                elif isinstance(m, nn.Embedding):
                    nn.init.normal_(m.weight, std=0.02)
                elif isinstance(m, nn.RMSNorm):
                    m.reset_parameters()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x, self.rope)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch(
    step: int, rank: int, args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    data = to_device(torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g), device)
    return data[:, :-1], data[:, 1:]


def build(args: argparse.Namespace, device: torch.device, world: int) -> nn.Module:
    """The model on ``meta``, sharded per block and at the root over a 1-D mesh."""
    with torch.device("meta"):
        model = Llama(args.vocab, args.dim, args.layers, args.heads, args.seq)
    mesh = init_device_mesh(device.type, (world,))
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.bf16
        else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        if args.compile:  # torchtitan's order: compile each block, then shard it
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=args.reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=args.reshard)
    return model


def materialise(model: nn.Module, device: torch.device, seed: int) -> None:
    torch.manual_seed(seed)
    model.to_empty(device=device)
    model.init_weights()


def optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """Over the trainable parameters (``--frozen-embedding`` leaves the embedding out, or
    with ``--frozen-in-optimizer`` in, where AdamW skips it: it never has a gradient)."""
    if args.frozen_embedding:
        model.tok.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad or args.frozen_in_optimizer]
    if args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=args.lr, momentum=0.9)
    fused = {"fused": True} if args.fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1, **fused)


def layer_drop(model: nn.Module, step: int, args: argparse.Namespace) -> None:
    k = args.drop_mlp_every
    model.blocks[0].drop_mlp = k > 0 and step % k == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
    )
    p.add_argument("--reshard", action="store_true", help="fully_shard(reshard_after_forward=True)")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True) (GPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument(
        "--frozen-embedding",
        action="store_true",
        help="the token embedding frozen, outside the optimizer (as a fine-tuning job keeps it)",
    )
    p.add_argument(
        "--frozen-in-optimizer",
        action="store_true",
        help="with --frozen-embedding: the optimizer holds the frozen embedding too",
    )
    p.add_argument(
        "--drop-mlp-every",
        type=int,
        default=0,
        metavar="K",
        help="skip the first block's MLP at every K-th step (0, K, 2K, ...): its parameters "
        "get no gradient on any rank in those steps",
    )
    p.add_argument("--plain", action="store_true", help="torch alone (run under torchrun)")
    args = p.parse_args()
    if args.steps < 1:
        p.exit(2, f"{p.prog}: error: --steps must be >= 1, got {args.steps}\n")
    if args.drop_mlp_every < 0:
        p.exit(2, f"{p.prog}: error: --drop-mlp-every must be >= 0, got {args.drop_mlp_every}\n")
    torch.set_num_threads(1)
    if args.plain:
        plain(args)
        return

    ctx = leto.init()  # a shadow pre-initialises here; it waits for promotion in retain()
    model = build(args, ctx.device, ctx.world_size)
    if not ctx.resuming:  # a promoted trainer's shards are retained: nothing to initialise
        materialise(model, ctx.device, args.seed)
    opt = optimizer(model, args)
    state = ctx.retain(model, opt)
    for step in state.steps(args.steps):
        x, y = batch(step, ctx.rank, args, ctx.device)
        layer_drop(model, step, args)

        def compute(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            loss = model(x, y)
            loss.backward()
            return loss

        loss = state.compute(compute)
        state.step(max_grad_norm=1.0, loss=loss)


def plain(args: argparse.Namespace) -> None:
    """The same training under torch alone; prints the mean step time after warm-up."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = device or torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args, device, world)
    materialise(model, device, args.seed)
    opt = optimizer(model, args)
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = batch(step, rank, args, device)
        layer_drop(model, step, args)
        opt.zero_grad()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    skip = min(5, len(times) - 1)
    if rank == 0:
        print(
            f"plain fsdp2: {args.steps} steps, mean step {1e3 * sum(times[skip:]) / len(times[skip:]):.1f} ms, "
            f"last loss {float(loss)!r}",
            flush=True,
        )
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
