"""Iteration time split into compute and update per consistency mode (paper Table 1).

One model whose params, grads and AdamW state live in flat "retained" buffers, protected by
two-tier parity (device data, host parity). The modes take turns iteration by iteration on
that one state (same run, same machine state). Compute = forward + backward + clip;
update = what each mode does after the gradients are final:

* ``reference``: ``optimizer.step()`` (torch foreach AdamW, or ``--optimizer``'s), no parity,
  no crash consistency;
* ``snapshot``: sync snapshot: copy the state to host, ``optimizer.step()``, re-encode parity;
* ``rmu``: the resumable updater, unfused (undo copy + foreach AdamW per chunk, incremental
  parity, commits), its undo / working-parity buffers borrowed from activation memory; with
  an ``--optimizer`` other than AdamW, the optimizer's own step per chunk of whole parameters
  (``leto.updater.torch_step``);
* ``rmu-fused``: the same with the fused Triton chunk kernel (CUDA only);
* ``rmu-fused-dedicated`` (CUDA): the fused RMU with buffers held for the whole run, to show
  what borrowing saves in peak memory.

Borrowing: the buffers are allocated after backward (the activations are free then) and
released before the next forward, so the caching allocator serves them from activation
blocks; ``ResumableUpdater.bind_buffers`` points the updater at them. Peak device memory
(``max_memory_allocated`` / ``max_memory_reserved`` per iteration) is reported per mode.

Before timing, one update from the same state and gradients is run three ways: reference,
rmu (must be bit-identical) and rmu-fused (float rounding; max difference reported).
Timing: CUDA events around compute and update, a synchronisation per iteration, warm-up
iterations excluded; medians (``--stat min``: minima, on a shared machine). "update" ends
where the trainer's next step could start; on
CUDA the RMU's flush leaves its host copies running on a copy stream (they overlap the next
step's compute in training), timed alone as "flush tail" after the update and not added to
the total (the total holds if the next compute is longer than the tail). The last line is
the RMU overhead ratio against reference.

    python bench/update_overhead.py --iters 10                      # CPU, small GPT
    python bench/update_overhead.py --iters 10 --optimizer sgd      # any examples/train_gpt.py --optimizer
    python bench/update_overhead.py --device cuda --preset h200 --json $OUT/update_overhead_gpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from leto.erasure import ErasureConfig, ProtectionGroup, padded_bytes, plan_groups
from leto.retained.layout import Layout
from leto.retained.marker import MARKER_BYTES, Marker, Phase
from leto.retained.optim_state import StateSlots
from leto.updater.rmu import ResumableUpdater, buffer_bytes

PRESETS = {
    # ~1.34 B params: 5.4 GB fp32 master weights, 21.5 GB of params + grads + AdamW state
    "h200": {
        "vocab": 32768,
        "dim": 2048,
        "layers": 24,
        "heads": 16,
        "seq": 1024,
        "batch": 8,
        "chunk_bytes": 64 << 20,
        "page_bytes": 2 << 20,
        "data_pages": 1024,
        "iters": 5,
        "warmup": 2,
    },
    "tiny": {
        "vocab": 256,
        "dim": 64,
        "layers": 2,
        "heads": 4,
        "seq": 32,
        "batch": 4,
        "chunk_bytes": 1 << 16,
        "page_bytes": 4096,
        "data_pages": 16,
        "iters": 3,
        "warmup": 1,
        "tier1_parity": 4,
    },
}
LR = 1e-3


class _NoFaults:
    def point(self, *_: object, **__: object) -> None:
        return None

    def scheduled(self, *_: object, **__: object) -> bool:
        return False


def _gpt_module():  # examples/ is not a package
    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


class Bench:
    """The retained state of one trainer and one updater per RMU mode."""

    def __init__(
        self, args: argparse.Namespace, erasure: ErasureConfig | None, device: torch.device
    ) -> None:
        self.args, self.device, self.cuda = args, device, device.type == "cuda"
        torch.manual_seed(args.seed)
        gpt = _gpt_module()
        with device:
            self.model = gpt.GPT(
                args.vocab,
                args.dim,
                args.layers,
                args.heads,
                args.seq,
                0.0,
                bias=args.optimizer != "muon",
            )
        self.opt = gpt.OPTIMIZERS[args.optimizer](self.model, LR)
        params = list(self.model.parameters())
        self.layout = lay = Layout.plan(params, [], self.opt)
        nbytes = padded_bytes(lay.state_bytes, erasure) if erasure is not None else lay.state_bytes
        self.state = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.grads = torch.zeros(lay.grad_bytes, dtype=torch.uint8, device=device)
        lay.grad_scale.view(self.grads).fill_(1.0)  # the fused kernel's factor: no clipping
        for p, ps, gs in zip(params, lay.params, lay.grads, strict=True):
            data = ps.view(self.state)
            data.copy_(p.detach())
            torch.utils.swap_tensors(p, torch.nn.Parameter(data))
            p.grad = gs.view(self.grads)
        self.slots = StateSlots(
            self.opt.state, params, lay.optim, self.state
        )  # as a trainer binds them
        self.slots.capture()
        pin = self.cuda
        self.groups: list[ProtectionGroup] = []
        if erasure is not None:
            pb, h1, h2 = erasure.page_bytes, erasure.tier1_parity, erasure.tier2_parity
            spans = plan_groups(nbytes, erasure)
            p1 = torch.zeros(len(spans) * h1 * pb, dtype=torch.uint8, pin_memory=pin)
            p2 = torch.zeros(len(spans) * h2 * pb, dtype=torch.uint8, pin_memory=pin)
            self.groups = [
                ProtectionGroup(
                    erasure,
                    self.state[s.byte_offset : s.byte_offset + s.nbytes],
                    p1[i * h1 * pb : (i + 1) * h1 * pb],
                    p2[i * h2 * pb : (i + 1) * h2 * pb],
                )
                for i, s in enumerate(spans)
            ]
        for g in self.groups:
            g.encode_all()
        self.snapshot = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.marker = Marker(torch.zeros(MARKER_BYTES, dtype=torch.uint8))
        self.marker.initialise(lay.digest)
        self.rng_next = torch.get_rng_state().clone()
        self.erasure, self.nbytes = erasure, nbytes
        self.updaters: dict[str, ResumableUpdater] = {}
        self.sizes: dict[str, tuple[int, int]] = {}
        kernel = lay.rule.kind == "adamw" and (
            self.cuda or os.environ.get("TRITON_INTERPRET") == "1"
        )
        for fused in (False, True) if kernel else (False,):
            undo, par = self.sizes["fused" if fused else "unfused"] = buffer_bytes(
                lay, nbytes, args.chunk_bytes, erasure, fused=fused
            )
            self.updaters["fused" if fused else "unfused"] = ResumableUpdater(
                layout=lay,
                state=self.state,
                grads=self.grads,
                rng_next=self.rng_next,
                optimizer=self.opt,
                marker=self.marker,
                undo=self._buf(undo),
                parity=self._buf(par) if par else None,
                protected=SimpleNamespace(cfg=erasure, groups=self.groups) if erasure else None,  # type: ignore[arg-type]
                injector=_NoFaults(),
                chunk_bytes=args.chunk_bytes,
                fused=fused,  # type: ignore[arg-type]
            )
        self.dedicated: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _buf(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8, device=self.device)

    def compute(self, step: int) -> None:
        a = self.args
        g = torch.Generator().manual_seed(step)
        self.grads.zero_()
        amp = (
            torch.autocast("cuda", dtype=torch.bfloat16) if self.cuda else contextlib.nullcontext()
        )
        for _ in range(
            a.micro_batches
        ):  # gradient accumulation: one optimizer step per global batch
            data = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(self.device)
            with amp:
                loss = self.model(data[:, :-1], data[:, 1:]) / a.micro_batches
            loss.backward()
            del loss
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)

    def update(self, mode: str) -> ResumableUpdater | None:
        """One update in ``mode``; returns the RMU whose flush may still be copying."""
        m = self.marker
        m.record_lrs([LR])
        m.advance(Phase.GRADS_READY)
        if mode in ("reference", "snapshot"):
            m.advance(Phase.UPDATING)
            if mode == "snapshot":  # what RetainedState's snapshot path does around the step
                self.snapshot.copy_(self.state)
                self.slots.read_flags()
                self.slots.bind()
            self.opt.step()
            if mode == "snapshot" or not all(
                self.slots.present
            ):  # state torch made lazily, into its slots
                self.slots.adopt(range(len(self.slots.params)))
            if mode == "snapshot":
                for g in self.groups:
                    g.encode_all()
            m.advance(Phase.IDLE, m.step + 1)
            return None
        up = self.updaters["fused" if mode.startswith("rmu-fused") else "unfused"]
        undo_n, par_n = self.sizes["fused" if mode.startswith("rmu-fused") else "unfused"]
        if mode.endswith("dedicated"):
            if mode not in self.dedicated:
                self.dedicated[mode] = (self._buf(undo_n), self._buf(par_n) if par_n else None)  # type: ignore[assignment]
            up.bind_buffers(*self.dedicated[mode])
            up.run(m.step)
            return up
        # borrowed: served from the activation blocks backward just freed, released after
        undo = torch.empty(undo_n, dtype=torch.uint8, device=self.device)
        parity = torch.empty(par_n, dtype=torch.uint8, device=self.device) if par_n else None
        up.bind_buffers(undo, parity)
        up.run(m.step)
        del undo, parity
        return up

    def check(self) -> dict[str, object]:
        """One update from the same state and gradients: reference vs rmu vs rmu-fused."""
        self.compute(10_000)
        saved, word = self.state.clone(), self.marker.word
        out: dict[str, object] = {}
        ref = None
        for mode in ["reference", "rmu"] + (["rmu-fused"] if "fused" in self.updaters else []):
            self.state.copy_(saved)
            self.marker._words[2] = word
            self.slots.read_flags()
            self.slots.bind()
            self.update(mode)
            if mode == "reference":
                ref = self.state.clone()
            elif mode == "rmu":
                out["rmu_equals_reference"] = bool(
                    torch.equal(_slots(self.layout, self.state), _slots(self.layout, ref))
                )
            else:
                same, total, worst = 0, 0, 0.0
                for x, y in zip(
                    _floats(self.layout, ref), _floats(self.layout, self.state), strict=True
                ):
                    same += int((x == y).sum())
                    total += x.numel()
                    worst = max(worst, float((x - y).abs().max()))
                out["fused_bit_identical"] = same == total
                out["fused_equal_fraction"] = same / total
                out["fused_max_abs_diff"] = worst
        del ref
        self.state.copy_(saved)
        self.marker._words[2] = word
        self.slots.read_flags()
        self.slots.bind()
        for g in self.groups:
            g.encode_all()
        return out


def _slots(lay: Layout, state: torch.Tensor) -> torch.Tensor:
    """Bytes of every param and AdamW state slot (not the RNG slot, which only rmu writes)."""
    return torch.cat(
        [
            s.view(state).flatten().view(torch.uint8)
            for i in range(len(lay.params))
            for s in (lay.params[i], *lay.optim[i].values())
        ]
    )


def _floats(lay: Layout, state: torch.Tensor) -> list[torch.Tensor]:
    """Views of every param, exp_avg and exp_avg_sq slot."""
    return [
        s.view(state).flatten()
        for i in range(len(lay.params))
        for s in (lay.params[i], lay.optim[i]["exp_avg"], lay.optim[i]["exp_avg_sq"])
    ]


class Timer:
    """Elapsed seconds between marks: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> object:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a: object, b: object) -> float:
        if self.cuda:
            return a.elapsed_time(b) / 1e3  # type: ignore[attr-defined]
        return b - a  # type: ignore[operator]


def _profile(b: Bench, mode: str, trace: Path) -> None:
    """One update of ``mode`` under torch.profiler: where the update's time goes."""
    from torch.profiler import ProfilerActivity, profile

    b.compute(20_000)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.cuda else [])
    if b.cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        b.update(mode)
        if b.cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    key = "self_device_time_total" if b.cuda else "self_cpu_time_total"
    events = prof.key_averages()
    busy = sum(getattr(e, key) for e in events) / 1e6 if b.cuda else None
    print(
        f"profile {mode}: wall {1e3 * wall:.1f} ms (profiled)"
        + (
            f", device busy {1e3 * busy:.1f} ms (sum of kernels and copies)"
            if busy is not None
            else ""
        )
    )
    print(events.table(sort_by=key, row_limit=20, max_name_column_width=60))
    prof.export_chrome_trace(str(trace))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--preset", choices=sorted(PRESETS), help="model and erasure sizes (flags below override)"
    )
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="forward+backward passes of --batch sequences per optimizer step (gradient accumulation)",
    )
    p.add_argument("--chunk-bytes", type=int, default=None)
    p.add_argument("--page-bytes", type=int, default=None)
    p.add_argument("--data-pages", type=int, default=None)
    p.add_argument("--tier1-parity", type=int, default=None)
    p.add_argument("--tier2-parity", type=int, default=None)
    p.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="per-mode statistic over the iterations (min: on a machine shared with other work)",
    )
    p.add_argument(
        "--no-erasure",
        action="store_true",
        help="no parity: snapshot = copy + step, rmu = undo copies + chunked step + commits",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--optimizer",
        default="adamw",
        help="examples/train_gpt.py's --optimizer (adamw, sgd, rmsprop, nadam, adam-amsgrad, muon)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--profile",
        default="",
        help="comma-separated modes: after timing, one update of each under torch.profiler "
        "(kernel table, host vs device time, chrome trace beside the json)",
    )
    p.add_argument(
        "--modes",
        default="",
        help="comma-separated modes to time (default: all; reference is always timed, it is the baseline)",
    )
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        help="default: $OUT/update_overhead[_gpu].json, else bench/results/",
    )
    args = p.parse_args()
    defaults = {
        "vocab": 1024,
        "dim": 128,
        "layers": 4,
        "heads": 4,
        "seq": 64,
        "batch": 8,
        "chunk_bytes": 1 << 20,
        "page_bytes": 65536,
        "data_pages": 64,
        "iters": 10,
        "warmup": 2,
        "tier1_parity": 16,
        "tier2_parity": 1,
    }
    defaults.update(PRESETS.get(args.preset or "", {}))
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.micro_batches < 1:
        sys.exit(f"update_overhead: --micro-batches must be >= 1, got {args.micro_batches}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("update_overhead: --device cuda but no CUDA device is visible")
    if device.type not in ("cpu", "cuda"):
        sys.exit(f"update_overhead: --device must be cpu or cuda, got {args.device!r}")
    cuda = device.type == "cuda"
    if args.json is None:
        name = "update_overhead" + ("" if args.optimizer == "adamw" else f"_{args.optimizer}")
        name += "_gpu.json" if cuda else ".json"
        args.json = (
            Path(os.environ["OUT"]) / name
            if os.environ.get("OUT")
            else REPO / "bench" / "results" / name
        )
    torch.set_num_threads(args.threads)
    erasure = (
        None
        if args.no_erasure
        else ErasureConfig(
            page_bytes=args.page_bytes,
            data_pages=args.data_pages,
            tier1_parity=args.tier1_parity,
            tier2_parity=args.tier2_parity,
        )
    )
    t0 = time.perf_counter()
    b = Bench(args, erasure, device)
    modes = ["reference", "snapshot", "rmu"] + (["rmu-fused"] if "fused" in b.updaters else [])
    if cuda:
        modes.append("rmu-fused-dedicated")
    if args.modes:
        wanted = {m.strip() for m in args.modes.split(",") if m.strip()} | {"reference"}
        unknown = wanted - set(modes)
        if unknown:
            sys.exit(
                f"update_overhead: unknown or unavailable --modes {sorted(unknown)} (have {modes})"
            )
        modes = [m for m in modes if m in wanted]
    check = b.check()
    setup_s = time.perf_counter() - t0
    timer = Timer(cuda)
    times = {
        m: {"compute": [], "update": [], "tail": [], "peak_alloc": [], "peak_reserved": []}
        for m in modes
    }
    for it in range(args.warmup + args.iters):
        for m in modes:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            e0 = timer.mark()
            b.compute(it)
            e1 = timer.mark()
            up = b.update(m)
            e2 = timer.mark()
            if up is not None:  # the flush's host copies left on the copy stream (they overlap
                up.join()  # the next step's compute in training; here they are timed alone)
            e3 = timer.mark()
            if cuda:
                torch.cuda.synchronize()
            if it >= args.warmup:
                times[m]["compute"].append(timer.seconds(e0, e1))
                times[m]["update"].append(timer.seconds(e1, e2))
                times[m]["tail"].append(timer.seconds(e2, e3))
                if cuda:
                    times[m]["peak_alloc"].append(torch.cuda.max_memory_allocated())
                    times[m]["peak_reserved"].append(torch.cuda.max_memory_reserved())
    stat = min if args.stat == "min" else statistics.median
    lay = b.layout
    n_params = sum(p.numel() for p in b.model.parameters())
    print(
        f"device {device}{' (' + torch.cuda.get_device_name() + ')' if cuda else ''}; {args.optimizer} "
        f"({lay.rule.reason}); model {n_params / 1e6:.1f} M params, "
        f"state {lay.state_bytes / 2**30:.2f} GiB; chunk {args.chunk_bytes >> 10} KiB; "
        + (
            "no erasure; "
            if erasure is None
            else f"erasure {args.page_bytes >> 10} KiB pages, D={args.data_pages}, "
            f"H1={args.tier1_parity}, H2={args.tier2_parity}; "
        )
        + f"{args.micro_batches} x {args.batch} sequences per step; {args.iters} iterations after {args.warmup} warm-up; setup {setup_s:.1f} s"
    )
    print(f"check: {check}")
    print(
        f"{'mode':<21}{'compute ms':>11}{'update ms':>11}{'total ms':>10}{'vs ref':>9}{'peak GiB':>10}{'reserved GiB':>13}"
        f"{'flush tail ms':>14}"
    )
    rows: dict[str, dict[str, float | None]] = {}
    base = None
    for m in modes:
        c, u = stat(times[m]["compute"]), stat(times[m]["update"])
        total = c + u
        base = base or total
        pa = max(times[m]["peak_alloc"]) / 2**30 if cuda else None
        pr = max(times[m]["peak_reserved"]) / 2**30 if cuda else None
        tail = stat(times[m]["tail"])
        rows[m] = {
            "compute_ms": 1e3 * c,
            "update_ms": 1e3 * u,
            "total_ms": 1e3 * total,
            "flush_tail_ms": 1e3 * tail,
            "overhead": total / base - 1,
            "peak_alloc_gib": pa,
            "peak_reserved_gib": pr,
        }
        mem = f"{pa:>10.2f}{pr:>13.2f}" if cuda else f"{'-':>10}{'-':>13}"
        print(
            f"{m:<21}{1e3 * c:>11.1f}{1e3 * u:>11.1f}{1e3 * total:>10.1f}{100 * (total / base - 1):>+8.2f}%{mem}"
            f"{1e3 * tail:>14.1f}"
        )
    undo_n, par_n = b.sizes["unfused"]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.platform(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "params": n_params,
        "optimizer": args.optimizer,
        "update_rule": lay.rule.kind,
        "state_bytes": lay.state_bytes,
        "rmu_buffer_bytes": {"undo": undo_n, "parity": par_n},
        "args": {k: str(v) for k, v in vars(args).items()},
        "check": check,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(
        f"rmu buffers: undo {undo_n / 2**20:.1f} MiB + working parity {par_n / 2**20:.1f} MiB; json {args.json}"
    )
    for m in filter(None, args.profile.split(",")):
        _profile(b, m, args.json.with_name(f"{args.json.stem}_{m}_trace.json"))
    best = next((m for m in ("rmu-fused", "rmu") if m in rows), modes[-1])
    print(
        f"RMU overhead ratio ({best} total / reference total): {rows[best]['total_ms'] / rows['reference']['total_ms']:.4f}"
    )


if __name__ == "__main__":
    main()
