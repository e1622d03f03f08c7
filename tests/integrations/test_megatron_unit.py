"""leto.integrations.megatron in one process (CPU): imports, shape planning, meta placement.

What cannot run on CPU, and so is not tested here (it is the GPU step of issue 6):

* NCCL world size 1 on an H200, and two ranks sharing the GPU (gloo or NCCL);
* CUDA VMM pool memory as the device tier under a Megatron model;
* Megatron's GPU initialisation path (``use_cpu_initialization=False``) and the real
  ``CudaRNGStatesTracker`` (here: the CPU tracker of examples/megatron_cpu_shims.py);
* Transformer Engine layer specs, fused kernels, bf16 Megatron runs;
* Megatron DDP buffers / DistributedOptimizer and TP/PP/EP layouts (not integrated at all).
"""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from leto.errors import ConfigError


@pytest.fixture(scope="module")
def parallel(megatron):
    """A world of one (gloo) with Megatron's parallel_state on it."""
    from megatron.core import parallel_state

    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", store=dist.FileStore(f.name, 1), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        from leto.integrations import megatron as lm

        lm.reseed_tracker(7, -1)
        yield lm
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


class FakeCtx:
    """What build_gpt/retain_megatron use of a Context."""

    def __init__(self, resuming: bool) -> None:
        self.device = torch.device("cpu")
        self.resuming = resuming
        self.retained: list[torch.nn.Parameter] = []

    def init_device(self, device):
        return torch.device("meta" if self.resuming else device)

    def retain(self, model, optimizer):  # as RetainedState._bind: swap every param for a fresh one
        for p in model.parameters():
            torch.utils.swap_tensors(p, torch.nn.Parameter(torch.zeros_like(p), requires_grad=p.requires_grad))
        return SimpleNamespace(steps=lambda n: iter(range(n)), step=lambda **kw: None)


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, **kw)


def _opt_config(**kw):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="adam", lr=1e-3, **kw)


def _gpt(lm, resuming: bool):
    torch.manual_seed(0)
    return lm.build_gpt(FakeCtx(resuming), _config(), vocab_size=64, max_sequence_length=16)


def test_imports_and_version(megatron):
    from leto.integrations import megatron as lm

    assert lm.require_megatron() == lm.MEGATRON_VERSION


def test_parallel_config_refuses_model_parallelism():
    from leto.integrations.megatron import ParallelConfig

    assert ParallelConfig().data_parallel_size(4) == 4
    with pytest.raises(ConfigError, match="data parallelism only"):
        ParallelConfig(tensor_model_parallel_size=2)
    with pytest.raises(ConfigError, match=">= 1"):
        ParallelConfig(pipeline_model_parallel_size=0)


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
