"""leto.integrations.megatron in one process (CPU): imports, shape planning, meta placement.

What cannot run on CPU, and so is not tested here (it is the GPU step of issue 6):

* NCCL world size 1 on an H200, and two ranks sharing the GPU (gloo or NCCL);
* CUDA VMM pool memory as the device tier under a Megatron model;
* Megatron's GPU initialisation path (``use_cpu_initialization=False``) and the real
  ``CudaRNGStatesTracker`` (here: the CPU tracker of examples/megatron_cpu_shims.py);
* Transformer Engine layer specs, fused kernels, bf16 Megatron runs;
* CP layouts (not integrated); TP, PP, EP and the distributed optimizer over several ranks
  are tested end to end in test_megatron_tp.py, test_megatron_pp.py, test_megatron_ep.py and
  test_megatron_distopt.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from leto.errors import ConfigError


class FakeCtx:
    """What build_gpt/retain_megatron use of a Context."""

    def __init__(self, resuming: bool) -> None:
        self.device = torch.device("cpu")
        self.resuming = resuming
        self.retained: list[torch.nn.Parameter] = []

    def init_device(self, device):
        return torch.device("meta" if self.resuming else device)

    def retain(
        self, model, optimizer, grads=None
    ):  # as RetainedState._bind: swap every param for a fresh one
        for p in model.parameters():
            torch.utils.swap_tensors(
                p, torch.nn.Parameter(torch.zeros_like(p), requires_grad=p.requires_grad)
            )
        return SimpleNamespace(steps=lambda n: iter(range(n)), step=lambda **kw: None)


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, **kw
    )


def _opt_config(**kw):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=1e-3, **kw)


def _gpt(lm, resuming: bool):
    torch.manual_seed(0)
    return lm.build_gpt(FakeCtx(resuming), _config(), vocab_size=64, max_sequence_length=16)


def test_imports_and_version(megatron):
    from leto.integrations import megatron as lm

    assert lm.require_megatron() == lm.MEGATRON_VERSION


def test_parallel_config_takes_tensor_and_pipeline_parallelism():
    from leto.integrations.megatron import ParallelConfig

    assert ParallelConfig().data_parallel_size(4) == 4
    assert ParallelConfig(tensor_model_parallel_size=2).data_parallel_size(4) == 2
    with pytest.raises(ConfigError, match="not a multiple"):
        ParallelConfig(tensor_model_parallel_size=2).data_parallel_size(3)
    assert (
        ParallelConfig(
            pipeline_model_parallel_size=2, tensor_model_parallel_size=2
        ).data_parallel_size(8)
        == 2
    )
    with pytest.raises(ConfigError, match="tensor, pipeline, expert and data parallelism only"):
        ParallelConfig(context_parallel_size=2)
    assert (
        ParallelConfig(expert_model_parallel_size=2).data_parallel_size(2) == 2
    )  # EP is carved out of DP
    with pytest.raises(ConfigError, match="not a multiple of expert_model_parallel_size"):
        ParallelConfig(expert_model_parallel_size=2).data_parallel_size(3)
    for size in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        with pytest.raises(ConfigError, match="TP = PP = 1 only"):
            ParallelConfig(expert_model_parallel_size=2, **{size: 2})
    with pytest.raises(ConfigError, match=">= 1"):
        ParallelConfig(pipeline_model_parallel_size=0)


class GrouplessCtx:
    """A trainer that has no process group yet (a shadow below level 3, or no leto.init())."""

    def __init__(self, is_shadow: bool, monkeypatch: pytest.MonkeyPatch) -> None:
        self.is_shadow, self.world_size, self.rank = is_shadow, 1, 0
        self.env = SimpleNamespace(shadow_level=1)
        self.grad_sync = None
        self.waited = 0
        self._monkeypatch = monkeypatch
        monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def wait_for_promotion(self) -> None:  # Context's: promoted, the world group built
        self.waited += 1
        self.is_shadow = False
        self._monkeypatch.undo()


def test_low_level_shadow_builds_parallel_state_at_promotion(parallel, monkeypatch):
    ctx = GrouplessCtx(is_shadow=True, monkeypatch=monkeypatch)
    assert parallel.init_parallel(ctx, seed=7) == 1
    assert ctx.waited == 1 and not ctx.is_shadow
    assert ctx.grad_sync is not None and ctx.grad_sync.group is None


def test_init_parallel_without_a_group_is_a_config_error(megatron, monkeypatch):
    from leto.integrations import megatron as lm

    ctx = GrouplessCtx(is_shadow=False, monkeypatch=monkeypatch)
    with pytest.raises(ConfigError, match="call leto.init"):
        lm.init_parallel(ctx, seed=7)
    assert ctx.waited == 0


def test_grad_sync_without_model_parallelism_is_the_default(parallel):
    lm = parallel
    sync = lm.megatron_grad_sync()
    assert sync.group is None and sync.clip is None and sync.size() == 1


def test_model_parallel_clipping_equals_torch_on_one_shard(parallel):
    # TP=1: every parameter is counted, so the norm and the clipped gradients are torch's.
    lm = parallel
    model = _gpt(lm, resuming=False)
    params = list(model.parameters())
    torch.manual_seed(1)
    for p in params:
        p.grad = torch.randn_like(p)
    want_grads = [p.grad.clone() for p in params]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, g in zip(ref, want_grads, strict=True):
        r.grad = g
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5, foreach=True)
    got = lm.clip_grads_model_parallel(params, 0.5)
    torch.testing.assert_close(got, want)
    assert got > 0.5  # the clip did bite
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad)


def test_meta_build_allocates_nothing_and_plans_the_same_layout(parallel):
    lm = parallel
    meta, real = _gpt(lm, resuming=True), _gpt(lm, resuming=False)
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    assert {p.device.type for p in real.parameters()} == {"cpu"}
    plans = [lm.plan(m, lm.adamw(m, _opt_config()), torch.device("cpu")) for m in (meta, real)]
    assert plans[0] == plans[1]
    numel = sum(p.numel() for p in real.parameters())
    assert plans[1].grad_bytes >= 4 * numel
    assert plans[1].state_bytes >= 3 * 4 * numel  # params + exp_avg + exp_avg_sq (fp32)


def test_adamw_uses_megatrons_decay_groups(parallel):
    lm = parallel
    model = _gpt(lm, resuming=False)
    opt = lm.adamw(model, _opt_config(weight_decay=0.1, adam_beta2=0.95))
    decay, no_decay = opt.param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() > 1 for p in decay["params"])
    assert all(names[id(p)].endswith(".bias") or p.dim() == 1 for p in no_decay["params"])
    assert opt.defaults["betas"] == (0.9, 0.95) and opt.defaults["foreach"]
    with pytest.raises(ConfigError, match="DistributedOptimizer"):
        lm.adamw(model, _opt_config(use_distributed_optimizer=True))


def test_sequence_parallelism_is_refused(parallel):
    lm = parallel
    with pytest.raises(ConfigError, match="sequence_parallel"):
        lm.build_gpt(
            FakeCtx(False),
            _config(sequence_parallel=True, tensor_model_parallel_size=2),
            vocab_size=64,
            max_sequence_length=16,
        )


def test_interleaved_pipeline_is_refused(parallel):
    lm = parallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
    )
    with pytest.raises(ConfigError, match="interleaved schedule"):
        lm.build_gpt(FakeCtx(False), config, vocab_size=64, max_sequence_length=16)


def test_meta_build_skips_the_embedding_all_reduce_only_inside(parallel):
    # A stage's meta build must not all-reduce its (data-less) tied embedding copy.
    from megatron.core.models.common.language_module.language_module import LanguageModule

    from leto.integrations.megatron import _no_embedding_sync

    original = LanguageModule._is_in_embd_group
    with _no_embedding_sync():
        assert LanguageModule._is_in_embd_group(object()) is False
    assert LanguageModule._is_in_embd_group is original


def test_cpu_shim_maps_cuda_allocations_to_the_cpu(megatron):
    import megatron_cpu_shims

    with megatron_cpu_shims.CudaToCpu():
        counter = torch.zeros(
            [], dtype=torch.int, device="cuda"
        )  # as Megatron's schedules allocate it
        weight = torch.ones(3)
        moved = weight.cuda()  # as setup_embeddings_and_output_layer moves the shared embedding
    assert counter.device.type == "cpu" and moved is weight


def test_meta_build_tags_parameters_as_a_real_build(parallel):
    # The clipping norm reads tensor_model_parallel: a shadow's meta build must carry it.
    lm = parallel
    meta, real = _gpt(lm, resuming=True), _gpt(lm, resuming=False)
    tags = [{n: dict(vars(p)) for n, p in m.named_parameters()} for m in (meta, real)]
    assert tags[0] == tags[1]
    assert sum(bool(a.get("tensor_model_parallel")) for a in tags[1].values()) >= 4


def test_retain_keeps_megatron_parameter_attributes(parallel):
    lm = parallel
    model = _gpt(lm, resuming=False)
    before = {n: dict(vars(p)) for n, p in model.named_parameters()}
    assert any("tensor_model_parallel" in a for a in before.values())
    lm.retain_megatron(FakeCtx(False), model, lm.adamw(model, _opt_config()), seed=1)
    assert {n: dict(vars(p)) for n, p in model.named_parameters()} == before


def test_tracker_states_depend_only_on_seed_and_step(parallel):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    lm = parallel

    def draws(step: int) -> torch.Tensor:
        lm.reseed_tracker(3, step)
        with get_cuda_rng_tracker().fork():
            return torch.rand(8)

    assert torch.equal(draws(5), draws(5))
    assert not torch.equal(draws(5), draws(6))


def test_tiny_gpt_step_on_cpu(parallel):
    lm = parallel
    model = _gpt(lm, resuming=False)
    opt = lm.adamw(model, _opt_config())
    tokens = torch.randint(0, 64, (2, 16))
    pos = torch.arange(16).expand(2, -1)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(tokens, pos, lm.causal_mask(16, torch.device("cpu")), labels=tokens).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]


def test_throwaway_run_restores_the_tracker_and_drops_its_buffer(parallel):
    """``run_throwaway`` (the shadow's model warm-up): Megatron's RNG tracker states and its
    global attention buffer are as before; the job's own model is not touched."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    lm = parallel
    model = _gpt(lm, resuming=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tracker = get_cuda_rng_tracker()
    states = {k: v.clone() for k, v in tracker.get_states().items()}
    seen = []

    def loss_fn(m):
        tokens = torch.randint(0, 64, (2, 16))
        loss = m(
            tokens,
            torch.arange(16).expand(2, -1),
            lm.causal_mask(16, torch.device("cpu")),
            labels=tokens,
        )
        seen.extend(
            [
                sum(p.numel() for p in m.parameters()),
                len(parallel_state.get_global_memory_buffer().buffer),
            ]
        )
        return loss.mean()

    config = _config(attention_dropout=0.1)
    lm.run_throwaway(
        torch.device("cpu"), config, vocab_size=64, max_sequence_length=16, loss_fn=loss_fn
    )
    after = tracker.get_states()
    assert set(after) == set(states) and all(torch.equal(after[k], states[k]) for k in states)
    assert seen[1] > 0 and parallel_state.get_global_memory_buffer().buffer == {}, (
        "its attention scratch is dropped"
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # the estimate counts at least the throwaway's parameters and gradients
    assert (
        lm.warmup_bytes(
            config, vocab_size=64, max_sequence_length=16, micro_batch_size=2, seq_length=16
        )
        >= 2 * 4 * seen[0]
    )


def _moe_config(**kw):
    return _config(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, **kw)


def test_throwaway_run_leaves_the_moe_aux_loss_tracker_as_it_was(parallel):
    """A one-layer MoE throwaway must not size Megatron's aux-loss tracker for one layer:
    the job's two-layer forward after it (a promoted shadow's first step) must still log."""
    import dataclasses

    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    lm = parallel
    config = _moe_config(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
    tracker = get_moe_layer_wise_logging_tracker()
    tracker.clear()

    def loss_fn(m):
        tokens = torch.randint(0, 64, (2, 16))
        return m(
            tokens,
            torch.arange(16).expand(2, -1),
            lm.causal_mask(16, torch.device("cpu")),
            labels=tokens,
        ).mean()

    cut = dataclasses.replace(config, num_layers=1)
    lm.run_throwaway(
        torch.device("cpu"), cut, vocab_size=64, max_sequence_length=16, loss_fn=loss_fn
    )
    assert tracker == {}, "the throwaway's aux losses stayed in Megatron's tracker"
    model = lm.build_gpt(FakeCtx(False), config, vocab_size=64, max_sequence_length=16)
    loss_fn(model).backward()  # IndexError in save_to_aux_losses_tracker if the cut sized it
    assert (
        all(entry["values"].numel() == config.num_layers for entry in tracker.values()) and tracker
    )
    tracker.clear()


def test_moe_clipping_counts_expert_grads_with_the_dense_norm(parallel):
    # World of one: Megatron's ChainedOptimizer norm sqrt(dense² + expert²) is the norm of all.
    lm = parallel
    torch.manual_seed(0)
    model = lm.build_gpt(FakeCtx(False), _moe_config(), vocab_size=64, max_sequence_length=16)
    params = list(model.parameters())
    experts = [p for name, p in model.named_parameters() if ".local_experts." in name]
    for p in experts:  # what Megatron's linear layers tag at expert_model_parallel_size > 1
        p.allreduce = False
    assert len(experts) == 2 * 4 * 2  # 2 layers x 4 experts x (fc1, fc2) weights
    torch.manual_seed(1)
    for p in params:
        p.grad = torch.randn_like(p)
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(ref, params, strict=True):
        r.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5, foreach=True)
    got = lm.clip_grads_model_parallel(params, 0.5)
    torch.testing.assert_close(got, want)
    dense = torch.stack([p.grad.norm() for p in ref if getattr(p, "allreduce", True)]).norm()
    assert got > dense * 1.01  # the experts' gradients are in the norm
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r.grad)


def test_moe_settings_leto_does_not_run_are_refused(parallel):
    lm = parallel
    cases = {
        "moe_grouped_gemm": (_moe_config(moe_grouped_gemm=True), "grouped-GEMM"),
        "capacity": (_moe_config(moe_expert_capacity_factor=1.0), "token dropping"),
        "bias": (_config(num_moe_experts=4, moe_router_topk=2), "disable-bias-linear"),
    }
    for config, match in cases.values():
        with pytest.raises(ConfigError, match=match):
            lm.build_gpt(FakeCtx(False), config, vocab_size=64, max_sequence_length=16)


def test_moe_router_gating_runs_outside_autocast(parallel):
    """Megatron's router gating casts to its router dtype in the forward only: under a bf16
    autocast (how leto's --bf16 runs) its backward multiplied a bf16 gradient by the fp32
    weight and raised (seen at EP = 2 on an H200). CPU autocast reproduces it with the
    backward outside the autocast region (where a GPU's backward thread runs it)."""
    lm = parallel
    from megatron.core.transformer.moe import moe_utils, router

    lm.check_moe(_moe_config())
    lm.check_moe(_moe_config())  # installed once, not wrapped twice
    original = (
        moe_utils.router_gating_linear
    )  # Megatron's, unwrapped (the router's binding is wrapped)
    inp = torch.randn(8, 32, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(4, 32))
    with torch.autocast(
        "cpu", dtype=torch.bfloat16
    ):  # the backward outside it, as the examples run it
        logits = original(inp, weight, None, torch.float32)
    with pytest.raises(RuntimeError, match="same dtype"):
        logits.sum().backward()
    inp.grad = weight.grad = None
    assert router.router_gating_linear.__wrapped__ is original
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router.router_gating_linear(inp, weight, None, torch.float32)
    logits.sum().backward()
    assert logits.dtype == torch.float32
    assert torch.equal(logits, inp.detach() @ weight.detach().t())
    assert weight.grad.dtype == torch.float32 and inp.grad.dtype == torch.float32
