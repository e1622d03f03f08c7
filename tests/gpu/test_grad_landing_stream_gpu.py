"""Gradients landing on a side stream (``GradLanding(copy_stream=...)``): every view holds
its gradient when backward ends, even where the copy stream runs far behind the compute
stream, a later pass of the step accumulates onto the landed values, the copies in flight
hold one fresh gradient more at most, and the trainer on CUDA lands this way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leto.trainer.grad_landing import SMALL_GRAD_BYTES, GradLanding, GradWrites
from tests.trainer.local import local_context

DEVICE = torch.device("cuda", 0)


def _net() -> nn.Module:
    torch.manual_seed(0)
    # 512 x 1024 fp32 weights: 2 MiB each, above SMALL_GRAD_BYTES (they land one by one)
    return nn.Sequential(*[nn.Linear(1024, 1024 if i < 3 else 512) for i in range(4)]).to(DEVICE)


def _landing(net: nn.Module, stream: torch.cuda.Stream | None) -> tuple[GradLanding, list]:
    params = list(net.parameters())
    region = torch.zeros(sum(p.numel() for p in params), device=DEVICE)
    views, at = [], 0
    for p in params:
        views.append(region[at : at + p.numel()].view_as(p))
        at += p.numel()
    return GradLanding(params, views, GradWrites(region), copy_stream=stream), views


def _passes(net: nn.Module, landing: GradLanding, passes: int, stall: torch.cuda.Stream | None):
    landing.begin()
    for k in range(passes):
        x = torch.randn(64, 1024, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(k))
        if stall is not None:  # the copy stream starts ~50 ms behind: a copy not waited for shows
            with torch.cuda.stream(stall):
                torch.cuda._sleep(100_000_000)
        net(x).square().mean().backward()
        # read every gradient on the compute stream at once, before the host waits for anything
        seen = [p.grad.clone() for p in net.parameters()]
    landing.settle()
    torch.cuda.synchronize()
    return seen


def test_side_stream_landing_matches_the_compute_stream_landing() -> None:
    assert any(p.numel() * 4 >= SMALL_GRAD_BYTES for p in _net().parameters())
    for passes in (1, 3):
        net = _net()
        plain, plain_views = _landing(net, None)
        want = _passes(net, plain, passes, None)
        want_views = [v.clone() for v in plain_views]

        net = _net()
        stream = torch.cuda.Stream(DEVICE)
        side, side_views = _landing(net, stream)
        got = _passes(net, side, passes, stream)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)
        for a, b, p in zip(want_views, side_views, net.parameters(), strict=True):
            assert torch.equal(a, b)
            assert p.grad is b  # each parameter's .grad is its retained view


@pytest.mark.parametrize("registered", ["after", "before"])
def test_a_scripts_hook_reads_the_gradient_it_would_without_the_stream(registered: str) -> None:
    """A post-accumulate hook of the script's registered after Leto's runs right after the
    landing: that gradient lands on the compute stream, so the hook reads its value. One
    registered before Leto's (before ``retain()``) reads the fresh gradient, and the copy
    may go to the side stream."""
    read: dict[str, list[torch.Tensor]] = {"plain": [], "side": []}
    views = {}
    for name, stream in (("plain", None), ("side", torch.cuda.Stream(DEVICE))):
        net = _net()

        def hook(q: torch.Tensor, got: list = read[name]) -> None:
            got.append(q.grad.clone())

        if registered == "before":
            for p in net.parameters():
                p.register_post_accumulate_grad_hook(hook)
        landing, views[name] = _landing(net, stream)
        if registered == "after":
            for p in net.parameters():
                p.register_post_accumulate_grad_hook(hook)
        _passes(net, landing, 1, stream)
    assert len(read["side"]) == len(list(_net().parameters()))
    for a, b in zip(read["plain"], read["side"], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(views["plain"], views["side"], strict=True):
        assert torch.equal(a, b)


def test_the_side_stream_holds_one_fresh_gradient_more_at_most() -> None:
    """A copy's source is released once the next large gradient arrives, even while the
    copy stream runs far behind: the peak grows by the largest gradient, not by all of them."""

    def peak(stream: torch.cuda.Stream | None) -> tuple[int, int]:
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to(DEVICE)
        landing, _ = _landing(net, stream)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(DEVICE)
        before = torch.cuda.memory_allocated(DEVICE)
        _passes(net, landing, 1, stream)
        largest = max(p.numel() * p.element_size() for p in net.parameters())
        return torch.cuda.max_memory_allocated(DEVICE) - before, largest

    plain, largest = peak(None)
    side, _ = peak(torch.cuda.Stream(DEVICE))
    assert side <= plain + largest, (side, plain, largest)


def _trained(side_stream: bool, monkeypatch) -> list[torch.Tensor]:
    """Four steps of a trainer on the GPU (world of one, Leto's fused AdamW, clipping), its
    large gradients landing on the stream the trainer chose or, if not ``side_stream``,
    on the compute stream."""
    with local_context(monkeypatch) as ctx:
        with ctx.init_device(ctx.device):
            torch.manual_seed(0)
            net = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
        state = ctx.retain(net, torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True))
        assert state._landing is not None and state._landing.copy_stream is not None
        if not side_stream:
            state._landing.copy_stream = None
        for step in state.steps(4):
            x = torch.randn(
                64, 1024, device=ctx.device, generator=torch.Generator(ctx.device).manual_seed(step)
            )
            state.compute(lambda x=x: net(x).square().mean().backward())
            state.step(max_grad_norm=0.5)
        return [p.detach().clone() for p in net.parameters()]


def test_the_trainer_lands_on_a_side_stream_and_trains_the_same(monkeypatch) -> None:
    """On CUDA the trainer passes a stream of its own; the weights it trains are the ones the
    compute-stream landing trains, bit for bit."""
    side = _trained(True, monkeypatch)
    plain = _trained(False, monkeypatch)
    for a, b in zip(side, plain, strict=True):
        assert torch.equal(a, b)
