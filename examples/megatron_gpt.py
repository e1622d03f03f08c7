"""Pretrain a Megatron-Core GPTModel under leto-run (Megatron's model, Leto's retained state).

    leto-run --config configs/megatron_gpt.yaml
    leto-run --standalone --nproc-per-node 2 examples/megatron_gpt.py --num-layers 2 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 32 --micro-batch-size 4 --lr 3e-4 --train-iters 100

Argument names are Megatron's (``pretrain_gpt.py``). Data is synthetic, deterministic and
keyed by (seed, iteration, data-parallel rank): the data position is the step, so a
recovered run is bit-identical to a fault-free one. ``--tensor-model-parallel-size N``
shards the model over N ranks (the TP ranks of a data-parallel replica read the same
batch); gradients are averaged over the data-parallel group only. With no CUDA the documented
``torch.cuda`` shims (examples/megatron_cpu_shims.py) are installed first.

``--pipeline-model-parallel-size N`` splits the layers over N stages (no interleaving), each
stage retaining only its own parameters and Adam state; Megatron's 1F1B schedule
(``get_forward_backward_func``) runs ``--global-batch-size / (--micro-batch-size * DP)``
micro-batches per iteration, keyed by (seed, iteration, DP rank, micro-batch); with
``--share-embeddings-and-output-weights`` the first and last stage hold copies of the word
embedding whose gradients Megatron's ``finalize_model_grads`` sums (Megatron DDP required).
Micro-batches without pipelining (``--global-batch-size`` above micro * DP) run Megatron's
no-pipelining schedule; one micro-batch per iteration (the default) runs the plain
forward and backward.

Mixture of experts (``--num-experts N``): Megatron's local MoE layer in every layer (router,
``SequentialMLP`` experts, ``--moe-token-dispatcher-type alltoall`` by default, no token
dropping), ``--moe-router-topk`` experts per token, the load-balancing loss
(``--moe-router-load-balancing-type aux_loss``, ``--moe-aux-loss-coeff``), without linear
biases (``--disable-bias-linear``, required: Megatron's MoE recipes run without them).
``--expert-model-parallel-size E`` splits the experts over E ranks of the data-parallel
world (TP = PP = 1); the dense part stays data-parallel over the whole world, and Megatron's
DDP (required) reduces expert gradients over the expert-data-parallel group.

Data parallelism (``--ddp-impl``): ``megatron`` (the default) wraps the model in Megatron-Core's
``DistributedDataParallel``, whose contiguous gradient buffers are retained regions
("ddp.grads.float32", protected and read by the resumable updater) and whose bucketed
all-reduce (``finish_grad_sync``; with ``--overlap-grad-reduce`` launched from backward hooks,
buckets of ``--ddp-bucket-size`` elements) synchronises them; ``leto`` keeps Leto's own flat
"grads" region and one flat all-reduce. Both recover bit-exactly.
``--use-distributed-optimizer`` (with ``--ddp-impl megatron``) is Megatron's distributed
optimizer: gradients are reduce-scattered, each DP rank retains and updates only its shard of
the fp32 main params and Adam state, and the updated shards are all-gathered into Megatron's
contiguous parameter buffer ("ddp.params.float32") as part of the update.

``--bf16`` is Megatron's bf16 mixed precision as Leto retains it: parameters, gradients and
Adam state stay fp32 (Megatron's fp32 main params are here the model's own, retained), the
compute runs in bf16 (autocast). Under ``leto-run --deterministic`` (or ``--deterministic``
with ``--no-leto``) the kernels are deterministic (``torch.use_deterministic_algorithms``,
Megatron's ``deterministic_mode``), which a bit-exact comparison with a fault-free run needs
on a GPU; otherwise PyTorch's and Megatron's defaults.

Without Leto, for comparison: ``--no-leto`` under ``torchrun`` trains the same model with a
plain loop (torch AdamW, one flat all-reduce, clipping) and writes its iteration times to
--bench-out (JSON); ``--compare-baseline`` under leto-run interleaves such a copy step by
step with the Leto run in the same process and writes both medians to --bench-out.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import statistics
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

import torch
import torch.distributed as dist

import leto
from leto.events import Kind
from leto.integrations import megatron as lm


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="TP degree (no sequence parallelism); data parallelism is the rest of the world",
    )
    p.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="pipeline stages (1F1B, no interleaving; needs --ddp-impl megatron)",
    )
    p.add_argument(
        "--num-experts", type=int, default=None, help="MoE: experts per layer (default: dense MLP)"
    )
    p.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=1,
        help="EP degree: experts split over EP ranks of the data-parallel world (TP = PP = 1)",
    )
    p.add_argument("--moe-router-topk", type=int, default=2)
    p.add_argument(
        "--moe-token-dispatcher-type", choices=["alltoall", "allgather"], default="alltoall"
    )
    p.add_argument(
        "--moe-router-load-balancing-type",
        choices=["aux_loss", "seq_aux_loss", "none"],
        default="aux_loss",
    )
    p.add_argument("--moe-aux-loss-coeff", type=float, default=1e-2)
    p.add_argument(
        "--moe-ffn-hidden-size", type=int, default=None, help="default --ffn-hidden-size"
    )
    p.add_argument(
        "--disable-bias-linear",
        action="store_true",
        help="no biases in the linear layers (Megatron's MoE recipes; required with --num-experts)",
    )
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per iteration over all DP replicas (default micro-batch size * DP): "
        "micro-batches per iteration = global / (micro * DP)",
    )
    p.add_argument(
        "--share-embeddings-and-output-weights",
        action="store_true",
        help="tie the output layer to the word embedding (under pipeline parallelism: copies on the "
        "first and last stage, their gradients all-reduced)",
    )
    p.add_argument(
        "--ddp-impl",
        choices=["megatron", "leto"],
        default="megatron",
        help="data-parallel gradients: megatron = Megatron-Core's DistributedDataParallel with its "
        "grad buffers in retained regions (default); leto = Leto's flat grads region and all-reduce",
    )
    p.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="--ddp-impl megatron: Megatron's distributed optimizer (sharded main params and Adam "
        "state, reduce-scattered gradients, parameters all-gathered after the update)",
    )
    p.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="--ddp-impl megatron: launch each bucket's all-reduce from backward hooks",
    )
    p.add_argument(
        "--ddp-bucket-size",
        type=int,
        default=None,
        help="--ddp-impl megatron with --overlap-grad-reduce: elements per bucket "
        "(default Megatron's, max(4e7, 1e6 * DP))",
    )
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden size")
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--max-position-embeddings", type=int, default=None, help="default --seq-length")
    p.add_argument(
        "--vocab-size", type=int, default=256, help="synthetic data: the padded vocabulary size"
    )
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--min-lr", type=float, default=0.0)
    p.add_argument("--lr-warmup-iters", type=int, default=5)
    p.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine")
    p.add_argument("--lr-decay-iters", type=int, default=None, help="default --train-iters")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--adam-beta1", type=float, default=0.9)
    p.add_argument("--adam-beta2", type=float, default=0.999)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--hidden-dropout", type=float, default=0.1)
    p.add_argument("--attention-dropout", type=float, default=0.1)
    p.add_argument("--train-iters", type=int, default=100)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--bf16", action="store_true", help="bf16 compute over fp32 params and Adam state"
    )
    p.add_argument(
        "--fusions",
        action="store_true",
        help="Megatron's bias-GeLU and bias-dropout-add fusions (jit_fuser: torch.compile)",
    )
    p.add_argument(
        "--no-shadow-warm-up",
        action="store_true",
        help="shadows skip warming Megatron's first iteration (lm.warm_up_shadow)",
    )
    p.add_argument(
        "--parameters-out",
        default=None,
        help="rank 0 saves the final parameters here (torch.save, by name) for comparisons",
    )
    p.add_argument(
        "--no-leto", action="store_true", help="a plain loop without Leto (run under torchrun)"
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic kernels, as leto-run --deterministic gives a Leto run",
    )
    p.add_argument(
        "--compare-baseline", action="store_true", help="also train without Leto, same process"
    )
    p.add_argument(
        "--bench-out",
        default=None,
        help="with --no-leto or --compare-baseline: JSON of iteration times",
    )
    args = p.parse_args()
    for flag, value in (
        ("--train-iters", args.train_iters),
        ("--micro-batch-size", args.micro_batch_size),
    ):
        if value < 1:  # one line, as leto-run's errors (argparse's error adds the usage)
            p.exit(2, f"{p.prog}: error: {flag} must be >= 1, got {value}\n")
    return args


def transformer_config(args: argparse.Namespace):  # -> TransformerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    # fp32 params: they are Megatron's main params, retained; bf16 = autocast compute, and
    # Megatron's attention softmax returns bf16 probabilities. deterministic_mode: the
    # embedding's backward without atomics (F.embedding's is not deterministic on CUDA).
    return TransformerConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        pipeline_dtype=torch.float32,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        bf16=args.bf16,
        params_dtype=torch.float32,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_dropout_fusion=args.fusions,
        masked_softmax_fusion=False,
        bias_activation_fusion=args.fusions,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        deterministic_mode=deterministic(args),
        add_bias_linear=not args.disable_bias_linear,
        **moe_config(args),
    )


def moe_config(args: argparse.Namespace) -> dict:
    """Megatron's MoE settings: local experts (no grouped GEMM), no token dropping."""
    if not args.num_experts:
        return {}
    return {
        "num_moe_experts": args.num_experts,
        "expert_model_parallel_size": args.expert_model_parallel_size,
        "moe_router_topk": args.moe_router_topk,
        "moe_token_dispatcher_type": args.moe_token_dispatcher_type,
        "moe_router_load_balancing_type": args.moe_router_load_balancing_type,
        "moe_aux_loss_coeff": args.moe_aux_loss_coeff,
        "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
    }


def optimizer_config(args: argparse.Namespace):  # -> OptimizerConfig
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
    )


def ddp_config(args: argparse.Namespace):  # -> DistributedDataParallelConfig | None
    """Megatron's DDP settings for ``--ddp-impl megatron`` (no distributed optimizer); None for leto."""
    if args.ddp_impl != "megatron":
        return None
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(
        overlap_grad_reduce=args.overlap_grad_reduce,
        bucket_size=args.ddp_bucket_size,
        use_distributed_optimizer=args.use_distributed_optimizer,
    )


def lr_at(it: int, args: argparse.Namespace) -> float:
    """Megatron's warm-up then decay, as a function of the iteration (no scheduler state)."""
    if it < args.lr_warmup_iters:
        return args.lr * (it + 1) / args.lr_warmup_iters
    if args.lr_decay_style == "constant":
        return args.lr
    decay_iters = args.lr_decay_iters or args.train_iters
    progress = min(1.0, (it - args.lr_warmup_iters) / max(1, decay_iters - args.lr_warmup_iters))
    coeff = (
        0.5 * (1 + math.cos(math.pi * progress))
        if args.lr_decay_style == "cosine"
        else 1 - progress
    )
    return args.min_lr + coeff * (args.lr - args.min_lr)


def get_batch(
    it: int, dp_rank: int, args: argparse.Namespace, device: torch.device, microbatch: int = 0
) -> tuple[torch.Tensor, ...]:
    """Synthetic tokens keyed by (seed, iteration, data-parallel rank, micro-batch)."""
    g = torch.Generator().manual_seed(
        args.seed * 1_000_003 + it * 1009 + dp_rank + microbatch * 100_003
    )
    data = torch.randint(
        0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1), generator=g
    ).to(device)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    position_ids = torch.arange(args.seq_length, device=device).unsqueeze(0).expand_as(tokens)
    return tokens, position_ids, lm.causal_mask(args.seq_length, device), labels


def forward_loss(
    model: torch.nn.Module, batch: tuple[torch.Tensor, ...], bf16: bool
) -> torch.Tensor:
    tokens, position_ids, mask, labels = batch
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
        losses = model(tokens, position_ids, mask, labels=labels)  # per-token losses [b, s]
    return losses.float().mean()


def forward_step(args: argparse.Namespace):
    """Megatron's ``forward_step_func`` for its schedules: (per-token losses, loss function)."""

    def step(batches, model: torch.nn.Module):
        tokens, position_ids, mask, labels = next(batches)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            output = model(tokens, position_ids, mask, labels=labels)

        def loss_func(losses: torch.Tensor):
            loss = losses.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    return step


def num_microbatches(args: argparse.Namespace, dp: int) -> int:
    """Megatron's rule: global batch / (micro batch * DP), which must divide."""
    per_step = args.micro_batch_size * dp
    global_batch = args.global_batch_size or per_step
    if global_batch % per_step:
        raise SystemExit(
            f"megatron_gpt: --global-batch-size {global_batch} is not a multiple of "
            f"--micro-batch-size * DP = {per_step}"
        )
    return global_batch // per_step


def gpt_kwargs(args: argparse.Namespace) -> dict:
    return {"share_embeddings_and_output_weights": args.share_embeddings_and_output_weights}


def build(ctx: leto.Context, args: argparse.Namespace):
    return lm.build_gpt(
        ctx,
        transformer_config(args),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_position_embeddings or args.seq_length,
        **gpt_kwargs(args),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Rank:
    """What a loop without Leto needs to know of its rank (a ``leto.Context`` also has these)."""

    rank: int
    world_size: int
    device: torch.device


class Baseline:
    """The same model and step without Leto: torch AdamW, one flat all-reduce, clipping.

    ``isolated``: its steps are interleaved with Leto's (same process, same moment, same
    background load) and run inside ``fork_rng`` from a model seeded ``seed + 1``, so the Leto
    run draws exactly what it would draw alone. Otherwise (``--no-leto``) it is the plain
    run: seeded and stepped as the Leto run is, so its losses are the Leto run's bit for bit.
    """

    def __init__(
        self, ctx: Rank | leto.Context, args: argparse.Namespace, *, isolated: bool
    ) -> None:
        from megatron.core.models.gpt.gpt_model import GPTModel

        self.ctx, self.args, self.isolated = ctx, args, isolated
        with self._rng(), torch.device(ctx.device):
            torch.manual_seed(args.seed + 1 if isolated else args.seed)
            config = transformer_config(args)
            lm.check_moe(config)
            self.model = GPTModel(
                config=config,
                transformer_layer_spec=lm.local_layer_spec(config),
                vocab_size=args.vocab_size,
                max_sequence_length=args.max_position_embeddings or args.seq_length,
                **gpt_kwargs(args),
            )
        self.opt = lm.adamw(self.model, optimizer_config(args))
        self.params = [p for g in self.opt.param_groups for p in g["params"]]
        for p in self.params:
            p.grad = torch.zeros_like(p)

    def _rng(self) -> contextlib.AbstractContextManager:
        if not self.isolated:
            return contextlib.nullcontext()
        return torch.random.fork_rng(
            devices=[self.ctx.device] if self.ctx.device.type == "cuda" else []
        )

    def step(self, it: int) -> tuple[float, float]:
        """One iteration; returns (its wall time in seconds, the loss)."""
        ctx, args = self.ctx, self.args
        t0 = time.perf_counter()
        with self._rng():
            lm.reseed_tracker(args.seed, it)
            for group in self.opt.param_groups:
                group["lr"] = lr_at(it, args)
            self.opt.zero_grad(set_to_none=False)
            loss = forward_loss(self.model, get_batch(it, dp_rank(), args, ctx.device), args.bf16)
            loss.backward()
            grads = [p.grad for p in self.params]
            sync = lm.megatron_grad_sync()  # what Leto's step uses: the DP group, TP-aware clipping
            if sync.size() > 1:
                flat = torch._utils._flatten_dense_tensors(grads)
                sync.all_reduce_mean_(flat)
                for g, synced in zip(
                    grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
                ):
                    g.copy_(synced)
            sync.clip_(self.params, args.clip_grad)
            self.opt.step()
            loss_value = float(loss.detach())
            _sync(ctx.device)
        if self.isolated:
            lm.reseed_tracker(args.seed, it)  # the Leto step's tracker states, untouched by ours
        return time.perf_counter() - t0, loss_value


class FirstIteration:
    """Phase times of a promoted trainer's first iteration, and the ``torch.compile`` graphs
    it compiled (none when its shadow warmed up: ``lm.warm_up_shadow``)."""

    def __init__(self, ctx: leto.Context) -> None:
        from torch._dynamo.utils import counters

        self.ctx, self.counters = ctx, counters
        self.graphs = counters["stats"]["unique_graphs"]
        self.memory = self._memory()
        _sync(ctx.device)
        self.times = [("start", time.perf_counter())]

    def _memory(self) -> tuple[int, int, int]:
        """CUDA caching allocator: (segments allocated so far, bytes reserved, alloc retries)."""
        if self.ctx.device.type != "cuda":
            return (0, 0, 0)
        stats = torch.cuda.memory_stats(self.ctx.device)
        return (
            stats.get("segment.all.allocated", 0),
            stats.get("reserved_bytes.all.current", 0),
            stats.get("num_alloc_retries", 0),
        )

    def mark(self, phase: str) -> None:
        _sync(self.ctx.device)
        self.times.append((phase, time.perf_counter()))

    def report(self, step: int) -> None:
        phases = ", ".join(
            f"{name} {(t - prev) * 1e3:.0f} ms"
            for (_, prev), (name, t) in zip(self.times, self.times[1:], strict=False)
        )
        graphs = self.counters["stats"]["unique_graphs"] - self.graphs
        memory = ""
        if self.ctx.device.type == "cuda":
            (seg0, res0, retry0), (seg1, res1, retry1) = self.memory, self._memory()
            memory = (
                f"; cudaMalloc segments +{seg1 - seg0} (+{(res1 - res0) / 2**30:.2f} GiB reserved), "
                f"alloc retries +{retry1 - retry0}"
            )
        print(
            f"megatron_gpt: rank {self.ctx.rank} promoted, first iteration (step {step}): {phases}; "
            f"torch.compile graphs compiled {graphs}{memory}",
            flush=True,
        )
        # the same as an event: a log line can be lost in torch elastic's log tailing, an event cannot
        self.ctx.events.emit(
            Kind.FIRST_ITERATION,
            rank=self.ctx.rank,
            step=step,
            compiled_graphs=graphs,
            phases_s={
                name: t - prev
                for (_, prev), (name, t) in zip(self.times, self.times[1:], strict=False)
            },
        )


def dp_rank() -> int:
    """This rank's data-parallel rank: the TP ranks of one replica read the same batch."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def report_tied_embedding(model: torch.nn.Module) -> None:
    """First and last stage: a digest of their copy of the tied word embedding. Megatron's
    ``finalize_model_grads`` sums the two copies' gradients, so they stay bit-identical."""
    from megatron.core import parallel_state

    if not (parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()):
        return
    weight = model.shared_embedding_or_output_weight().detach().cpu().contiguous()
    digest = hashlib.blake2b(weight.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    print(f"megatron_gpt: rank {dist.get_rank()} tied embedding {digest}", flush=True)


def report_experts(ctx: leto.Context, model: torch.nn.Module, state) -> None:
    """MoE: the experts this rank holds (Megatron's ``local_expert_indices``, first MoE
    layer) and the retained gradient regions (under EP, the expert parameters' own)."""
    moe = next(m for m in model.modules() if hasattr(m, "local_expert_indices"))
    regions = [name for name, _ in state.state.layout.grad_regions]
    print(
        f"megatron_gpt: rank {ctx.rank} experts {list(moe.local_expert_indices)}, gradient regions {regions}",
        flush=True,
    )


def report_dense(model: torch.nn.Module) -> None:
    """MoE: a digest of the dense (non-expert) parameters, which every data-parallel rank
    holds: under EP they stay bit-identical only if every rank clipped by the same global
    norm (the expert norm summed over the expert-parallel group)."""
    dense = [
        p.detach().cpu().contiguous().view(torch.uint8).flatten()
        for p in model.parameters()
        if getattr(p, "allreduce", True)
    ]
    digest = hashlib.blake2b(torch.cat(dense).numpy().tobytes(), digest_size=16).hexdigest()
    print(f"megatron_gpt: rank {dist.get_rank()} dense parameters {digest}", flush=True)


def report_optimizer_state(ctx: leto.Context, model: torch.nn.Module, state) -> None:
    """Elements of retained Adam state (per moment) against the model's parameters: equal
    without the distributed optimizer, this rank's shard with it."""
    layout = state.state.layout
    moments = sum(math.prod(o["exp_avg"].shape) for o in layout.optim)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(
        f"megatron_gpt: rank {ctx.rank} optimizer state {moments} of {params} parameter elements",
        flush=True,
    )


def report_parameters(model: torch.nn.Module) -> None:
    """A digest of every parameter of the model as the forward reads it (with the
    distributed optimizer: Megatron's all-gathered ``param_data``)."""
    flat = [p.detach().cpu().contiguous().view(torch.uint8).flatten() for p in model.parameters()]
    digest = hashlib.blake2b(torch.cat(flat).numpy().tobytes(), digest_size=16).hexdigest()
    print(f"megatron_gpt: rank {dist.get_rank()} parameters {digest}", flush=True)


def deterministic(args: argparse.Namespace) -> bool:
    """Deterministic kernels: under ``leto-run --deterministic``, or ``--no-leto --deterministic``."""
    from leto import kernels

    return kernels.requested() or args.deterministic


def setup_torch(args: argparse.Namespace) -> None:
    """Deterministic kernels when asked (``deterministic``); the CPU shims without CUDA."""
    torch.set_num_threads(1)
    if torch.cuda.is_available():
        if deterministic(
            args
        ):  # leto.init() applies the same under leto-run (before cuBLAS first runs)
            from leto import kernels

            kernels.use_deterministic()
    else:  # no CUDA: Megatron-Core runs on CPU with the documented shims
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import megatron_cpu_shims

        megatron_cpu_shims.install()


def train_plain(args: argparse.Namespace) -> None:
    """``--no-leto``: the same training under plain torchrun (no retained state, no shadows)."""
    from megatron.core import parallel_state

    try:
        rank, world, local = (
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ["LOCAL_RANK"]),
        )
    except KeyError as e:
        raise SystemExit(f"--no-leto runs under torchrun: {e.args[0]} is not set") from None
    device, backend = torch.device("cpu"), "gloo"
    if torch.cuda.is_available():
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= torch.cuda.device_count():
            backend = "nccl"  # one GPU per rank; ranks sharing a GPU use gloo, as leto-run does
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    lm.reseed_tracker(args.seed, -1)  # as lm.init_parallel
    plain = Baseline(Rank(rank, world, device), args, isolated=False)
    iter_s, losses = [], []
    for it in range(args.train_iters):
        seconds, loss = plain.step(it)
        iter_s.append(seconds)
        losses.append(loss)
    if args.bench_out and rank == 0:
        with open(args.bench_out, "w") as f:
            json.dump({"iter_s": iter_s, "loss": losses}, f)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if args.ddp_impl != "megatron" and (
        args.overlap_grad_reduce or args.ddp_bucket_size is not None
    ):
        raise SystemExit(
            f"megatron_gpt: --overlap-grad-reduce and --ddp-bucket-size need --ddp-impl megatron "
            f"(got --ddp-impl {args.ddp_impl})"
        )
    if args.use_distributed_optimizer and args.ddp_impl != "megatron":
        raise SystemExit(
            f"megatron_gpt: --use-distributed-optimizer needs --ddp-impl megatron (got --ddp-impl "
            f"{args.ddp_impl}): the shards are Megatron DDP's buckets"
        )
    if args.use_distributed_optimizer and (
        args.pipeline_model_parallel_size > 1
        or args.num_experts
        or args.no_leto
        or args.compare_baseline
    ):
        raise SystemExit(
            "megatron_gpt: --use-distributed-optimizer runs without --pipeline-model-parallel-size, "
            "--num-experts, --no-leto and --compare-baseline"
        )
    if args.pipeline_model_parallel_size > 1 and args.ddp_impl != "megatron":
        raise SystemExit(
            "megatron_gpt: --pipeline-model-parallel-size needs --ddp-impl megatron "
            "(Megatron's finalize_model_grads all-reduces the shared embedding)"
        )
    if args.expert_model_parallel_size > 1 and not args.num_experts:
        raise SystemExit("megatron_gpt: --expert-model-parallel-size needs --num-experts")
    if args.num_experts and args.num_experts % args.expert_model_parallel_size:
        raise SystemExit(
            f"megatron_gpt: --num-experts {args.num_experts} is not a multiple of "
            f"--expert-model-parallel-size {args.expert_model_parallel_size}"
        )
    if args.expert_model_parallel_size > 1 and args.ddp_impl != "megatron":
        raise SystemExit(
            "megatron_gpt: --expert-model-parallel-size needs --ddp-impl megatron "
            "(expert gradients are reduced over the expert-data-parallel group)"
        )
    if (args.no_leto or args.compare_baseline) and args.expert_model_parallel_size > 1:
        raise SystemExit(
            "megatron_gpt: --no-leto and --compare-baseline reduce every gradient over the world "
            "(drop --expert-model-parallel-size)"
        )
    if (args.no_leto or args.compare_baseline) and (
        args.pipeline_model_parallel_size > 1 or args.global_batch_size
    ):
        raise SystemExit(
            "megatron_gpt: --no-leto and --compare-baseline run one micro-batch without pipelining "
            "(drop --pipeline-model-parallel-size and --global-batch-size)"
        )
    lm.require_megatron()
    setup_torch(args)
    if args.no_leto:
        train_plain(args)
        return

    ctx = leto.init()  # a shadow pre-initialises here; at L3 it waits for promotion in retain()
    if args.use_distributed_optimizer and ctx.env.consistency != "rmu":
        raise SystemExit(
            f"megatron_gpt: --use-distributed-optimizer needs leto consistency: rmu (got "
            f"{ctx.env.consistency}): the snapshot path steps torch's optimizer over full parameters"
        )
    parallel = lm.ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    # Megatron's parallel_state on Leto's group; a shadow below level 3 waits for promotion here
    dp = lm.init_parallel(ctx, seed=args.seed, parallel=parallel)
    microbatches = num_microbatches(args, dp)
    pp = parallel.pipeline_model_parallel_size
    if ctx.rank == 0 and not ctx.is_shadow:
        stages = f", PP {pp}" if pp > 1 else ""
        experts = f", EP {parallel.expert_model_parallel_size}" if args.num_experts else ""
        moe = (
            f"MoE {args.num_experts} experts top-{args.moe_router_topk} ({args.moe_token_dispatcher_type}), "
            if args.num_experts
            else ""
        )
        print(
            f"megatron_gpt: world {ctx.world_size} (TP {parallel.tensor_model_parallel_size}{stages}{experts}, "
            f"DP {dp}), {moe}"
            f"{microbatches} micro-batches per iteration, "
            f"backend {dist.get_backend()} on {ctx.device}, DDP {args.ddp_impl}"
            f"{' (overlap)' if args.overlap_grad_reduce else ''}"
            f"{', distributed optimizer' if args.use_distributed_optimizer else ''}",
            flush=True,
        )
    torch.manual_seed(args.seed)
    model = build(ctx, args)  # on meta when this trainer will reattach
    opt = lm.adamw(model, optimizer_config(args))
    if (
        not args.no_shadow_warm_up
    ):  # a shadow runs a throwaway layer of this job now; an active: no-op
        lm.warm_up_shadow(
            ctx,
            transformer_config(args),
            vocab_size=args.vocab_size,
            max_sequence_length=args.max_position_embeddings or args.seq_length,
            micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length,
            loss_fn=lambda m: forward_loss(m, get_batch(0, dp_rank(), args, ctx.device), args.bf16),
            **gpt_kwargs(args),
        )
    state = lm.retain_megatron(
        ctx, model, opt, seed=args.seed, max_grad_norm=args.clip_grad, ddp_config=ddp_config(args)
    )
    if args.num_experts and not ctx.is_shadow:
        report_experts(ctx, model, state)
    report_optimizer_state(ctx, model, state)  # (a shadow gets here once promoted)
    net = state.model  # Megatron's DDP wrapper (--ddp-impl megatron), or the model
    baseline = Baseline(ctx, args, isolated=True) if args.compare_baseline else None
    base_s: list[float] = []
    loop_s: list[float] = []  # whole loop iteration: Leto's step bookkeeping included
    top = None
    first = (
        FirstIteration(ctx) if ctx.promoted_at is not None else None
    )  # a promoted shadow's, reported
    for it in state.steps(args.train_iters):
        now = time.perf_counter()
        if top is not None:
            loop_s.append(now - top)
        top = now
        if baseline is not None:
            base_s.append(baseline.step(it)[0])
        for group in state.optimizer.param_groups:  # the retained optimizer (a shard, distributed)
            group["lr"] = lr_at(it, args)
        if pp > 1 or microbatches > 1:  # Megatron's schedule: 1F1B over the stages, or accumulation
            batches = [get_batch(it, dp_rank(), args, ctx.device, m) for m in range(microbatches)]
            loss = state.forward_backward(
                forward_step(args),
                batches,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
            )
            state.step(loss=loss)
            if first:
                first.mark("forward+backward+update")
                first.report(it)
                first = None
            continue
        batch = get_batch(it, dp_rank(), args, ctx.device)

        def compute(
            batch: tuple[torch.Tensor, ...] = batch, first: FirstIteration | None = first
        ) -> torch.Tensor:
            loss = forward_loss(net, batch, args.bf16)
            if first:
                first.mark("forward")
            loss.backward()
            if first:
                first.mark("backward")
            return loss

        loss = state.compute(
            compute
        )  # an OOM here reclaims the shadows and re-runs it (leto.preinit)
        state.step(loss=loss)
        _sync(ctx.device)
        if first:
            first.mark("update")
            first.report(it)
            first = None
    if pp > 1 and args.share_embeddings_and_output_weights:
        report_tied_embedding(model)
    if args.num_experts:
        report_dense(model)
    report_parameters(model)
    if args.parameters_out and ctx.rank == 0:
        torch.save(
            {n: p.detach().cpu().clone() for n, p in model.named_parameters()}, args.parameters_out
        )
    if baseline is not None and args.bench_out and ctx.rank == 0 and top is not None:
        loop_s.append(time.perf_counter() - top)
        skip = len(loop_s) // 5  # warm-up, and the shadows' start-up load
        leto_s = [total - b for total, b in zip(loop_s[skip:], base_s[skip:], strict=True)]
        out = {
            "baseline_iter_s": statistics.median(base_s[skip:]),
            "leto_iter_s": statistics.median(leto_s),
            "iters_measured": len(leto_s),
        }
        with open(args.bench_out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
