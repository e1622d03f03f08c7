"""Megatron-Core on Leto: a ``GPTModel`` whose whole training state lives in retained memory.

Design (built): **Megatron's model and DDP, Leto's retained state.** Megatron-Core supplies
the model (``TransformerConfig``, ``GPTModel`` and its layer specs, its process-group setup)
and, optionally, its ``DistributedDataParallel``; Leto's ``RetainedState`` owns the layout —
parameters, gradients (Leto's "grads" region, or DDP's buffers as retained regions), AdamW
state and RNG as zero-copy views of pool regions, protected by the two-tier parity and
updated through the resumable updater (RMU).
Megatron's optimizer settings (``OptimizerConfig``: lr, betas, eps, weight decay, clipping)
map onto a torch ``AdamW`` with Megatron's parameter groups (no decay on biases and norms),
which is what Megatron itself runs when neither Apex nor Transformer Engine is present.

* **Tensor parallelism.** Megatron builds each rank's shard of the model from
  ``parallel_state``; the retained layout is simply the parameters this rank holds.
  ``init_parallel`` points Leto's gradient seam (``Context.grad_sync``) at Megatron's
  data-parallel group and at ``clip_grads_model_parallel`` (Megatron's global-norm rule:
  squares summed over the model-parallel group, TP-duplicated parameters counted once).
  Without sequence parallelism the duplicated parameters (norms, row-parallel biases,
  position embeddings) get identical gradients on every TP rank, so nothing else is
  reduced across TP. Sequence parallelism is refused (its norm gradients need a TP
  all-reduce, and gloo has no reduce-scatter for the CPU tests).
* **Meta-device build.** A reattaching trainer (every shadow) builds the model on ``meta``
  (``build_gpt``): Megatron must then take its CPU-initialisation path, which allocates on
  the default device, so ``use_cpu_initialization`` is forced on — Megatron's GPU path
  passes ``device=torch.cuda.current_device()`` explicitly and would allocate real memory
  under a meta context. Initialisation stays on (free on meta): Megatron sets a weight's
  ``tensor_model_parallel`` attribute only inside its initialisers, and a shadow without it
  would count its sharded weights as TP duplicates in the clipping norm.
* **Parameter attributes.** Megatron tags parameters (``tensor_model_parallel``,
  ``partition_dim``, ``sequence_parallel``, ``shared_embedding``, ...);
  ``torch.utils.swap_tensors`` moves ``__dict__`` with the swap, so ``retain_megatron``
  puts them back on the retained parameters (the clipping rule reads them).
* **RNG.** Leto retains torch's default generators. Megatron's ``CudaRNGStatesTracker``
  holds further states (tensor-parallel dropout, expert-parallel) in a Python dict, lost
  with the process. ``MegatronState`` reseeds every tracked state at the start of each step
  from ``(seed, step, name, tp/ep ranks)``: a re-run step draws the same masks, and there is
  nothing extra to retain. (Dropout streams differ from stock Megatron's, not in law.)

* **Megatron's DDP** (``retain_megatron(..., ddp_config=...)``): its contiguous gradient
  buffers are retained regions and its bucketed all-reduce replaces Leto's
  (``leto.integrations.megatron_ddp``); without ``ddp_config``, Leto's flat "grads"
  region and all-reduce.

* **Pipeline parallelism** (1F1B, one chunk per stage): each stage builds (``build_gpt``:
  ``pre_process``/``post_process`` per stage) and retains only its own layers; Megatron's
  schedule runs in the compute phase (``MegatronState.forward_backward``); Megatron's
  ``finalize_model_grads`` (DDP all-reduce, then the tied embedding's over the first/last
  stage) is the gradient reduction (``pipeline_grad_sync``); the clipping norm's
  model-parallel group already spans the stages.

* **Mixture of experts, expert parallelism** (``num_moe_experts``; EP > 1 with TP = PP = 1):
  Megatron's local MoE layer (``get_gpt_layer_local_spec(num_experts=...)``: router,
  ``SequentialMLP`` experts, the all-to-all token dispatcher, no token dropping). Each
  rank retains its ``num_experts / EP`` experts. Expert parameters (``allreduce=False``)
  get their own retained gradient region in Megatron's DDP, whose bucket all-reduce runs
  over the expert-data-parallel group with Megatron's ``1/DP`` pre-scaling; the clipping
  norm is Megatron's ``ChainedOptimizer`` rule: the dense norm over the model-parallel
  group, the expert norm over the expert-tensor-model-pipeline group, combined as the
  root of their squares (``clip_grads_model_parallel``). The dispatcher's all-to-alls run
  in the compute phase (read-only retained state): a kill mid-dispatch re-runs the step.

* **Distributed optimizer** (``DistributedDataParallelConfig(use_distributed_optimizer=True)``):
  each DP rank retains and updates only its shard of main params and Adam state; Megatron's
  full parameter buffer is all-gathered after each update (``leto.integrations.megatron_distopt``).

Not built (see docs/MEGATRON.md for what each needs): sequence parallelism, interleaved (virtual)
pipeline stages, context parallelism, expert parallelism combined with TP or PP (expert
tensor parallelism), grouped-GEMM experts (``ParallelConfig``/``build_gpt`` refuse them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from leto.errors import ConfigError
from leto.retained.layout import Layout
from leto.trainer.grad_sync import GradSync

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from leto.preinit.model_warmup import ModelWarmupResult
    from leto.trainer.context import Context
    from leto.trainer.state import RetainedState

logger = logging.getLogger(__name__)

T = TypeVar("T")

MEGATRON_VERSION = "0.16.1"
"""The megatron-core release this integration is written and tested against."""


def require_megatron() -> str:
    """Import megatron.core or say how to install it; returns its version."""
    try:
        import megatron.core
    except ImportError:
        raise ConfigError(
            f"the Megatron integration needs megatron-core: pip install 'leto[megatron]' "
            f"(megatron-core=={MEGATRON_VERSION})"
        ) from None
    version = getattr(megatron.core, "__version__", "unknown")
    if version != MEGATRON_VERSION:
        logger.warning("megatron-core %s; leto is tested against %s", version, MEGATRON_VERSION)
    return version


@dataclasses.dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Megatron's model-parallel sizes; data parallelism is whatever the world leaves.

    Tensor and pipeline parallelism (one model chunk per stage: no virtual stages), and
    expert parallelism on its own (TP = PP = 1; the experts split over EP ranks of the
    data-parallel world) are supported; context parallelism is not yet."""

    tensor_model_parallel_size: int = 1
    """Megatron's --tensor-model-parallel-size."""
    pipeline_model_parallel_size: int = 1
    """Megatron's --pipeline-model-parallel-size."""
    context_parallel_size: int = 1
    """Megatron's --context-parallel-size."""
    expert_model_parallel_size: int = 1
    """Megatron's --expert-model-parallel-size."""

    def __post_init__(self) -> None:
        sizes = dataclasses.asdict(self)
        bad = {k: v for k, v in sizes.items() if v < 1}
        if bad:
            raise ConfigError(f"parallel sizes must be >= 1: {bad}")
        supported = (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "expert_model_parallel_size",
        )
        unsupported = {k: v for k, v in sizes.items() if v != 1 and k not in supported}
        if unsupported:
            raise ConfigError(
                f"leto's Megatron integration runs tensor, pipeline, expert and data parallelism only, got "
                f"{unsupported}: context parallelism needs what docs/MEGATRON.md describes"
            )
        if self.expert_model_parallel_size > 1 and (
            self.tensor_model_parallel_size > 1 or self.pipeline_model_parallel_size > 1
        ):
            raise ConfigError(
                "expert_model_parallel_size > 1 runs with TP = PP = 1 only: expert tensor parallelism "
                "and MoE pipelines are not verified (docs/MEGATRON.md)"
            )

    def data_parallel_size(self, world_size: int) -> int:
        model = (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )
        if world_size % model:
            raise ConfigError(f"world size {world_size} is not a multiple of TP*PP*CP = {model}")
        dp = world_size // model
        if dp % self.expert_model_parallel_size:
            raise ConfigError(
                f"data-parallel size {dp} is not a multiple of "
                f"expert_model_parallel_size {self.expert_model_parallel_size}"
            )
        return dp


def init_parallel(ctx: Context, *, seed: int, parallel: ParallelConfig | None = None) -> int:
    """Megatron's ``parallel_state`` on Leto's process group; returns the data-parallel size.

    Call right after ``leto.init()``, before building the model. Megatron builds its model
    from ``parallel_state``, so it needs the process group first. A shadow at level 3 (the
    default) has it before promotion: ``initialize_model_parallel`` runs now, its
    ``new_group`` calls under its generation's store prefix, apart from the actives' groups.
    A shadow at level 1 or 2 (configured, or lowered by the pre-initialisation controller
    after an OOM reclaim) has no group: it waits for promotion here
    (``Context.wait_for_promotion``), so Megatron's groups, the model on ``meta`` and the
    optimizer are built at promotion. Under model parallelism ``ctx.grad_sync`` becomes
    Megatron's data-parallel group and clipping rule (``megatron_grad_sync``). The RNG
    tracker is seeded for model construction (``reseed_tracker(seed, -1)``).
    """
    require_megatron()
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel = parallel or ParallelConfig()
    dp = parallel.data_parallel_size(ctx.world_size)
    if not dist.is_initialized():
        if not ctx.is_shadow:
            raise ConfigError(
                "lm.init_parallel needs leto.init()'s process group: call leto.init() first"
            )
        logger.info(
            "[rank %d] shadow at level %d: Megatron's groups and model are built at promotion",
            ctx.rank,
            ctx.env.shadow_level,
        )
        ctx.wait_for_promotion()  # builds the world group
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
        )
    ctx.grad_sync = megatron_grad_sync()
    reseed_tracker(seed, -1)
    return dp


def megatron_grad_sync() -> GradSync:
    """Leto's gradient seam for Megatron's ``parallel_state`` (initialised).

    Pure data parallelism keeps Leto's default (the world, torch's clipping); under model
    or expert parallelism gradients are averaged over the data-parallel group (Megatron's
    DDP reduces expert gradients over the expert-data-parallel group) and clipped by
    ``clip_grads_model_parallel``.
    """
    from megatron.core import parallel_state

    if (
        parallel_state.get_model_parallel_group().size() == 1
        and parallel_state.get_expert_model_parallel_world_size() == 1
    ):
        return GradSync()
    return GradSync(group=parallel_state.get_data_parallel_group(), clip=clip_grads_model_parallel)


def clip_grads_model_parallel(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Megatron's global-norm clipping for a non-distributed optimizer; returns the norm.

    The norm is over the whole model: squared shard norms summed over the model-parallel
    group, counting a parameter that every TP rank holds whole (no ``tensor_model_parallel``
    attribute: norms, row-parallel biases) on TP rank 0 only, and a shared one once
    (``megatron.core.optimizer.clip_grads`` with its parameter filter, whose helpers
    allocate on ``"cuda"`` by name and so do not run on CPU). Same coefficient rule:
    ``max_norm / (norm + 1e-6)``, applied when below 1.

    With expert parameters (``allreduce=False``) this is Megatron's ``ChainedOptimizer``:
    ``get_megatron_optimizer`` gives them their own optimizer whose norm group is the
    expert-tensor-model-pipeline group (the EP ranks, each holding other experts), the
    dense optimizer's is the model-parallel group, and the two differ, so the global norm
    is ``sqrt(dense_norm² + expert_norm²)``; every parameter is clipped by it.
    """
    from megatron.core import parallel_state

    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad for p in with_grad]
    dense = [p for p in with_grad if getattr(p, "allreduce", True)]
    experts = [p for p in with_grad if not getattr(p, "allreduce", True)]
    device = grads[0].device
    norm = _group_norm(dense, parallel_state.get_model_parallel_group(), device)
    if experts:
        expert_norm = _group_norm(
            experts, parallel_state.get_expert_tensor_model_pipeline_parallel_group(), device
        )
        norm = torch.stack([norm, expert_norm]).square().sum().sqrt()
    coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coeff)
    return norm


def _group_norm(params: list[torch.nn.Parameter], group: Any, device: torch.device) -> torch.Tensor:
    """Megatron's ``get_grad_norm_fp32`` over ``group`` with its optimizer's parameter filter
    (not shared, not a TP duplicate): local squares summed over the group, then the root."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    counted = [
        p.grad
        for p in params
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
    ]
    if counted:
        squares = torch.stack([n.float() for n in torch._foreach_norm(counted)]).square().sum()
    else:
        squares = torch.zeros((), dtype=torch.float32, device=device)
    torch.distributed.all_reduce(squares, group=group)
    return squares.sqrt()


def meta_config(config: TransformerConfig) -> TransformerConfig:
    """The config to build on ``meta``: the CPU-init path, which allocates on the default device.

    ``perform_initialization`` must stay on: Megatron tags sharded weights
    (``tensor_model_parallel``, ``partition_dim``) inside its initialisers only."""
    return dataclasses.replace(config, use_cpu_initialization=True, perform_initialization=True)


def build_gpt(
    ctx: Context,
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    layer_spec: Any = None,
    **gpt_kwargs: Any,
) -> GPTModel:
    """A ``GPTModel`` on ``ctx.device``, or on ``meta`` when the trainer will reattach.

    Under pipeline parallelism this rank's stage: ``pre_process`` (embedding) on the first
    stage, ``post_process`` (final norm, output layer, loss) on the last, unless given. On
    ``meta`` the first/last-stage all-reduce that copies the first stage's word embedding
    into the last stage's tied output weight is skipped (``_no_embedding_sync``): a meta
    tensor has no data, and the retained weights replace both copies."""
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    if config.sequence_parallel:
        raise ConfigError(
            "sequence_parallel=True: its norm gradients need a TP all-reduce that leto does not "
            "run yet (docs/MEGATRON.md); turn sequence parallelism off"
        )
    if config.virtual_pipeline_model_parallel_size is not None:
        raise ConfigError(
            "virtual_pipeline_model_parallel_size: the interleaved schedule (model chunks) is not "
            "supported; leto runs one chunk per stage (docs/MEGATRON.md)"
        )
    check_moe(config)
    if config.pipeline_model_parallel_size > 1:
        gpt_kwargs.setdefault("pre_process", parallel_state.is_pipeline_first_stage())
        gpt_kwargs.setdefault("post_process", parallel_state.is_pipeline_last_stage())
    spec = layer_spec or local_layer_spec(config)
    with ctx.init_device(ctx.device) as device:
        on_meta = device.type == "meta"
        cfg = meta_config(config) if on_meta else config
        with _no_embedding_sync() if on_meta else contextlib.nullcontext():
            return GPTModel(
                config=cfg,
                transformer_layer_spec=spec,
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                **gpt_kwargs,
            )


def local_layer_spec(config: TransformerConfig) -> Any:
    """Megatron's local (no Transformer Engine) layer spec; with ``num_moe_experts``, its MoE
    layer (router, ``SequentialMLP`` experts)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if not config.num_moe_experts:
        return get_gpt_layer_local_spec()
    return get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)


def check_moe(config: TransformerConfig) -> None:
    """Refuse the MoE settings leto does not run (one-line ``ConfigError``s), and let
    Megatron's router run without Transformer Engine.

    megatron-core 0.16.1's ``RouterGatingLinearFunction`` reads ``te_general_gemm``, a name
    ``moe_utils`` binds only when Transformer Engine imports; without it the router raises
    ``NameError``. The name is bound to None here, which is the fallback the function
    tests for (a plain ``torch.matmul``).

    The router's gating runs outside autocast (``--bf16`` is autocast over fp32 parameters
    here): its autograd function casts to its own ``router_dtype`` in the forward but not in
    the backward, so an autocast forward leaves a bf16 gradient against an fp32 weight
    (``expected mat1 and mat2 to have the same dtype``, seen on an H200 at EP = 2). Outside
    autocast the logits are computed in the dtype of the router's input, fp32 here: what
    Megatron's ``--moe-router-dtype fp32`` recommends for the router anyway."""
    if not config.num_moe_experts:
        return
    if config.moe_grouped_gemm:
        raise ConfigError(
            "moe_grouped_gemm=True: grouped-GEMM experts (TEGroupedMLP / GroupedMLP) are not "
            "supported; leto runs Megatron's local SequentialMLP experts"
        )
    if config.moe_token_dispatcher_type not in ("alltoall", "allgather"):
        raise ConfigError(
            f"moe_token_dispatcher_type={config.moe_token_dispatcher_type!r}: leto runs the "
            "'alltoall' and 'allgather' dispatchers only"
        )
    if config.add_bias_linear:
        raise ConfigError(
            "MoE with add_bias_linear=True: megatron-core 0.16.1's expert MLP adds its fc2 bias in "
            "place into a view returned by its TP reduction (autograd refuses it at EP = 1); run "
            "without linear biases, as Megatron's MoE recipes do (--disable-bias-linear)"
        )
    if config.moe_expert_capacity_factor is not None:
        raise ConfigError(
            "moe_expert_capacity_factor: token dropping is not verified under leto; leave it unset "
            "(no dropping, Megatron's default)"
        )
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core.transformer.moe import router

    if not getattr(router.router_gating_linear, "_leto_outside_autocast", False):
        router.router_gating_linear = _outside_autocast(router.router_gating_linear)


def _outside_autocast(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(fn)
    def gating(inp: torch.Tensor, *args: Any) -> torch.Tensor:
        with torch.autocast(inp.device.type, enabled=False):
            return fn(inp, *args)

    gating._leto_outside_autocast = True  # type: ignore[attr-defined]
    return gating


@contextlib.contextmanager
def _no_embedding_sync() -> Iterator[None]:
    """``LanguageModule.setup_embeddings_and_output_layer`` without its first/last-stage
    all-reduce of the tied word embedding (``_is_in_embd_group`` answers False): the
    attributes (``shared``, ``shared_embedding``) are still set. For ``meta`` builds only;
    every stage's reattaching trainer skips it alike, so no peer waits in it."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule._is_in_embd_group
    LanguageModule._is_in_embd_group = lambda self: False
    try:
        yield
    finally:
        LanguageModule._is_in_embd_group = original


def warm_up_shadow(
    ctx: Context,
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    loss_fn: Callable[[GPTModel], torch.Tensor],
    micro_batch_size: int,
    seq_length: int,
    num_layers: int = 1,
    layer_spec: Any = None,
    **gpt_kwargs: Any,
) -> ModelWarmupResult | None:
    """In a shadow at level 3: one forward and backward of a throwaway ``GPTModel`` with the
    job's config cut to ``num_layers`` layers, on ``ctx.device``, so that what Megatron's
    first iteration pays (``jit_fuser`` compilations for these shapes and dtypes, cuBLAS's
    GEMM choices, kernel loading) is paid before any failure. A no-op in an active.

    ``loss_fn(model)`` runs the job's forward on its real batch shape and returns the loss
    (the script's own, so autocast and the loss are the job's). Call it before ``retain``:
    nothing retained is mapped then. Megatron's RNG tracker is restored afterwards and its
    global attention buffer dropped (``leto.preinit.model_warmup`` says what else is respected).

    Under pipeline parallelism every stage's shadow warms a whole one-layer model
    (``pipeline_model_parallel_size=1`` in the cut config: embedding, a layer, output layer
    and loss, a superset of any stage's kernels, with no p2p and no embedding all-reduce);
    its estimate counts the embedding and logits on every stage, so it errs high.
    """
    from leto.preinit.model_warmup import warm_model

    if not ctx.is_shadow:
        return None
    cut = dataclasses.replace(
        config, num_layers=min(num_layers, config.num_layers), pipeline_model_parallel_size=1
    )
    transient = warmup_bytes(
        cut,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        micro_batch_size=micro_batch_size,
        seq_length=seq_length,
    )
    return warm_model(
        ctx.shadow_site(),
        lambda: run_throwaway(
            ctx.device,
            cut,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            loss_fn=loss_fn,
            layer_spec=layer_spec,
            **gpt_kwargs,
        ),
        name="megatron",
        transient_bytes=transient,
        agree=_agree_over_model_parallel(ctx),
    )


def _agree_over_model_parallel(ctx: Context) -> Callable[[bool], bool] | None:
    """Under model parallelism the throwaway forward runs TP collectives, under expert
    parallelism the dispatcher's all-to-alls: all shadows of a model-parallel (or, with
    TP = PP = 1, expert-model-parallel) group warm up, or none (one MIN all-reduce over
    the shadows' group)."""
    from megatron.core import parallel_state

    group = parallel_state.get_model_parallel_group()
    if group.size() == 1:
        group = parallel_state.get_expert_model_parallel_group()
    if group.size() == 1:
        return None

    def agree(go: bool) -> bool:
        flag = torch.tensor([int(go)], dtype=torch.int32, device=ctx.collective_device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
        return bool(flag.item())

    return agree


def run_throwaway(
    device: torch.device,
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    loss_fn: Callable[[GPTModel], torch.Tensor],
    layer_spec: Any = None,
    **gpt_kwargs: Any,
) -> None:
    """One forward and backward of a fresh ``GPTModel(config)`` on ``device``, then dropped.

    Megatron's RNG tracker and its MoE aux-loss tracker are restored afterwards and its global
    attention buffer emptied; the caller forks torch's RNG if it must not move (``warm_model``
    does). The aux-loss tracker matters: Megatron sizes each loss's per-layer values by the
    ``num_layers`` of the first model that logged it, so a one-layer throwaway left in it
    breaks the job's own MoE forward after a promotion."""
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    check_moe(config)
    tracker = get_cuda_rng_tracker()
    states = dict(tracker.get_states())
    aux_losses = get_moe_layer_wise_logging_tracker()
    logged = {
        name: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
        for name, entry in aux_losses.items()
    }
    try:
        with torch.device(device):
            model = GPTModel(
                config=config,
                transformer_layer_spec=layer_spec or local_layer_spec(config),
                vocab_size=vocab_size,
                max_sequence_length=max_sequence_length,
                **gpt_kwargs,
            )
        loss_fn(model).backward()
    finally:
        tracker.set_states(states)
        aux_losses.clear()
        aux_losses.update(logged)
        parallel_state.get_global_memory_buffer().buffer.clear()


def warmup_bytes(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    micro_batch_size: int,
    seq_length: int,
) -> int:
    """Device memory of ``warm_up_shadow`` at its peak, estimated with margin (25 %).

    Parameters and gradients of the cut model, activations per layer after Korthikanti et
    al. (34sbh + 5as²b bytes at 16 bits, scaled to the compute dtype), the logits with their
    fp32 copy and gradient; plus 64 MiB that do not scale with the model (cuBLAS workspaces
    of a first GEMM kind, compiled kernels' scratch)."""
    tp = config.tensor_model_parallel_size
    h, ffn, heads = config.hidden_size, config.ffn_hidden_size, config.num_attention_heads
    s, b = seq_length, micro_batch_size
    param_b = torch.empty((), dtype=config.params_dtype).element_size()
    act_b = 2 if (config.bf16 or config.fp16) else 4
    experts = (
        config.num_moe_experts or 1
    ) // config.expert_model_parallel_size  # this rank's experts
    per_layer = (4 * h * h + 2 * h * ffn * experts) // tp + 13 * h
    params = vocab_size // tp * h + max_sequence_length * h + config.num_layers * per_layer + 2 * h
    layer_act = act_b * s * b * h * 17 + act_b * 5 * heads // tp * s * s * b // 2
    logits = s * b * vocab_size // tp * (act_b + 8)
    return int(1.25 * (2 * param_b * params + config.num_layers * layer_act + logits)) + (64 << 20)


def adamw(model: torch.nn.Module, opt: OptimizerConfig) -> torch.optim.AdamW:
    """Megatron's Adam settings on torch's (foreach) AdamW, with Megatron's decay groups."""
    if opt.optimizer != "adam":
        raise ConfigError(
            f"leto retains Adam state; OptimizerConfig.optimizer={opt.optimizer!r} is not supported"
        )
    if opt.use_distributed_optimizer:
        raise ConfigError(
            "OptimizerConfig.use_distributed_optimizer: build the full AdamW here; Megatron's "
            "DistributedOptimizer sharding comes from lm.retain_megatron(ddp_config="
            "DistributedDataParallelConfig(use_distributed_optimizer=True))"
        )
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": opt.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=opt.lr,
        betas=(opt.adam_beta1, opt.adam_beta2),
        eps=opt.adam_eps,
        foreach=True,
    )


def plan(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> Layout:
    """The retained layout ``retain_megatron`` will allocate (works on a meta-device model)."""
    from leto.trainer.rng import rng_blob

    params = [p for g in optimizer.param_groups for p in g["params"]]
    return Layout.plan(params, list(model.buffers()), optimizer, rng_bytes=rng_blob(device).numel())


def retain_megatron(
    ctx: Context,
    model: GPTModel,
    optimizer: torch.optim.AdamW,
    *,
    seed: int,
    max_grad_norm: float | None = None,
    ddp_config: DistributedDataParallelConfig | None = None,
) -> MegatronState:
    """``ctx.retain`` for a Megatron model: attributes kept, tracker RNG keyed by step.

    With ``ddp_config`` the model is wrapped in Megatron's ``DistributedDataParallel``
    whose gradient buffers are retained regions (``leto.integrations.megatron_ddp``);
    run the forward through ``MegatronState.model`` (the wrapper). Without it, gradients
    are Leto's "grads" region, synchronised by Leto's flat all-reduce.

    Under pipeline parallelism Megatron's DDP is required: the gradient reduction is then
    Megatron's ``finalize_model_grads`` (``pipeline_grad_sync``), run by ``step()`` where
    Megatron's schedule would run it; ``MegatronState.forward_backward`` runs the schedule."""
    from megatron.core import parallel_state

    from leto.integrations import megatron_ddp

    pipeline = parallel_state.get_pipeline_model_parallel_world_size() > 1
    if pipeline and ddp_config is None:
        raise ConfigError(
            "pipeline parallelism needs Megatron's DDP (ddp_config; the example's --ddp-impl megatron): "
            "the shared embedding's gradient is all-reduced by Megatron's finalize_model_grads"
        )
    experts = parallel_state.get_expert_model_parallel_world_size() > 1
    if experts and ddp_config is None:
        raise ConfigError(
            "expert parallelism needs Megatron's DDP (ddp_config; the example's --ddp-impl megatron): "
            "expert gradients are reduced over the expert-data-parallel group, not the data-parallel one"
        )
    if ddp_config is not None and ddp_config.use_distributed_optimizer:
        return _retain_sharded(
            ctx, model, optimizer, seed=seed, max_grad_norm=max_grad_norm, ddp_config=ddp_config
        )
    attrs = {id(p): dict(vars(p)) for p in model.parameters()}
    params = list(model.parameters())
    grads = None
    if ddp_config is not None:
        opt_params = [p for g in optimizer.param_groups for p in g["params"]]
        grads = megatron_ddp.grad_placement(model, opt_params, ddp_config)
    state = ctx.retain(model, optimizer, grads=grads)
    for p in params:
        for key, value in attrs[id(p)].items():
            setattr(p, key, value)
    wrapped: torch.nn.Module = model
    if ddp_config is not None:
        wrapped = megatron_ddp.build_ddp(ctx, state, model, ddp_config)
    if pipeline:
        pipeline_grad_sync(ctx, wrapped)
    return MegatronState(state, seed=seed, max_grad_norm=max_grad_norm, model=wrapped)


def _retain_sharded(
    ctx: Context,
    model: GPTModel,
    optimizer: torch.optim.AdamW,
    *,
    seed: int,
    max_grad_norm: float | None,
    ddp_config: DistributedDataParallelConfig,
) -> MegatronState:
    """``retain_megatron`` with Megatron's distributed optimizer (``megatron_distopt``): the
    retained optimizer is ``optimizer``'s shard on this DP rank (``MegatronState.optimizer``);
    the model's parameters are Megatron's ``param_data``, a retained mirror region."""
    from megatron.core import parallel_state

    from leto.integrations import megatron_distopt

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ConfigError(
            "the distributed optimizer runs without pipeline parallelism for now (docs/MEGATRON.md)"
        )
    from leto.trainer.context import _checkpoint_from_env

    if _checkpoint_from_env() is not None:
        raise ConfigError(
            "leto.checkpoint with the distributed optimizer: the per-rank shards have no "
            "torch.distributed.checkpoint layout yet (docs/MEGATRON.md); drop leto.checkpoint"
        )
    params = [p for g in optimizer.param_groups for p in g["params"]]
    plan = megatron_distopt.plan_shards(
        model,
        params,
        ddp_config,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
    )
    mains = megatron_distopt.main_params(params, plan)
    shard_opt = megatron_distopt.shard_optimizer(optimizer, mains, plan)
    attrs = [dict(vars(params[piece.param])) for piece in plan.pieces]
    state = ctx.retain(model, shard_opt, grads=plan.grad_placement, mirror=plan.mirror)
    for main, kept in zip(
        mains, attrs, strict=True
    ):  # Megatron's attributes: the clipping filter reads them
        for key, value in kept.items():
            setattr(main, key, value)
    ddp = megatron_distopt.build_ddp(ctx, state, model, ddp_config, plan, params)
    return MegatronState(state, seed=seed, max_grad_norm=max_grad_norm, model=ddp)


def pipeline_grad_sync(ctx: Context, ddp: torch.nn.Module) -> None:
    """Megatron's gradient finalisation for a pipeline stage, as ``ctx.grad_sync.reduce``.

    ``finalize_model_grads([ddp])``, Megatron's own: the DDP bucket all-reduce over the
    data-parallel group, then the tied word embedding's gradient summed over the embedding
    group (first and last stage). Megatron's schedule calls it at its end
    (``config.finalize_model_grads_func``); here that hook is left unset and
    ``RetainedState.step`` calls it after the "sync" fault point, before clipping and
    ``GRADS_READY``, as for DP. The schedule's DDP hooks are Megatron's ``training.py``
    settings: ``no_sync_func`` (and ``grad_sync_func`` when ``align_grad_reduce``) with
    ``overlap_grad_reduce``."""
    import functools

    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    config = ddp.config
    config.finalize_model_grads_func = None
    if ddp.ddp_config.overlap_grad_reduce:
        config.no_sync_func = ddp.no_sync
        if ddp.ddp_config.align_grad_reduce:
            config.grad_sync_func = ddp.start_grad_sync
    ctx.grad_sync = dataclasses.replace(
        ctx.grad_sync, reduce=functools.partial(finalize_model_grads, [ddp])
    )


@dataclasses.dataclass(slots=True)
class MegatronState:
    """``RetainedState`` plus Megatron's per-step RNG tracker seeding."""

    state: RetainedState
    seed: int
    max_grad_norm: float | None = None
    model: torch.nn.Module | None = None
    """What the forward runs: Megatron's ``DistributedDataParallel`` wrapper, or the model."""
    _step: int = dataclasses.field(default=-1, init=False)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The retained optimizer: the job's AdamW, or with the distributed optimizer its
        shard on this rank (set learning rates here)."""
        return self.state.optimizer

    def steps(self, total: int) -> Iterator[int]:
        for step in self.state.steps(total):
            self._step = step
            reseed_tracker(self.seed, step)
            yield step

    def compute(self, fn: Callable[[], T]) -> T:
        """``RetainedState.compute`` (forward and backward; an OOM reclaims the shadows and
        re-runs them), with the tracker reseeded for each attempt: a retried step draws the
        same dropout masks."""

        def attempt() -> T:
            reseed_tracker(self.seed, self._step)
            return fn()

        return self.state.compute(attempt)

    def step(self, loss: torch.Tensor | None = None) -> torch.Tensor | None:
        """``RetainedState.step`` with Megatron's clipping; returns the gradients' total norm
        before clipping (what Megatron logs as ``grad norm``), or None without clipping."""
        return self.state.step(max_grad_norm=self.max_grad_norm, loss=loss)

    def forward_backward(
        self,
        forward_step_func: Callable,
        batches: Sequence[Any],
        *,
        seq_length: int,
        micro_batch_size: int,
    ) -> torch.Tensor | None:
        """Megatron's schedule (``get_forward_backward_func``: 1F1B across stages, or
        micro-batch accumulation without pipelining) over ``MegatronState.model``, one
        micro-batch per element of ``batches``, inside ``compute`` (a retry starts from the
        first micro-batch again); returns the mean of the micro-batches' ``"lm loss"`` on the last stage,
        None on the others. ``forward_step_func(data_iterator, model)`` returns Megatron's
        ``(output_tensor, loss_func)``; ``loss_func`` returns ``(loss, {"lm loss": loss})``
        (the schedule divides the loss by ``num_microbatches`` before backward). The
        schedule's point-to-point sends and receives run in the compute phase, which leaves
        retained state read-only: a kill mid-schedule re-runs the step on every rank."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        schedule = get_forward_backward_func()

        def run() -> torch.Tensor | None:
            store = schedule(
                forward_step_func=forward_step_func,
                data_iterator=iter(batches),
                model=self.model,
                num_microbatches=len(batches),
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=False,
            )
            if not parallel_state.is_pipeline_last_stage():
                return None
            return torch.stack([out["lm loss"] for out in store]).mean()

        return self.compute(run)


TRACKER_NAMES = ("data-parallel-rng", "model-parallel-rng", "expert-parallel-rng")
"""The names ``model_parallel_cuda_manual_seed`` registers (megatron-core 0.16)."""


def tracker_seed(seed: int, step: int, name: str, ranks: tuple[int, ...]) -> int:
    """A 63-bit seed per (seed, step, tracker name, tp/ep/etp ranks)."""
    text = repr((seed, step, name, ranks)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def reseed_tracker(seed: int, step: int) -> None:
    """Reset Megatron's RNG tracker to states that depend only on (seed, step, ranks)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tp = parallel_state.get_tensor_model_parallel_rank()
    ep, etp = (
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_tensor_parallel_rank(),
    )
    ranks = {"data-parallel-rng": (), "model-parallel-rng": (tp,), "expert-parallel-rng": (ep, etp)}
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    for name in TRACKER_NAMES:
        tracker.add(name, tracker_seed(seed, step, name, ranks[name]))


def causal_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    """Megatron's boolean attention mask ([1, 1, s, s], True = masked) for a causal GPT."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), 1)[
        None, None
    ]
