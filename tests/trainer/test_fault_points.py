"""The fault injector's forward and backward kill points, placed by a real trainer
(``RetainedState._install_fault_hooks``, in process: a kill raises instead of SIGKILL):
on a model returning a mapping (a Hugging Face ``ModelOutput``) and on a model compiled
whole, whose only hook site is its compiled wrapper (``leto.compiled.hook_sites``)."""

from __future__ import annotations

import pytest
import torch

from tests.dynamo_backend import CountingBackend
from tests.trainer.local import local_context
from tests.updater.rig import Killed, _raise


class _Net(torch.nn.Module):
    """Returns ``{"loss": ..., "logits": ...}``, as ``LlamaForCausalLM`` does."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.out(torch.relu(self.inp(x)))
        return {"loss": logits.square().mean(), "logits": logits}


def _killed_at(monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module, phase: str) -> str:
    """Train until the kill at step 1's ``phase``; where it came: "forward" or "backward"."""
    with local_context(monkeypatch) as ctx:
        ctx.injector.stop = _raise
        ctx.injector.fail_at(0, 1, phase)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = ctx.retain(model, opt)
        for step in state.steps(3):
            where = "forward"
            try:
                out = model(torch.full((2, 4), float(step + 1)))
                where = "backward"
                out["loss"].backward()
            except Killed:
                assert step == 1
                return where
            state.step(loss=out["loss"])
    return "never"


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_kill_points_of_a_model_returning_a_mapping(monkeypatch, phase) -> None:
    assert _killed_at(monkeypatch, _Net(), phase) == phase


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_the_kill_points_of_a_model_compiled_whole(monkeypatch, phase) -> None:
    torch._dynamo.reset()
    try:
        model = torch.compile(_Net(), backend=CountingBackend())
        assert _killed_at(monkeypatch, model, phase) == phase
    finally:
        torch._dynamo.reset()
