"""A step's gradients must be in retained memory when it commits: ``RetainedState`` refuses
a ``.grad`` set to None inside the step (``optimizer.zero_grad()``) or moved to other
memory, whichever way the tensor object was kept (a real trainer ``Context``,
tests/trainer/local.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from leto.errors import ScriptError
from tests.trainer.local import local_context


def _run(monkeypatch: pytest.MonkeyPatch, meddle: Callable[[torch.nn.Module], None]) -> None:
    with local_context(monkeypatch) as ctx:
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = ctx.retain(model, opt)
        x = torch.ones(3, 4)
        for step in state.steps(3):

            def fb() -> torch.Tensor:
                loss = model(x).square().mean()
                loss.backward()
                return loss

            loss = state.compute(fb)
            if step == 1:
                meddle(model)
            state.step(loss=loss)


def test_untouched_gradients_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    _run(monkeypatch, lambda m: None)


@pytest.mark.parametrize(
    ("meddle", "error", "match"),
    [
        (lambda m: m.zero_grad(set_to_none=True), ScriptError, "no longer lives in retained"),
        (  # the same object, new memory: an in-place write of the retained view (GradWrites)
            lambda m: m.weight.grad.set_(torch.zeros_like(m.weight.grad)),
            ScriptError,
            "written between backward and state.step",
        ),
    ],
    ids=["set-to-none", "moved-in-place"],
)
def test_a_gradient_out_of_retained_memory_is_refused(
    monkeypatch: pytest.MonkeyPatch,
    meddle: Callable[[torch.nn.Module], None],
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        _run(monkeypatch, meddle)
