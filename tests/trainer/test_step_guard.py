"""The retained optimizer steps only inside Leto's update (``leto.trainer.step_guard``): a
script's own ``optimizer.step()`` (a torchrun loop's leftover, ``GradScaler.step``, a part of
a ``ChainedOptimizer``) is refused before it writes anything, and Leto's own updates (rmu,
``consistency: snapshot``, which calls the optimizer's hooked step) run as before. A real
trainer ``Context`` in this process (tests/trainer/local.py). In a job, the refusal ends it
in one line: tests/launcher/test_config_error.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leto.errors import ScriptError
from leto.optim import ChainedOptimizer
from tests.trainer.local import local_context


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))


def _loss(net: nn.Module) -> torch.Tensor:
    loss = net(torch.ones(4, 6)).square().mean()
    loss.backward()
    return loss


def _state_of(net: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("consistency", ["rmu", "snapshot"])
@pytest.mark.parametrize("where", ["before state.step()", "after state.step()"])
def test_a_scripts_own_step_is_refused_and_writes_nothing(
    monkeypatch: pytest.MonkeyPatch, consistency: str, where: str
) -> None:
    with local_context(monkeypatch, consistency=consistency) as ctx:
        net = _net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        state = ctx.retain(net, opt)
        steps = state.steps(2)
        next(steps)
        state.compute(lambda: _loss(net))
        if where == "after state.step()":
            state.step()  # Leto's own update runs
        before = _state_of(net)
        with pytest.raises(ScriptError, match=r"calls AdamW\.step\(\) itself"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, _state_of(net), strict=True))


def test_grad_scaler_step_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with local_context(monkeypatch) as ctx:
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=1e-2)
        scaler = torch.amp.GradScaler("cpu")
        state = ctx.retain(net, opt)
        next(state.steps(1))
        state.compute(lambda: scaler.scale(net(torch.ones(4, 6)).square().mean()).backward())
        with pytest.raises(ScriptError, match="GradScaler"):
            scaler.step(opt)


def test_a_part_of_a_chained_optimizer_is_guarded(monkeypatch: pytest.MonkeyPatch) -> None:
    with local_context(monkeypatch) as ctx:
        net = _net()
        mats = [p for p in net.parameters() if p.dim() == 2]
        rest = [p for p in net.parameters() if p.dim() != 2]
        parts = [torch.optim.Muon(mats, lr=2e-2), torch.optim.AdamW(rest, lr=1e-2)]
        state = ctx.retain(net, ChainedOptimizer(parts))
        next(state.steps(1))
        state.compute(lambda: _loss(net))
        with pytest.raises(ScriptError, match=r"calls Muon\.step\(\) itself"):
            parts[0].step()
        state.step()  # Leto's update of the chained optimizer is not refused


@pytest.mark.parametrize("consistency", ["rmu", "snapshot"])
def test_leto_steps_every_step_with_the_guard_on(
    monkeypatch: pytest.MonkeyPatch, consistency: str
) -> None:
    """The job's update equals torch's own step by step (the guard lets Leto's hooked call
    through: snapshot's update is ``optimizer.step()``)."""
    ref = _net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with local_context(monkeypatch, consistency=consistency) as ctx:
        net = _net()
        state = ctx.retain(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        for _ in state.steps(3):
            state.compute(lambda: _loss(net))
            state.step()
            ref_opt.zero_grad()
            _loss(ref)
            ref_opt.step()
        for p, q in zip(net.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)
