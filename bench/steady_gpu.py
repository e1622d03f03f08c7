"""Leto's steady step against torch's, in one process, taking turns: item 3 of the steady cost.

A lent GPU's speed drifts by tens of percent within minutes (BENCHMARKS.md), more than the
fraction of a percent this measures, so two jobs run one after the other cannot tell it.
Here one process holds both loops on the same GPU and runs them in turns of ``--block``
steps, each turn timed from a synchronised start to a synchronised end, so drift hits
both alike; the ratio is taken per round (a turn of each, the order alternating) and the
median over ``--rounds`` is the result.

* ``torch``: the loop ``examples/torchrun_gpt_ckpt.py`` runs, world size one: the GPT of
  ``bench/recovery_gpu.py`` (1.1 B, bf16 autocast, fp32 weights), ``zero_grad()``,
  ``--grad-accum`` micro-batches, ``clip_grad_norm_(foreach=True)``, ``AdamW(fused=True)``;
* ``leto``: ``examples/train_gpt.py``'s loop through a real trainer ``Context`` in this
  process (a real state manager, the retained state in device regions, gradients landing
  there, the undo buffer lent to the activations, the fused update with its undo and
  parity; ``tests/trainer/local.py``'s world of one), no shadow and no agent;
* ``leto_compute_stream`` / ``leto_side_stream`` (``--other-landing``): the same trainer,
  its large gradients landing the other way than it chose, on the compute stream or on a
  side stream beside backward (``leto.trainer.grad_landing``'s ``copy_stream``);
* ``leto_unbounded`` (``--unbounded``): the same trainer, its host not waiting for the marker
  before it replaces a stateful-object record (``Marker.wait_landed``, which bounds how far
  the host runs ahead of the device). Safe only without failures: it prices that bound.

What it leaves out: a shadow's idle CUDA context on the GPU (``bench/accum_gpu.py``
measures it) and the agent's host work. A turn's last step pays its host parity copy
inside the turn where training overlaps it with the next step: against Leto.

The operating point is printed: torch's update (clip + fused AdamW, synchronised) against
its compute; the paper's is compute : update ≈ 250 (``--grad-accum 100`` on an H100).

    python3 bench/steady_gpu.py [--grad-accum 100] [--rounds 5] [--block 2] [--other-landing]
                                [--unbounded]
    python3 bench/steady_gpu.py --cpu-check       # a tiny model on the CPU, the logic only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]

from train_gpt import GPT, batch, data_steps, step_loss

from bench.gpu_timeline import busy_us, durations_by_name, gpu_activity
from leto.health import ENV_HEARTBEAT
from leto.trainer.context import Context
from tests.trainer.local import INHERITED_ENV, world_of_one

GPU_MODEL = {"vocab": 32000, "dim": 2048, "layers": 20, "heads": 16, "seq": 512, "batch": 4}
CPU_MODEL = {"vocab": 256, "dim": 32, "layers": 2, "heads": 4, "seq": 16, "batch": 4}
LR, MAX_NORM, SEED = 3e-4, 1.0, 1234
SPREAD = 0.02
"""Rounds whose leto / torch ratios spread wider than this say the card's speed drifted within
the turns (a noisy card); their median is then no measurement of a percent or two."""


@contextmanager
def leto_context() -> Iterator[Context]:
    """A rank-0 active trainer's ``Context`` in this process (``tests/trainer/local.py``):
    a real state manager, an in-memory store, no agent, no heartbeat, nothing a launched
    job's environment left."""
    for name in (*INHERITED_ENV, ENV_HEARTBEAT):
        os.environ.pop(name, None)
    with world_of_one() as ctx:
        yield ctx


class HostStalls:
    """What a turn spent outside its loop's own work: Python's garbage collections (they
    stall the host, and the device once its queue drains) and the caching allocator's
    retries and driver allocations (a retry frees the cache and waits for the device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._gc_s = 0.0
        self._gc_n = 0
        self._since = 0.0
        gc.callbacks.append(self._collect)

    def _collect(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._since = time.perf_counter()
        else:
            self._gc_s += time.perf_counter() - self._since
            self._gc_n += 1

    def _allocator(self) -> tuple[int, int]:
        if self.device.type != "cuda":
            return 0, 0
        stats = torch.cuda.memory_stats(self.device)
        return stats.get("num_alloc_retries", 0), stats.get("segment.all.allocated", 0)

    @contextmanager
    def counted(self, into: dict) -> Iterator[None]:
        gc_s, gc_n, (retries, segments) = self._gc_s, self._gc_n, self._allocator()
        yield
        now = self._allocator()
        into.update(
            gc_s=self._gc_s - gc_s,
            gc_collections=self._gc_n - gc_n,
            alloc_retries=now[0] - retries,
            segments_allocated=now[1] - segments,
        )


@contextmanager
def traced_turn(on: bool, name: str) -> Iterator[None]:
    """With ``on``: profile the turn and print where the device idled."""
    if not on:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, with_stack=True) as prof:
        yield
    with tempfile.TemporaryDirectory() as d:
        trace = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace))
        print(idle_report(name, trace), flush=True)


def idle_report(name: str, trace: Path, top: int = 10) -> str:
    """A turn's device busy and idle time (``bench.gpu_timeline``: the union of kernels and
    copies on every stream) and its longest idle gaps, each with the innermost Python frame
    or operator running on the host when the gap began."""
    acts = sorted(gpu_activity(trace), key=lambda a: a[1])
    if not acts:
        return f"{name}: no device events"
    gaps, end = [], acts[0][1]
    for _, start, dur in acts:
        if start > end:
            gaps.append((start - end, end))
        end = max(end, start + dur)
    span = end - acts[0][1]
    busy = busy_us(acts)
    frames = [
        e
        for e in json.loads(trace.read_text())["traceEvents"]
        if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op")
    ]
    head = (
        f"{name}: device span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, "
        f"idle {(span - busy) / 1e3:.1f} ms in {len(gaps)} gaps; the longest:"
    )
    lines = [head]
    for width, at in sorted(gaps, reverse=True)[:top]:
        running = [e for e in frames if e["ts"] <= at < e["ts"] + e["dur"]]
        inner = min(running, key=lambda e: e["dur"], default=None)
        outer = [e["name"] for e in sorted(running, key=lambda e: -e["dur"])][:6]
        lines.append(
            f"  {width / 1e3:7.2f} ms at +{(at - acts[0][1]) / 1e3:.1f} ms: "
            f"{inner['name'] if inner else '?'}  <  {' < '.join(reversed(outer))}"
        )
    kinds = durations_by_name((name[:70], start, dur) for name, start, dur in acts)
    lines.append("  the device's work by kernel or copy, the most first (ms, count):")
    for kind, durs in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(durs) / 1e3:9.2f} {len(durs):5d}  {kind}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grad-accum", type=int, default=54, metavar="N")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=2, help="steps per turn")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each loop first")
    ap.add_argument("--cpu-check", action="store_true", help="a tiny model on the CPU")
    ap.add_argument(
        "--dropout",
        type=float,
        default=0.1,
        help="the jobs' 0.1; at 0 both loops compute the same steps (the loops share the "
        "process's RNG, so their dropout masks differ)",
    )
    ap.add_argument(
        "--other-landing",
        action="store_true",
        help="a third loop in the turns: the same trainer, its large gradients landing the "
        "other way than it chose (on the compute stream or on a side stream: "
        "leto.trainer.grad_landing's copy_stream)",
    )
    ap.add_argument(
        "--unbounded",
        action="store_true",
        help="a loop in the turns: the same trainer, the host not waiting for the marker to "
        "land before it replaces a record (what that bound on run-ahead costs)",
    )
    ap.add_argument("--json", help="write the result here")
    ap.add_argument(
        "--idle",
        action="store_true",
        help="profile the last round (torch.profiler, Python stacks) and print each turn's "
        "device idle time and its longest idle gaps",
    )
    args = ap.parse_args()
    for flag, value in (
        ("--grad-accum", args.grad_accum),
        ("--rounds", args.rounds),
        ("--block", args.block),
    ):
        if value < 1:
            ap.exit(2, f"{ap.prog}: error: {flag} must be >= 1, got {value}\n")
    cuda = not args.cpu_check
    if cuda and not torch.cuda.is_available():
        ap.exit(2, f"{ap.prog}: error: no CUDA device (--cpu-check runs on the CPU)\n")
    if args.other_landing and not cuda:
        ap.exit(2, f"{ap.prog}: error: --other-landing needs a CUDA device\n")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    shape = GPU_MODEL if cuda else CPU_MODEL
    data = argparse.Namespace(seed=SEED, grad_accum=args.grad_accum, **shape)
    total = args.warmup + args.rounds * args.block

    def build() -> GPT:
        torch.manual_seed(SEED)
        dims = (shape["vocab"], shape["dim"], shape["layers"], shape["heads"], shape["seq"])
        return GPT(*dims, args.dropout)

    def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [batch(m, 0, data, device) for m in data_steps(step, data)]

    def forward_backward(model: GPT, micro: list) -> torch.Tensor:
        losses = []
        for x, y in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = model(x, y) / args.grad_accum
            loss.backward()
            losses.append(loss.detach())
        return step_loss(losses)

    with device:
        plain = build()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=0.1, fused=True)
    update_s: list[float] = []

    def torch_step(step: int) -> None:
        plain_opt.zero_grad()
        forward_backward(plain, micro_batches(step))
        if step < args.warmup:  # the operating point: the update alone, synchronised
            sync()
            t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(list(plain.parameters()), MAX_NORM, foreach=True)
        plain_opt.step()
        if step < args.warmup:
            sync()
            update_s.append(time.perf_counter() - t0)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    with leto_context() as ctx:
        with ctx.init_device(ctx.device):
            model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, fused=True)
        state = ctx.retain(model, opt)
        # One trainer: with --other-landing or --unbounded its Leto loops advance its steps,
        # in turn.
        shared = 1 + args.other_landing + args.unbounded
        steps = state.steps(total * shared)

        def leto_step(step: int) -> None:
            got = next(steps)
            assert shared > 1 or got == step, (got, step)
            micro = micro_batches(got)
            loss = state.compute(lambda: forward_backward(model, micro))
            state.step(max_grad_norm=MAX_NORM, loss=loss)

        loops: dict[str, Callable[[int], None]] = {"torch": torch_step, "leto": leto_step}
        if args.other_landing:
            landing = state._landing  # the bench flips the trainer's landing between turns
            assert landing is not None
            chosen = landing.copy_stream
            other = torch.cuda.Stream(device) if chosen is None else None

            def leto_other_step(step: int) -> None:
                landing.copy_stream = other  # no copy is in flight between steps
                try:
                    leto_step(step)
                finally:
                    landing.copy_stream = chosen

            other_name = "leto_compute_stream" if other is None else "leto_side_stream"
            loops[other_name] = leto_other_step
        if args.unbounded:
            marker = state.marker

            def leto_unbounded_step(step: int) -> None:
                marker.wait_landed = lambda phase, step: None  # the instance's, for this step
                try:
                    leto_step(step)
                finally:
                    del marker.wait_landed

            loops["leto_unbounded"] = leto_unbounded_step
        letos = [name for name in loops if name != "torch"]
        compute_s = []
        for step in range(args.warmup):
            for name, run in loops.items():
                sync()
                t0 = time.perf_counter()
                run(step)
                sync()
                if name == "torch":
                    compute_s.append(time.perf_counter() - t0 - update_s[-1])
        rounds = []
        stalls = HostStalls(device)
        step = args.warmup
        for r in range(args.rounds):
            order = list(loops) if r % 2 == 0 else list(reversed(loops))
            turn: dict = {}
            traced = args.idle and r == args.rounds - 1
            for name in order:
                turn[f"{name}_stalls"] = {}
                with traced_turn(traced, name), stalls.counted(turn[f"{name}_stalls"]):
                    sync()
                    t0 = time.perf_counter()
                    for k in range(args.block):
                        loops[name](step + k)
                    sync()
                    turn[name] = (time.perf_counter() - t0) / args.block
            step += args.block
            ratios = {name: turn[name] / turn["torch"] for name in letos}
            rounds.append({"order": order, **turn, "ratios": ratios})
            odd = {
                f"{name} {key}": value
                for name in loops
                for key, value in turn[f"{name}_stalls"].items()
                if value and (key != "gc_s" or value > 1e-3)
            }
            times = ", ".join(f"{name} {turn[name] * 1e3:.1f} ms" for name in loops)
            shown = ", ".join(f"{name} {ratios[name]:.4f}" for name in letos)
            print(
                f"round {r + 1}/{args.rounds} ({order[0]} first): {times} per step; "
                f"ratio to torch: {shown}" + (f"  {odd}" if odd else ""),
                flush=True,
            )
        try:  # the generator's end: the job's last step drained
            next(steps)
        except StopIteration:
            pass
        apart = (
            None  # Leto's trainer trained all its loops' steps
            if shared > 1
            else max(
                (a.detach() - b.detach()).abs().max().item()
                for a, b in zip(plain.parameters(), model.parameters(), strict=True)
            )
        )
    medians = {name: statistics.median(r["ratios"][name] for r in rounds) for name in letos}
    ratio = medians["leto"]
    spread = max(r["ratios"]["leto"] for r in rounds) - min(r["ratios"]["leto"] for r in rounds)
    means = {name: statistics.fmean(r[name] for r in rounds) for name in loops}
    point = min(compute_s) / min(update_s)
    print(
        f"operating point: torch compute {min(compute_s) * 1e3:.1f} ms, update (clip + fused AdamW) "
        f"{min(update_s) * 1e3:.2f} ms, compute : update {point:.0f}"
    )
    print(
        f"leto / torch (AdamW fused=True), {args.grad_accum} micro-batches, default kernels, "
        f"median of {args.rounds} rounds: {ratio:.4f} ({100 * (ratio - 1):+.2f} %); "
        f"ratio of the mean steps {means['leto'] / means['torch']:.4f}"
    )
    print(
        f"the rounds' leto / torch ratios spread {100 * spread:.2f} points"
        + (
            ": more than the 2 the median needs; the turns' speeds drifted apart, so this "
            "card measured nothing at this resolution"
            if spread > SPREAD
            else ""
        )
    )
    if args.other_landing:
        other_ratio = medians[other_name]
        print(
            f"{other_name} / torch: {other_ratio:.4f} ({100 * (other_ratio - 1):+.2f} %); "
            f"{other_name} / leto as it chose (landing on "
            f"{'a side' if chosen is not None else 'the compute'} stream), median of the "
            f"rounds: {statistics.median(r[other_name] / r['leto'] for r in rounds):.4f}"
        )
    if args.unbounded:
        free = medians["leto_unbounded"]
        print(
            f"leto_unbounded / torch: {free:.4f} ({100 * (free - 1):+.2f} %); leto / "
            "leto_unbounded (the bound on run-ahead), median of the rounds: "
            f"{statistics.median(r['leto'] / r['leto_unbounded'] for r in rounds):.4f}"
        )
    if apart is not None:
        print(
            f"the two models after {total} steps: max |leto - torch| {apart:.3g} "
            "(0 on the CPU at --dropout 0; on a GPU Leto's fused AdamW rounds otherwise)"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "kernels": "default",
            "model": shape,
            "grad_accum": args.grad_accum,
            "block": args.block,
            "compute_update_ratio": point,
            "rounds": rounds,
            "ratio": ratio,
            "spread": spread,
            "ratio_of_means": means["leto"] / means["torch"],
            "median_ratios": medians,
            "dropout": args.dropout,
            "max_param_difference": apart,
        }
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
