"""Plain data parallelism's overlapped gradient mean (``leto.trainer.grad_buckets``) on two
real gloo ranks: buckets launch while backward still runs, and every gradient ends as the
mean a flat all-reduce of torch's own gradients gives — bit for bit with two ranks, for one
backward pass or several, with a parameter one rank leaves without a gradient; to float
rounding where a step runs more passes than the previous one, or a parameter unfrozen
since the landing began lands its gradient after backward."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from leto.retained.marker import MARKER_BYTES, Marker
from leto.trainer.grad_buckets import BucketedMean
from leto.trainer.grad_landing import GradLanding, GradWrites
from leto.trainer.grad_sync import GradSync

CPU = torch.device("cpu")
DIM = 512
"""Weights of 1 MiB land at once, biases wait to land together (``grad_landing``)."""


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Linear(DIM, DIM)  # rank 0's only, in one case
        self.layers = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        if extra:
            x = self.extra(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().sum()


def _inputs(rank: int, passes: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(8, DIM, generator=g).to(device) for _ in range(passes)]


def _reference(net: _Net, xs: list[torch.Tensor], extra: bool) -> list[torch.Tensor]:
    """Torch's own gradients of the passes, averaged over the ranks by one flat all-reduce."""
    net.zero_grad(set_to_none=True)
    for x in xs:
        net(x, extra).backward()
    flat = torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
            for p in net.parameters()
        ]
    )
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    return list(flat.split([p.numel() for p in net.parameters()]))


def _case(
    rank: int,
    passes: int,
    expected: int,
    extra: bool,
    unfreeze: bool = False,
    device: torch.device = CPU,
) -> dict:
    """``unfreeze``: the last layer's weight is frozen when the landing is built and unfrozen
    before backward (gradual unfreezing: ``settle`` lands its first gradient)."""
    torch.manual_seed(0)
    net = _Net().to(device)  # its own: a landing's hooks stay on the parameters
    params = list(net.parameters())
    flat = torch.full((sum(p.numel() for p in params) + 3,), float("nan"), device=device)
    spans, start = [], 0
    for p in params:
        spans.append((start, start + p.numel()))
        start += p.numel()
    views = [flat[a:b].view(p.shape) for (a, b), p in zip(spans, params, strict=True)]
    tail = flat[start:]
    tail.fill_(float(rank))
    reduce = BucketedMean(flat[:start], spans, tail, GradSync(), overlap=True, bucket_bytes=1 << 20)
    reduce.expected = expected
    xs = _inputs(rank, passes, device)
    want = _reference(net, xs, extra)
    net.zero_grad(set_to_none=True)
    late = net.layers[-1].weight
    late.requires_grad_(not unfreeze)
    landing = GradLanding(params, views, GradWrites(flat), reduce)
    late.requires_grad_(True)
    seen = []  # after the landing's hook on the first layer's weight, which lands last
    net.layers[0].weight.register_post_accumulate_grad_hook(lambda _: seen.append(reduce.launched))
    landing.begin()
    for x in xs:
        net(x, extra).backward()
    landing.settle()
    assert reduce.finish() == passes
    got = [v.flatten().clone() for v in views]
    return {
        "exact": all(torch.equal(g, w) for g, w in zip(got, want, strict=True)),
        "close": all(
            torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want, strict=True)
        ),
        "launched_in_backward": seen,
        "buckets": len(reduce.buckets),
        "tail": tail.cpu().tolist(),
    }


def _worker(rank: int, init: str, out: mp.Queue) -> None:
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        results = {
            "one pass": _case(rank, passes=1, expected=1, extra=True),
            "first step": _case(rank, passes=1, expected=0, extra=True),
            "two passes": _case(rank, passes=2, expected=2, extra=True),
            "one more pass than expected": _case(rank, passes=2, expected=1, extra=True),
            "absent on rank 1": _case(rank, passes=1, expected=1, extra=rank == 0),
            "unfrozen": _case(rank, passes=1, expected=1, extra=True, unfreeze=True),
        }
        dist.destroy_process_group()
        out.put((rank, results))
    except BaseException:  # noqa: BLE001 - the parent reports it
        out.put((rank, traceback.format_exc()))


def test_buckets_overlap_backward_and_average_as_a_flat_all_reduce(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_worker, args=(r, init, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    for rank, r in results.items():
        assert isinstance(r, dict), f"rank {rank}:\n{r}"
        assert r["one pass"]["buckets"] > 2
        for name in ("one pass", "first step", "two passes", "absent on rank 1"):
            assert r[name]["exact"], (rank, name)
            assert r[name]["tail"] == [0.5] * 3, "the tail is averaged in finish"
        assert r["one more pass than expected"]["close"], rank
        assert r["unfrozen"]["close"], "a gradient landed after its bucket's launch is averaged"
        assert r["one pass"]["launched_in_backward"] == [True], "buckets launch during backward"
        assert r["first step"]["launched_in_backward"] == [False], "no pass is known to be last"
        assert r["two passes"]["launched_in_backward"] == [False, True], "in the last pass only"
    # rank 1 lands no gradient for `extra` (its bucket, the last launched, waits for finish
    # on rank 1, and rank 0's all-reduce of it for rank 1's): the others launch in backward
    assert results[1]["absent on rank 1"]["launched_in_backward"] == [True]


def test_the_marker_retains_the_backward_passes() -> None:
    region = torch.zeros(MARKER_BYTES, dtype=torch.uint8)
    Marker(region).record_passes(3)
    assert Marker(region).recorded_passes() == 3
