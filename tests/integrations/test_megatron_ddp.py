"""Megatron's DistributedDataParallel over Leto's retained gradient regions (CPU, gloo).

In one process (a world of one): Leto's plan of Megatron's gradient buffers equals the
buffers Megatron builds (also from a ``meta`` model, bucketing included); the DDP
constructor's ``grad_data`` *are* the retained regions (not reallocated, not zeroed); a step
fills them through DDP's hooks; with ``overlap_grad_reduce`` the backward kill point (the
middle leaf module, where ``RetainedState`` puts it) is reached after some bucket
all-reduces were launched and before others, so a kill there lands mid bucket all-reduce.

Under leto-run (2 ranks): at DP=2 the Megatron DDP path (overlap, small buckets) and Leto's
flat all-reduce give the same retained state bit for bit at every step (Megatron scales by
1/2 before the sum, Leto divides after: equal in binary floating point), which fails if DDP's
buffers were not the retained gradients or not reduced. Recovery from kills on this path:
test_megatron_recovery.py (DP=2) and test_megatron_tp.py (TP=2, TP=2 x DP=2).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from leto.errors import ConfigError
from leto.events import Kind
from leto.retained.layout import GradPlacement, Layout
from tests.integrations.megatron_jobs import TINY_GPT
from tests.launcher.harness import REPO, digests, run_leto
from tests.trainer.local import local_context

SCRIPT = str(REPO / "examples" / "megatron_gpt.py")
BUCKET = 2000  # elements: the test model (~35 k parameters) spreads over many buckets


@pytest.fixture(scope="module")
def lm(parallel):
    """The integration on a world of one (conftest's ``parallel``)."""
    return parallel


def _gpt(lm, device: str = "cpu"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    ctx = SimpleNamespace(device=torch.device("cpu"), init_device=lambda d: torch.device(device))
    return lm.build_gpt(ctx, config, vocab_size=64, max_sequence_length=16)


def _ddp_config(**kw):
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(**kw)


def _params(opt) -> list[torch.nn.Parameter]:
    return [p for g in opt.param_groups for p in g["params"]]


@pytest.fixture
def ctx(monkeypatch):
    """A real trainer context on this world of one (a state manager, no agent)."""
    with local_context(monkeypatch) as ctx:
        yield ctx


def _retained(ctx, model, opt, placement: GradPlacement, fill: float):
    """``ctx.retain`` with the gradient regions ``placement`` plans, filled with ``fill``
    (a reattaching trainer's final gradients, which DDP must not zero)."""
    state = ctx.retain(model, opt, grads=placement)
    for region in state.grad_regions.values():
        region.view(torch.float32).fill_(fill)
    return state


def _batch():
    from leto.integrations.megatron import causal_mask

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (2, 16), generator=g)
    return tokens, torch.arange(16).expand(2, -1), causal_mask(16, torch.device("cpu")), tokens


def test_placement_equals_megatrons_buffers(lm):
    from megatron.core.distributed import DistributedDataParallel

    from leto.integrations import megatron_ddp

    model = _gpt(lm)
    opt = lm.adamw(model, _opt())
    config = _ddp_config(overlap_grad_reduce=True, bucket_size=BUCKET)
    placement = megatron_ddp.grad_placement(model, _params(opt), config)
    meta = _gpt(lm, "meta")
    assert megatron_ddp.grad_placement(meta, _params(lm.adamw(meta, _opt())), config) == placement
    ddp = DistributedDataParallel(config=model.config, ddp_config=config, module=model)
    assert len(ddp.buffers) == 1 and sum(len(g.buckets) for g in ddp.bucket_groups) > 4
    buffer = ddp.buffers[0]
    assert placement.regions == (("ddp.grads.float32", buffer.numel * 4),)
    for p, (region, offset) in zip(_params(opt), placement.slots, strict=True):
        assert region == 0 and p.main_grad.data_ptr() - buffer.grad_data.data_ptr() == offset


def test_placement_puts_expert_grads_in_their_own_region_after_the_dense_ones(lm):
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from leto.integrations import megatron_ddp

    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        num_moe_experts=4,
        moe_router_topk=2,
        add_bias_linear=False,
    )
    ctx = SimpleNamespace(device=torch.device("cpu"), init_device=lambda d: torch.device(d))
    torch.manual_seed(0)
    model = lm.build_gpt(ctx, config, vocab_size=64, max_sequence_length=16)
    for (
        name,
        p,
    ) in (
        model.named_parameters()
    ):  # what Megatron's linear layers tag at expert_model_parallel_size > 1
        if ".local_experts." in name:
            p.allreduce = False
    opt = lm.adamw(model, _opt())
    ddp_config = _ddp_config(overlap_grad_reduce=True, bucket_size=BUCKET)
    placement = megatron_ddp.grad_placement(model, _params(opt), ddp_config)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    assert len(ddp.buffers) == 1 and len(ddp.expert_parallel_buffers) == 1
    dense, expert = ddp.buffers[0], ddp.expert_parallel_buffers[0]
    assert placement.regions == (
        ("ddp.grads.float32", dense.numel * 4),
        ("ddp.grads.expert.float32", expert.numel * 4),
    )
    for p, (region, offset) in zip(_params(opt), placement.slots, strict=True):
        buffer = expert if not getattr(p, "allreduce", True) else dense
        assert (
            region == (buffer is expert)
            and p.main_grad.data_ptr() - buffer.grad_data.data_ptr() == offset
        )


def _opt():
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=1e-3)


def test_ddp_builds_on_the_retained_regions_and_fills_them(lm, ctx):
    from leto.integrations import megatron_ddp

    model = _gpt(lm)
    opt = lm.adamw(model, _opt())
    config = _ddp_config(overlap_grad_reduce=True, bucket_size=BUCKET)
    state = _retained(
        ctx, model, opt, megatron_ddp.grad_placement(model, _params(opt), config), fill=7.0
    )
    ddp = megatron_ddp.build_ddp(ctx, state, model, config)
    (region,) = state.grad_regions.values()
    grads = region.view(torch.float32)
    assert ddp.buffers[0].grad_data.data_ptr() == region.data_ptr()
    assert bool((grads == 7.0).all()), "the DDP constructor zeroed (or replaced) a retained region"
    assert ctx.grad_sync.reduce == ddp.finish_grad_sync and ctx.grad_sync.collectives_in_backward

    leaves = [m for m in model.modules() if not list(m.children())]
    launched_at_kill_point: list[tuple[int, int]] = []

    def count(grad: torch.Tensor) -> None:  # the backward kill point of RetainedState
        groups = ddp.bucket_groups
        launched_at_kill_point.append(
            (sum(g.grad_reduce_handle is not None for g in groups), len(groups))
        )

    def arm(
        module: torch.nn.Module, args: object, out: object
    ) -> None:  # as RetainedState._arm_backward_point
        outs = out if isinstance(out, (tuple, list)) else (out,)
        next(
            t for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None
        ).register_hook(count)

    leaves[len(leaves) // 2].register_forward_hook(arm)
    for _ in range(2):  # the first batch records the buckets' readiness; the second overlaps
        ctx.grad_sync.zero()
        assert bool((grads == 0).all())
        ddp(*_batch()[:3], labels=_batch()[3]).mean().backward()
        assert all(p.grad is None for p in _params(opt)), "DDP's hooks move .grad into main_grad"
        ctx.grad_sync.reduce()
    state.check_main_grads()
    assert bool((grads != 0).any())
    first, second = launched_at_kill_point
    print(f"kill point: {first} then {second} (bucket all-reduces launched, bucket groups)")
    assert first[0] == 0, "the first batch launches nothing from hooks"
    assert 0 < second[0] < second[1], (
        f"kill point after {second[0]} of {second[1]} bucket all-reduces"
    )


def test_a_different_buffer_layout_fails_loudly(lm, ctx):
    from leto.errors import ProtocolError
    from leto.integrations import megatron_ddp

    model = _gpt(lm)
    opt = lm.adamw(model, _opt())
    config = _ddp_config()
    placement = megatron_ddp.grad_placement(model, _params(opt), config)
    ((name, nbytes),) = placement.regions
    shifted = dataclasses.replace(
        placement,
        regions=((name, nbytes + 64),),
        slots=tuple((r, off + 64) for r, off in placement.slots),
    )
    state = _retained(ctx, model, opt, shifted, fill=0.0)
    with pytest.raises(
        ProtocolError, match="planned gradient buffers|not the retained gradient views"
    ):
        megatron_ddp.build_ddp(ctx, state, model, config)


def test_unsupported_configs_are_refused(lm):
    from leto.integrations import megatron_ddp

    model = _gpt(lm)
    params = _params(lm.adamw(model, _opt()))
    with pytest.raises(ConfigError, match="DistributedOptimizer"):
        megatron_ddp.grad_placement(model, params, _ddp_config(use_distributed_optimizer=True))
    with pytest.raises(ConfigError, match="unique names"):
        GradPlacement(regions=(("grads", 64),), slots=())
    with pytest.raises(ConfigError, match="does not fit"):
        Layout.plan(
            params[:1],
            [],
            torch.optim.AdamW(params[:1]),
            grads=GradPlacement(regions=(("ddp.grads.float32", 4),), slots=((0, 0),)),
        )


@pytest.mark.timeout(300)
def test_ddp_equals_leto_allreduce_at_dp2(tmp_path):
    """Fault-free, 2 ranks: Megatron's DDP (overlapped buckets) == Leto's flat all-reduce, bit for bit."""
    runs = {}
    for impl, extra in (
        ("megatron", ["--overlap-grad-reduce", "--ddp-bucket-size", str(BUCKET)]),
        ("leto", []),
    ):
        proc, events = run_leto(
            tmp_path,
            steps=8,
            leto={"consistency": "rmu"},
            script=SCRIPT,
            steps_flag="--train-iters",
            model_args=TINY_GPT,
            script_args=["--ddp-impl", impl, *extra],
            timeout_s=200,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert f"DDP {impl}" in proc.stdout
        runs[impl] = events
    ddp, flat = digests(runs["megatron"]), digests(runs["leto"])
    assert set(ddp) == {(r, s) for r in range(2) for s in range(1, 9)}
    assert ddp == flat, "Megatron's DDP and Leto's all-reduce disagree"
    losses = {
        impl: sorted((e["rank"], e["step"], e["loss"]) for e in ev if e["kind"] == Kind.STEP_DONE)
        for impl, ev in runs.items()
    }
    assert losses["megatron"] == losses["leto"]
