"""``state.step(max_grad_norm=...)`` clips as a torch loop's
``clip_grad_norm_(model.parameters(), ...)`` does, bit for bit, when the optimizer's groups
order the parameters otherwise (Hugging Face's Trainer: the weights to decay, then the
biases and norms): the total norm stacks the per-parameter norms in the model's order, and
its last bits, and so the clipped update's, depend on that order. A real trainer
``Context`` in this process (tests/trainer/local.py), against torch alone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tests.trainer.local import local_context

STEPS = 8
MAX_NORM = 0.05  # below every step's norm: each update is clipped


def _net() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for i in range(6):
        layers += [nn.Linear(8, 8), nn.LayerNorm(8)]
        with torch.no_grad():
            layers[-2].weight.mul_(1.0 + i)  # norms of several magnitudes
    return nn.Sequential(*layers)


def _optimizer(net: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in net.parameters() if p.ndim >= 2]
    no_decay = [p for p in net.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def _loss(net: nn.Module, step: int) -> torch.Tensor:
    return net(_batch(step)).square().mean()


def _leto_run(
    monkeypatch: pytest.MonkeyPatch,
    loss: Callable[[nn.Module, int], torch.Tensor],
    **step_kwargs: Any,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[float]]:
    """The same loop under leto (a real ``Context`` in this process): the parameters after
    ``STEPS`` steps, each step's returned norm, and AdamW's step counters."""
    with local_context(monkeypatch) as ctx:
        net = _net()
        state = ctx.retain(net, _optimizer(net))
        norms = []
        for step in state.steps(STEPS):
            state.compute(lambda step=step: loss(net, step).backward())
            norms.append(state.step(**step_kwargs))
        got = [p.detach().clone() for p in net.parameters()]
        counters = [state.optimizer.state[p]["step"].item() for p in net.parameters()]
    return got, norms, counters


def test_the_clipped_update_is_torchs_with_groups_out_of_model_order(monkeypatch) -> None:
    net = _net()
    opt = _optimizer(net)
    torch_norms, orders_differ = [], 0
    for step in range(STEPS):
        opt.zero_grad()
        _loss(net, step).backward()
        in_groups = [p.grad for g in opt.param_groups for p in g["params"]]
        orders_differ += bool(
            torch.nn.utils.get_total_norm(in_groups, foreach=True)
            != torch.nn.utils.get_total_norm([p.grad for p in net.parameters()], foreach=True)
        )
        torch_norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM))
        opt.step()
    expected = [p.detach().clone() for p in net.parameters()]

    got, norms, _ = _leto_run(monkeypatch, _loss, max_grad_norm=MAX_NORM)
    assert all(n > MAX_NORM for n in torch_norms), "every step must be clipped"
    assert orders_differ, "the groups' order must change some norm's last bits"
    assert [n.item() for n in norms] == [n.item() for n in torch_norms]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("max_norm", [None, MAX_NORM])
def test_clipping_by_value_then_by_norm_is_torchs(monkeypatch, max_norm: float | None) -> None:
    """``state.step(max_grad_value=...)`` clamps as ``clip_grad_value_`` does between a torch
    loop's backward and its norm clipping (a gradient written there by the script itself is
    refused: leto averages over the ranks inside ``state.step()``)."""
    value = 0.02  # below some gradients' elements: the clamp bites
    net = _net()
    opt = _optimizer(net)
    clamped = 0
    for step in range(STEPS):
        opt.zero_grad()
        _loss(net, step).backward()
        clamped += sum(int((p.grad.abs() > value).sum()) for p in net.parameters())
        torch.nn.utils.clip_grad_value_(net.parameters(), value)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        opt.step()
    expected = [p.detach().clone() for p in net.parameters()]

    got, _, _ = _leto_run(monkeypatch, _loss, max_grad_norm=max_norm, max_grad_value=value)
    assert clamped, "some gradient element must exceed the clamp"
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("max_norm", [None, MAX_NORM])
def test_a_step_with_a_nonfinite_norm_is_skipped_as_a_torch_loop_skips_it(
    monkeypatch, max_norm: float | None
) -> None:
    """``state.step(skip_nonfinite=True)``: a step whose gradients' norm is inf or NaN
    leaves parameters and optimizer state (AdamW's step counter included) as they were, as
    ``if norm.isfinite(): opt.step()`` does; the other steps update bit for bit alike."""
    bad = {2: float("inf"), 5: float("nan")}

    def loss(net: nn.Module, step: int) -> torch.Tensor:
        return _loss(net, step) * bad.get(step, 1.0)

    net = _net()
    opt = _optimizer(net)
    for step in range(STEPS):
        opt.zero_grad()
        loss(net, step).backward()
        params = list(net.parameters())
        if max_norm is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if norm.isfinite():
            opt.step()
    expected = [p.detach().clone() for p in net.parameters()]
    steps = [opt.state[p]["step"].item() for p in net.parameters()]

    got, norms, got_steps = _leto_run(
        monkeypatch, loss, max_grad_norm=max_norm, skip_nonfinite=True
    )
    assert steps == [STEPS - len(bad)] * len(steps)
    assert got_steps == steps
    assert [i for i, n in enumerate(norms) if not n.isfinite()] == sorted(bad)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
