"""Leto's Triton AdamW on the GPU leaves a parameter without a gradient alone (its ``SKIP``
row, ``leto.retained.presence``): a branch taken on even steps only and a frozen parameter
left in the optimizer, against torch's fused AdamW on the same device (the same update to
float rounding; the frozen parameter bit for bit unchanged). The CPU twin, under the Triton
interpreter: tests/trainer/test_unused_params.py."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.local import local_context
from tests.trainer.test_unused_params import STEPS, Branchy, X


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def test_the_fused_kernel_skips_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    device = torch.device("cuda")
    x = X.to(device)
    ref = Branchy().to(device)
    ref_opt = _adamw(list(ref.parameters()))
    for step in range(STEPS):
        ref_opt.zero_grad()
        ref(x, step).backward()
        ref_opt.step()
    with local_context(monkeypatch, rmu_fused=True) as ctx:
        net = Branchy().to(device)
        state = ctx.retain(net, _adamw(list(net.parameters())))
        for step in state.steps(STEPS):
            state.compute(lambda step=step: net(x, step).backward())
            state.step()
        torch.cuda.synchronize()
        for a, b in zip(ref.parameters(), net.parameters(), strict=True):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert torch.equal(net.frozen.cpu(), Branchy().frozen)
