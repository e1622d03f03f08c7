"""An out-of-memory retry of the compute phase (``leto.trainer.compute``) gives the step the
fault-free run gives, bit for bit, also when the step calls ``compute`` once per micro-batch
and the script draws from the global RNG before and between the calls (dropout draws too):
the retry runs the step's earlier calls again, each from the RNG state it began with. A real
trainer ``Context`` in this process (tests/trainer/local.py); the shadows' reclaim is the
one stand-in (there is no agent here)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.trainer.local import local_context

STEPS, MICRO = 3, 3


def _train(monkeypatch: pytest.MonkeyPatch, oom_at: tuple[int, int] | None) -> list[torch.Tensor]:
    """The parameters after STEPS steps of MICRO compute calls each; ``oom_at``: (step, call)
    whose backward runs out of memory once."""
    with local_context(monkeypatch) as ctx:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.Linear(16, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        state = ctx.retain(model, opt)
        guard = state._compute.guard  # the one stand-in: shadows to reclaim, reclaimed
        monkeypatch.setattr(guard, "can_reclaim", lambda: True)
        monkeypatch.setattr(guard, "reclaim", lambda step: 2)
        pending = [oom_at]
        for step in state.steps(STEPS):
            for micro in range(MICRO):
                x = torch.randn(5, 4)  # the script's own draw, before each call

                def fb(step: int = step, micro: int = micro, x: torch.Tensor = x) -> torch.Tensor:
                    h = model[0](x)
                    if pending[0] == (step, micro):  # after the last layer's gradients landed
                        h.register_hook(lambda g: _oom(pending))
                    loss = model[2](model[1](h)).square().mean() / MICRO
                    loss.backward()
                    return loss

                state.compute(fb)
            state.step(max_grad_norm=1.0)
        return [p.detach().clone() for p in model.parameters()]


def _oom(pending: list) -> None:
    pending[0] = None
    raise torch.OutOfMemoryError("injected: mid-backward")


@pytest.mark.parametrize("oom_at", [(1, 0), (1, 2)], ids=["first-call", "last-call"])
def test_a_retried_step_equals_the_fault_free_one(monkeypatch, oom_at) -> None:
    reference = _train(monkeypatch, None)
    retried = _train(monkeypatch, oom_at)
    assert all(torch.equal(a, b) for a, b in zip(reference, retried, strict=True))
