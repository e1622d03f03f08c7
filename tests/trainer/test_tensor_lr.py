"""A learning rate held as a tensor (``AdamW(lr=torch.tensor(...))``, as a compiled or
capturable step wants it; an LR scheduler then fills it in place) trains bit for bit as
torch's own loop: the update, run by the optimizer's own step, gets the recorded rate back
as a tensor of the group's dtype (``leto.retained.optim_state.recorded_lr``), since torch
computes its step size with it in float32, not in double. A real trainer ``Context`` in
this process (tests/trainer/local.py), under both consistencies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.trainer.local import local_context

STEPS = 5
X = torch.linspace(-1, 1, 12).reshape(3, 4)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _opt(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(net.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7**s)


@pytest.mark.parametrize("consistency", ["rmu", "snapshot"])
def test_a_tensor_learning_rate_trains_as_torch(
    monkeypatch: pytest.MonkeyPatch, consistency: str
) -> None:
    ref = _net()
    ref_opt, ref_sched = _opt(ref)
    for _ in range(STEPS):
        ref_opt.zero_grad()
        ref(X).square().mean().backward()
        ref_opt.step()
        ref_sched.step()
    with local_context(monkeypatch, consistency=consistency) as ctx:
        net = _net()
        opt, sched = _opt(net)
        state = ctx.retain(net, opt)
        for _ in state.steps(STEPS):
            state.compute(lambda: net(X).square().mean().backward())
            state.step()
            sched.step()
        assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
        for i, (a, b) in enumerate(zip(ref.parameters(), net.parameters(), strict=True)):
            assert torch.equal(a, b), f"parameter {i}"
