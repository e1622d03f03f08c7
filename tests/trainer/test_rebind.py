"""Gradient hooks a script registered on its parameters before ``ctx.retain()`` keep
firing once the parameters live in retained memory (``leto.trainer.rebind``), and their
handles still remove them: the job trains as the same loop under torch alone. A real
trainer ``Context`` in this process (tests/trainer/local.py)."""

from __future__ import annotations

import torch
from torch import nn

from tests.trainer.local import local_context

STEPS = 4
X = torch.linspace(-1, 1, 12).reshape(3, 4)


def _net() -> tuple[nn.Module, list]:
    """Two linears; the first's weight gradient scaled by a hook and its bias gradient
    clamped in place by a post-accumulate hook; the handles, to remove after step 1."""

    def clamp(p: torch.Tensor) -> None:
        p.grad.clamp_(-0.01, 0.01)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    handles = [
        net[0].weight.register_hook(lambda g: g * 10),
        net[0].bias.register_post_accumulate_grad_hook(clamp),
    ]
    return net, handles


def _loss(net: nn.Module) -> torch.Tensor:
    return net(X).square().mean()


def test_hooks_registered_before_retain_fire_and_remove_as_in_torch(monkeypatch) -> None:
    net, handles = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(STEPS):
        if step == 2:
            for h in handles:
                h.remove()
        opt.zero_grad()
        _loss(net).backward()
        opt.step()
    expected = [p.detach().clone() for p in net.parameters()]

    with local_context(monkeypatch) as ctx:
        net, handles = _net()
        state = ctx.retain(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for step in state.steps(STEPS):
            if step == 2:
                for h in handles:
                    h.remove()
            state.compute(lambda: _loss(net).backward())
            state.step()
        got = [p.detach().clone() for p in net.parameters()]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
