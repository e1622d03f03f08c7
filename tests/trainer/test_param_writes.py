"""A parameter of the optimizer written in place outside leto's update is refused with one
line at the next ``state.step()``: weight clipping after the step (a trainer killed in the
update never runs it), an ``nn.Embedding(max_norm=...)`` renormalising rows in forward (a
re-run forward writes twice), a load after ``retain()``; none of them is in the parity
either. A real trainer ``Context`` in this process (tests/trainer/local.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from leto.errors import ScriptError
from tests.trainer.local import local_context

X = torch.arange(4)


def _run(monkeypatch, net: nn.Module, after_step: Callable[[], None] = lambda: None) -> None:
    with local_context(monkeypatch) as ctx:
        state = ctx.retain(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for _ in state.steps(3):
            state.compute(lambda: net(X).sum().backward())
            state.step()
            after_step()


def test_an_untouched_model_trains(monkeypatch) -> None:
    _run(monkeypatch, nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 2)))


def test_weight_clipping_after_the_step_is_refused(monkeypatch) -> None:
    net = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 2))

    def clip() -> None:
        with torch.no_grad():
            for p in net.parameters():
                p.clamp_(-0.01, 0.01)

    with pytest.raises(ScriptError, match=r"parameter 0.weight was written in place"):
        _run(monkeypatch, net, clip)


def test_an_embedding_renormalising_in_forward_is_refused(monkeypatch) -> None:
    net = nn.Sequential(nn.Embedding(8, 4, max_norm=0.1), nn.Linear(4, 2))
    with pytest.raises(ScriptError, match=r"parameter 0.weight was written in place"):
        _run(monkeypatch, net)


def test_a_load_after_retain_is_refused(monkeypatch) -> None:
    net = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 2))
    saved = {k: v.clone() + 1 for k, v in net.state_dict().items()}
    with local_context(monkeypatch) as ctx:
        state = ctx.retain(net, torch.optim.SGD(net.parameters(), lr=0.1))
        net.load_state_dict(saved)
        for _ in state.steps(1):
            state.compute(lambda: net(X).sum().backward())
            with pytest.raises(ScriptError, match=r"a load after ctx.retain"):
                state.step()
            return
