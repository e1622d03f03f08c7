"""Clipping folded into the fused update: a trainer on the fused RMU path (the Triton
interpreter on CPU) writes the clipping coefficient to ``Layout.grad_scale`` instead of
scaling its gradients in place, and trains as plain torch does with ``clip_grad_norm_``.
A real trainer ``Context`` in this process (tests/trainer/local.py)."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.local import local_context

DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
"""A trainer's device (``Context``): the kernel itself on a GPU, its interpreter on CPU."""
STEPS = 4
MAX_NORM = 0.05
"""Below every step's gradient norm: each step is clipped, by a different factor."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    return net.to(DEVICE)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # A large eps: Adam's step then depends on the gradients' scale, so an unclipped update
    # shows (with eps ~ 0 one clipping factor would cancel in m / sqrt(v)).
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.1, weight_decay=0.1)


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 2, generator=g)
    return (model(x.to(DEVICE)) - y.to(DEVICE)).square().mean()


def _plain() -> tuple[list[torch.Tensor], list[float], list[torch.Tensor]]:
    model = _model()
    opt = _optimizer(model)
    coefs, norms = [], []
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        coefs.append(float(MAX_NORM / (norm + 1e-6)))
        norms.append(norm)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], coefs, norms


def test_a_fused_trainer_clips_by_the_update_s_gradient_factor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    want, coefs, norms = _plain()
    assert max(coefs) < 1, "every step must clip"
    with local_context(monkeypatch, rmu_fused=True) as ctx:
        model = _model()
        state = ctx.retain(model, _optimizer(model))
        scale = state.updater.grad_scale
        assert scale is not None, "the fused updater scales the gradients it reads"
        for step in state.steps(STEPS):
            loss = state.compute(lambda step=step: _loss(model, step).backward())
            norm = state.step(max_grad_norm=MAX_NORM, loss=loss)
            # the factor is torch's coefficient; the retained gradients stay unscaled
            assert float(scale) == pytest.approx(coefs[step], rel=1e-6)
            # the norm before clipping is returned, as clip_grad_norm_ returns it
            assert norm is not None and norm.device == DEVICE
            torch.testing.assert_close(norm, norms[step], rtol=1e-5, atol=0)
        got = [p.detach().clone() for p in model.parameters()]
    for g, w in zip(got, want, strict=True):  # the fused kernel: torch's ops to a few ulps
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("max_norm", [MAX_NORM, None], ids=["clipped", "unclipped"])
def test_step_returns_the_norm_before_clipping(
    monkeypatch: pytest.MonkeyPatch, max_norm: float | None
) -> None:
    """Off the fused path (the gradients clipped in place): ``state.step()`` returns what
    ``clip_grad_norm_`` returns, bit for bit, or None without ``max_grad_norm``."""
    want = _plain()[2]
    with local_context(monkeypatch) as ctx:
        model = _model()
        state = ctx.retain(model, _optimizer(model))
        for step in state.steps(STEPS):
            state.compute(lambda step=step: _loss(model, step).backward())
            norm = state.step(max_grad_norm=max_norm)
            if max_norm is None:
                assert norm is None
            else:
                assert norm is not None and torch.equal(norm, want[step]), step
