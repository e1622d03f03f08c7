"""``leto.ChainedOptimizer``: one optimizer over several (Muon for the matrices, AdamW for
the rest) whose step is bit for bit the parts' own steps, whose groups are the parts' (an LR
scheduler on it reaches each part), and which refuses a parameter held by two parts. Its
update chunk by chunk and its recovery from every kill point: test_any_optimizer.py
("muon+adamw"); in a real job: tests/launcher/test_any_optimizer_recovery.py. A scheduler
built on a part is refused when steps() begins (a real trainer, tests/trainer/local.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leto.errors import ConfigError
from leto.optim import ChainedOptimizer
from tests.trainer.local import local_context


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.LayerNorm(12), nn.Linear(12, 6))


def _parts(net: nn.Module) -> list[torch.optim.Optimizer]:
    mats = [p for p in net.parameters() if p.dim() == 2]
    rest = [p for p in net.parameters() if p.dim() != 2]
    return [torch.optim.Muon(mats, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)]


def test_the_chained_step_is_the_parts_own_steps() -> None:
    a, b = _net(), _net()
    chained, parts = ChainedOptimizer(_parts(a)), _parts(b)
    halve = torch.optim.lr_scheduler.LambdaLR(chained, [lambda s: 0.5**s, lambda s: 1.0])
    x = torch.randn(5, 6)
    for step in range(4):
        for net, opts in ((a, [chained]), (b, parts)):
            for opt in opts:
                opt.zero_grad()
            net(x).square().mean().backward()
            for opt in opts:
                opt.step()
        halve.step()
        parts[0].param_groups[0]["lr"] = 2e-2 * 0.5 ** (step + 1)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert chained.parts[0].param_groups[0] is chained.param_groups[0]
    assert chained.parts[0].param_groups[0]["lr"] == 2e-2 * 0.5**4
    assert all(part.state is chained.state for part in chained.parts)


def test_a_parameter_in_two_parts_is_refused() -> None:
    net = _net()
    with pytest.raises(ValueError, match="more than one parameter group"):
        ChainedOptimizer([torch.optim.SGD(net.parameters()), torch.optim.SGD(net.parameters())])


def test_a_scheduler_on_a_part_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with local_context(monkeypatch) as ctx:
        net = _net()
        parts = _parts(net)
        opt = ChainedOptimizer(parts)
        state = ctx.retain(net, opt)
        _on_part = torch.optim.lr_scheduler.StepLR(parts[1], step_size=2)  # alive: found by gc
        with pytest.raises(ConfigError, match="StepLR is built on part 1 of the ChainedOptimizer"):
            next(iter(state.steps(3)))
