"""Large gradients land on a side stream on a GPU (``leto.trainer.grad_landing.SideCopies``):
each step's gradients equal plain torch's bit for bit, also when the side stream runs late
(a sleep queued before each copy: the backward's end must order the current stream after
it), and a parameter with a post-accumulate hook of the script's, which reads and doubles
its gradient in place, lands on the current stream instead."""

from __future__ import annotations

import pytest
import torch

from leto.trainer import grad_landing
from leto.trainer.grad_landing import GradLanding, GradWrites

STEPS = 3


class Wide(torch.nn.Module):
    """Three 4 MiB weights (copied as they arrive) and small biases (waiting)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x).tanh()
        return x.square().mean()


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(64, 1024, generator=g).cuda()


def _doubled(model: torch.nn.Module) -> None:
    def hook(p: torch.Tensor) -> None:
        assert p.grad is not None
        p.grad.mul_(2)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)


def _train(model: torch.nn.Module, landing: GradLanding | None) -> list[list[torch.Tensor]]:
    """Each step's gradients; SGD by hand, so the steps differ."""
    params = list(model.parameters())
    out = []
    for step in range(STEPS):
        if landing is not None:
            landing.begin()
        else:
            for p in params:
                p.grad = None
        model(_batch(step)).backward()
        if landing is not None:
            landing.settle()
        out.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        with torch.no_grad():
            for p in params:
                p.sub_(0.1 * p.grad)  # type: ignore[operator]
    torch.cuda.synchronize()
    return out


def _landed(model: torch.nn.Module) -> GradLanding:
    params = list(model.parameters())
    sizes = [-(-p.numel() * p.element_size() // 256) * 256 for p in params]
    region = torch.zeros(sum(sizes), dtype=torch.uint8, device="cuda")
    views, at = [], 0
    for p, n in zip(params, sizes, strict=True):
        views.append(region[at : at + p.numel() * p.element_size()].view(p.dtype).view(p.shape))
        at += n
    return GradLanding(params, views, GradWrites(region))


@pytest.mark.parametrize("script_hook", [False, True])
def test_large_gradients_land_on_the_side_stream_as_plain_torch_computes_them(
    monkeypatch: pytest.MonkeyPatch, script_hook: bool
) -> None:
    plain_model = Wide().cuda()
    if script_hook:
        _doubled(plain_model)
    plain = _train(plain_model, None)

    side_copies: list[int] = []
    copy = grad_landing.SideCopies.copy

    def late(self: grad_landing.SideCopies, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms: the current stream reads long before
        side_copies.append(dst.numel())
        copy(self, dst, src)

    monkeypatch.setattr(grad_landing.SideCopies, "copy", late)
    model = Wide().cuda()
    landing = _landed(model)
    if script_hook:
        _doubled(model)
    got = _train(model, landing)
    for step, (g, w) in enumerate(zip(got, plain, strict=True)):
        for a, b in zip(g, w, strict=True):
            assert torch.equal(a, b), f"step {step}"
    # the three weights per step on the side stream, unless the script hooks them
    assert side_copies == ([] if script_hook else [1024 * 1024] * 3 * STEPS)
