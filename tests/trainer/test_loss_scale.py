"""fp16 training's ``GradScaler`` handed to ``ctx.retain(..., scaler=)``
(``leto.trainer.loss_scale``): the job trains bit for bit as torch's own loop
(``scale(loss).backward(); unscale_; clip; scaler.step; scaler.update``), including the
steps whose gradients overflow (skipped: no parameter, moment or step count changes; the
scale backs off), and the scaler's state is retained with the step. A real trainer
``Context`` in this process (tests/trainer/local.py). In a job with kills:
tests/launcher/test_moe_recovery.py (``--fp16``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leto.errors import ConfigError
from tests.trainer.local import local_context

STEPS = 12
INIT_SCALE = 2.0**127
"""With the loss below, the first three steps' scaled gradients overflow float32 (skipped,
the scale backs off), and the scale then grows back into an overflow every few steps."""
X = torch.linspace(-1, 1, 12).reshape(3, 4)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=3)


def _loss(net: nn.Module) -> torch.Tensor:
    return net(X).square().mean() * 16


def _torch_alone(optimizer: str) -> tuple[list[torch.Tensor], list[float]]:
    net, scaler = _net(), _scaler()
    opt = OPTIMIZERS[optimizer](net.parameters())
    scales = []
    for _ in range(STEPS):
        opt.zero_grad()
        scaler.scale(_loss(net)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in net.parameters()], scales


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_scaled_job_trains_as_torchs_loop(
    monkeypatch: pytest.MonkeyPatch, optimizer: str
) -> None:
    want, want_scales = _torch_alone(optimizer)
    assert want_scales[0] < INIT_SCALE, "the test needs steps that overflow"
    with local_context(monkeypatch) as ctx:
        net, scaler = _net(), _scaler()
        state = ctx.retain(net, OPTIMIZERS[optimizer](net.parameters()), scaler=scaler)
        scales = []
        for _ in state.steps(STEPS):

            def compute() -> torch.Tensor:
                loss = _loss(net)
                scaler.scale(loss).backward()
                return loss

            state.step(max_grad_norm=1.0, loss=state.compute(compute))
            scales.append(scaler.get_scale())
        got = [p.detach().clone() for p in net.parameters()]
    assert scales == want_scales
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), f"parameter {i}"


def test_a_scripts_own_unscale_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unscaled before the all-reduce, ranks could disagree on an overflow."""
    with local_context(monkeypatch) as ctx:
        net, scaler = _net(), _scaler()
        opt = OPTIMIZERS["adamw"](net.parameters())
        state = ctx.retain(net, opt, scaler=scaler)
        next(state.steps(1))
        state.compute(lambda: scaler.scale(_loss(net)).backward())
        scaler.unscale_(opt)
        with pytest.raises(ConfigError, match=r"called scaler\.unscale_\(\) itself"):
            state.step()
