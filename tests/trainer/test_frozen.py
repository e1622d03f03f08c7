"""Parameters outside the optimizer (a fine-tuning job's frozen base) live in retained
memory, unchanged by the steps, and are planned as shards under ``fully_shard``; one written
in place is refused (a real trainer ``Context`` in this process, tests/trainer/local.py; FSDP2 on
torch's fake process group). Recovery with them: tests/launcher/test_frozen_params_recovery.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from leto.errors import ScriptError
from leto.trainer import placement
from leto.trainer.grad_sync import GradSync
from tests.trainer.local import local_context, trainer_env


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].requires_grad_(False)  # the frozen base
    return model


def _train(state, model: nn.Module, steps: int, meddle=lambda step: None) -> None:
    x = torch.ones(3, 4)
    for step in state.steps(steps):

        def fb() -> torch.Tensor:
            loss = model(x).square().mean()
            loss.backward()
            return loss

        loss = state.compute(fb)
        meddle(step)
        state.step(loss=loss)


def test_frozen_parameters_live_in_the_state_region_and_stay(monkeypatch) -> None:
    with local_context(monkeypatch) as ctx:
        model = _model()
        built = [p.detach().clone() for p in model[0].parameters()]
        opt = torch.optim.AdamW(model[2].parameters(), lr=0.1)
        state = ctx.retain(model, opt)
        lo = state.state_region.data_ptr()
        hi = lo + state.state_region.numel()
        for p in model[0].parameters():
            assert lo <= p.data_ptr() < hi and not p.requires_grad
        assert len(state.layout.frozen) == 2
        trained = model[2].weight.detach().clone()
        _train(state, model, 3)
        assert all(torch.equal(p, b) for p, b in zip(model[0].parameters(), built, strict=True))
        assert not torch.equal(model[2].weight, trained)


def test_a_frozen_parameter_written_in_place_is_refused(monkeypatch) -> None:
    with local_context(monkeypatch) as ctx:
        model = _model()
        opt = torch.optim.AdamW(model[2].parameters(), lr=0.1)
        state = ctx.retain(model, opt)

        def ema(step: int) -> None:
            if step == 1:
                with torch.no_grad():
                    model[0].weight.mul_(0.99)

        with pytest.raises(ScriptError, match=r"parameter 0\.weight is outside the optimizer"):
            _train(state, model, 3, ema)


def test_frozen_parameters_under_fully_shard_are_planned_as_shards() -> None:
    """Their slots are the padded local chunks FSDP2 keeps, as the optimizer's parameters'."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with torch.device("meta"):
            model = _model()
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        opt = torch.optim.AdamW(model[2].parameters(), lr=0.1)
        plan = placement.plan(
            model,
            opt,
            env=trainer_env(world_size=2),
            device=torch.device("cpu"),
            world_size=2,
            grad_sync=GradSync(),
        )
        assert plan.shards is not None and plan.frozen == list(model[0].parameters())
        assert [s.shape for s in plan.layout.frozen] == [(4, 4), (4,)]  # 8 rows over 2 ranks
        assert [s.shape for s in plan.layout.params] == [(1, 8), (1,)]  # 2 rows over 2 ranks
    finally:
        dist.destroy_process_group()
