"""Train a Hugging Face ``LlamaForCausalLM`` (``transformers``) under leto-run, the way an HF
script does: ``model(input_ids=..., labels=...).loss``, ``get_cosine_schedule_with_warmup``.

    leto-run --nproc-per-node 2 examples/train_hf_llama.py --steps 40
    torchrun --nproc-per-node 2 examples/train_hf_llama.py --plain --steps 40

The model is the real ``transformers`` class built from a ``LlamaConfig`` (grouped-query
attention, rotary embeddings with their ``inv_freq`` buffers, SwiGLU, RMSNorm, SDPA
attention); a promoted trainer builds it on ``meta`` and reattaches to the retained
weights. The LR schedule is transformers' own ``LambdaLR``, stepped after
``state.step()`` and found by Leto on the optimizer. ``--plain`` runs the same model and
steps with torch alone (DDP over the ranks; what torchrun's baseline runs), writing the
same step events when ``LETO_EVENTS_FILE`` is set. Data is synthetic tokens keyed by
(step, rank); the sizes are the flags (the defaults: a tiny model for CPU).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from train_gpt import to_device
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

import leto


def llama_config(args: argparse.Namespace) -> LlamaConfig:
    """The model's ``LlamaConfig`` from the size flags (``--kv-heads``/``--ffn`` 0: derived)."""
    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=args.ffn or 4 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or max(1, args.heads // 2),
        max_position_embeddings=args.seq,
        attention_dropout=args.dropout,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )


def build(args: argparse.Namespace) -> LlamaForCausalLM:
    """The model on the current default device (``meta`` inside ``ctx.init_device`` when
    reattaching), initialised by transformers from ``--seed``."""
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(llama_config(args))


def batch(
    step: int, rank: int, args: argparse.Namespace, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic synthetic tokens: the data position is the step itself. ``labels`` are
    the inputs (transformers shifts them)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    ids = to_device(torch.randint(0, args.vocab, (args.batch, args.seq), generator=g), device)
    return ids, ids


def loss_of(
    model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, bf16: bool
) -> torch.Tensor:
    """The forward pass as an HF script writes it."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        return model(input_ids=ids, labels=labels).loss


def optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW as HF's Trainer builds it (no weight decay on norms), fused on a GPU."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    impl = {"fused": True} if args.fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), **impl)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """The Llama-only size flags (examples/torchrun_gpt_ckpt.py declares the same two for ``--arch hf-llama``, without importing transformers for the GPT)."""
    p.add_argument("--kv-heads", type=int, default=0, help="0: half the heads")
    p.add_argument("--ffn", type=int, default=0, help="MLP width (0: 4 x dim)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast compute (fp32 weights)")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True) (default on a GPU)")
    p.add_argument("--plain", action="store_true", help="torch alone (run under torchrun)")
    add_model_flags(p)
    args = p.parse_args()
    if args.steps < 1:  # one line, as leto-run's errors (argparse's error adds the usage)
        p.exit(2, f"{p.prog}: error: --steps must be >= 1, got {args.steps}\n")
    torch.set_num_threads(1)
    args.fused = args.fused or torch.cuda.is_available()
    if args.plain:
        plain(args)
        return
    ctx = leto.init()  # a shadow pre-initialises here; it waits for promotion in retain()
    with ctx.init_device(ctx.device):
        model = build(args)
    opt = optimizer(model, args)
    state = ctx.retain(model, opt)
    schedule = get_cosine_schedule_with_warmup(opt, args.warmup, args.steps)
    for step in state.steps(args.steps):
        ids, labels = batch(step, ctx.rank, args, ctx.device)

        def compute(ids: torch.Tensor = ids, labels: torch.Tensor = labels) -> torch.Tensor:
            loss = loss_of(model, ids, labels, args.bf16)
            loss.backward()
            return loss

        loss = state.compute(compute)
        state.step(max_grad_norm=1.0, loss=loss)
        schedule.step()


def plain(args: argparse.Namespace) -> None:
    """The same training under torch alone (DDP when there are several ranks)."""
    from leto.events import EventLog, Kind
    from leto.trainer.timing import PhaseTimes

    cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if cuda:
        device = torch.device(
            "cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        )
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    events = EventLog.from_env(f"trainer{rank}")
    with device:
        model = build(args)
    opt = optimizer(model, args)
    schedule = get_cosine_schedule_with_warmup(opt, args.warmup, args.steps)
    trained = model if world == 1 else torch.nn.parallel.DistributedDataParallel(model)
    for step in range(args.steps):
        began = time.perf_counter()
        phases = PhaseTimes(device, began)
        ids, labels = batch(step, rank, args, device)
        opt.zero_grad()  # torch's default, set_to_none=True: what a careful user runs
        loss = loss_of(trained, ids, labels, args.bf16)
        loss.backward()
        phases.mark("compute")
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        phases.mark("clip")
        opt.step()
        schedule.step()
        if cuda:
            torch.cuda.synchronize(device)
        phases.mark("update")
        events.emit(
            Kind.STEP_DONE,
            rank=rank,
            step=step,
            iter_s=time.perf_counter() - began,
            loss=float(loss),
            **phases.fields(),
        )
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # torch 2.13's gloo can abort in C++ static teardown after a clean run


if __name__ == "__main__":
    main()
