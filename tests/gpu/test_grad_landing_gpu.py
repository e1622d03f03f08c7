"""Gradients land on their own CUDA stream (``leto.trainer.grad_landing``): each copy waits
for its gradient's producer, and the caller's stream waits for the copies at the end of
each backward pass, so the landed gradients equal plain torch's however late either side
runs. Each case stalls one side with ``torch.cuda._sleep``: a slow producer (a copy that did
not wait would read a gradient not yet written) or slow copies (a second backward pass, or
the reader after it, that did not wait would accumulate into or read a stale view)."""

from __future__ import annotations

import pytest
import torch

from leto.trainer.grad_landing import GradLanding

STALL = 50_000_000
"""GPU cycles of each stall: tens of milliseconds, far longer than the kernels around it."""


class _SlowGrad(torch.autograd.Function):
    """Identity whose backward stalls the stream before passing the gradient on."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(STALL)
        return g


class _Net(torch.nn.Module):
    def __init__(self, slow: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)
        self.slow = slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        return self.b(_SlowGrad.apply(h) if self.slow else h).square().mean()


def _inputs(micro: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(micro)
    return torch.randn(256, 512, device="cuda", generator=g)


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("stalled", ["producer", "copies"])
def test_gradients_land_on_their_stream_as_plain_torch_computes_them(
    micro_batches: int, stalled: str
) -> None:
    plain = _Net(slow=False).cuda()
    for micro in range(micro_batches):
        plain(_inputs(micro)).backward()
    want = [p.grad.clone() for p in plain.parameters()]

    net = _Net(slow=stalled == "producer").cuda()
    params = list(net.parameters())
    region = torch.full((sum(p.numel() for p in params),), float("nan"), device="cuda")
    views = [v.view_as(p) for v, p in zip(region.split([p.numel() for p in params]), params)]
    landing = GradLanding(params, views, torch.cuda.Stream())
    landing.begin()
    for micro in range(micro_batches):
        if stalled == "copies":
            with torch.cuda.stream(landing.stream):
                torch.cuda._sleep(STALL)
        net(_inputs(micro)).backward()
    got = [v.clone() for v in views]  # read on the caller's stream, before settle
    landing.settle()
    assert all(p.grad is v for p, v in zip(params, views, strict=True))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
