"""Parameters retained memory cannot hold as torch does. Sparse gradients are refused with
one line, never copied into retained memory: an ``nn.Embedding(sparse=True)`` at
``retain()``, a sparse gradient from elsewhere (a module calling
``F.embedding(..., sparse=True)``) when it lands. A parameter out of the contiguous layout
(a ``channels_last`` convolution's weight) is retained contiguous, and named in a warning. A real trainer ``Context`` in this process
(tests/trainer/local.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leto.errors import ConfigError, ScriptError
from tests.trainer.local import local_context


def test_a_sparse_embedding_is_refused_at_retain(monkeypatch) -> None:
    net = nn.Sequential(nn.Embedding(16, 4, sparse=True), nn.Linear(4, 2))
    with (
        local_context(monkeypatch) as ctx,
        pytest.raises(ConfigError, match=r"module '0' is an Embedding"),
    ):
        ctx.retain(net, torch.optim.SGD(net.parameters(), lr=0.1))


class SparseLookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(x, self.table, sparse=True)


def test_a_sparse_gradient_is_refused_when_it_lands(monkeypatch) -> None:
    net = nn.Sequential(SparseLookup(), nn.Linear(4, 2))
    x = torch.arange(4)
    with local_context(monkeypatch) as ctx:
        state = ctx.retain(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for _ in state.steps(1):
            with pytest.raises(ScriptError, match=r"shape \(16, 4\) got a torch.sparse_coo"):
                state.compute(lambda: net(x).sum().backward())
            return


def test_parameters_out_of_their_layout_are_named(monkeypatch, caplog) -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
    net[0].to(memory_format=torch.channels_last)
    net(torch.zeros(1, 3, 5, 5))
    with local_context(monkeypatch) as ctx, caplog.at_level("WARNING", "leto.trainer.placement"):
        ctx.retain(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert "1 parameter(s) are retained contiguous" in caplog.text
    assert "(0.weight)" in caplog.text


def test_trainable_parameters_outside_the_optimizer_are_named(monkeypatch, caplog) -> None:
    """A torch loop's ``clip_grad_norm_(model.parameters())`` counts their gradients;
    leto's update never sees them: the job is told."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    net[0].bias.requires_grad_(False)  # frozen as it should be: not named
    with local_context(monkeypatch) as ctx, caplog.at_level("WARNING", "leto.trainer.placement"):
        ctx.retain(net, torch.optim.SGD(net[1].parameters(), lr=0.1))
    assert "1 parameter(s) outside the optimizer require a gradient (0.weight)" in caplog.text


def test_a_second_retain_is_refused(monkeypatch) -> None:
    """It would bind the second model to the first one's regions: its weights replaced by
    the first model's, silently."""
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    weight = second.weight.detach().clone()
    with local_context(monkeypatch) as ctx:
        ctx.retain(first, torch.optim.SGD(first.parameters(), lr=0.1))
        with pytest.raises(ScriptError, match=r"ctx.retain\(\) was called a second time"):
            ctx.retain(second, torch.optim.SGD(second.parameters(), lr=0.1))
    assert torch.equal(second.weight, weight)


def test_a_lazy_module_not_yet_materialised_is_refused(monkeypatch) -> None:
    net = nn.Sequential(nn.LazyLinear(4), nn.Linear(4, 2))
    with local_context(monkeypatch) as ctx, pytest.raises(ConfigError, match=r"0.weight is uninit"):
        ctx.retain(net, torch.optim.SGD(net.parameters(), lr=0.1))


def test_a_group_added_after_retain_is_refused(monkeypatch) -> None:
    """Leto's update would never apply it (its parameters were planned as frozen): torch's
    optimizer would, so the job is stopped rather than trained otherwise."""
    head, body = nn.Linear(4, 2), nn.Linear(4, 4)
    net = nn.Sequential(body, head)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    body.requires_grad_(False)
    with local_context(monkeypatch) as ctx:
        state = ctx.retain(net, opt)
        for step in state.steps(2):
            if step == 1:
                body.requires_grad_(True)
                opt.add_param_group({"params": list(body.parameters())})
            state.compute(lambda: net(torch.ones(3, 4)).sum().backward())
            if step == 1:
                with pytest.raises(ScriptError, match=r"groups changed after ctx.retain"):
                    state.step()
                return
            state.step()


def test_a_second_step_in_one_iteration_is_refused(monkeypatch) -> None:
    net = nn.Linear(4, 2)
    with local_context(monkeypatch) as ctx:
        state = ctx.retain(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for _ in state.steps(2):
            state.compute(lambda: net(torch.ones(3, 4)).sum().backward())
            state.step()
            with pytest.raises(
                ScriptError, match=r"state.step\(\) was called twice in one iteration"
            ):
                state.step()
            return
