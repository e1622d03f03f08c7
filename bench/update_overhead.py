"""Iteration time split into compute and update: no protection / snapshot / RMU (paper Table 1).

One process, one model per mode (same initial weights, same batches), the modes
interleaved iteration by iteration so they share the machine's state. Compute = forward +
backward + clip; update = what each consistency mode does after the gradients are final:

* ``reference``: ``optimizer.step()`` in place, no parity, no crash consistency;
* ``snapshot``: copy the state region to a host snapshot, ``optimizer.step()``, re-encode
  the state's parity (what ``consistency: snapshot`` does with erasure on);
* ``rmu``: the resumable updater (chunked AdamW, undo copy, incremental parity, commits);
* ``rmu-noparity``: the RMU with erasure off (the cost of the chunk transactions alone).

Extra retained memory per mode is printed too (snapshot: a full state copy; rmu: one
chunk of undo + two working parity buffers, activation memory on a GPU). The last line is
the RMU's overhead ratio against the reference iteration.

    python bench/update_overhead.py [--iters 10] [--json bench/results/update_overhead.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
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
from leto.trainer.layout import Layout
from leto.trainer.marker import MARKER_BYTES, Marker, Phase
from leto.updater.rmu import ResumableUpdater, buffer_bytes

MODES = ("reference", "snapshot", "rmu", "rmu-noparity")


class _NoFaults:
    def point(self, *_: object, **__: object) -> None:
        return None


def _gpt_module():  # examples/ is not a package
    spec = importlib.util.spec_from_file_location("train_gpt", REPO / "examples" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


class Trainer:
    """One model whose params, grads and AdamW state live in flat "retained" buffers."""

    def __init__(self, mode: str, args: argparse.Namespace, erasure: ErasureConfig) -> None:
        gpt = _gpt_module()
        torch.manual_seed(args.seed)
        self.mode, self.args = mode, args
        self.model = gpt.GPT(args.vocab, args.dim, args.layers, args.heads, args.seq, 0.0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
        params = list(self.model.parameters())
        self.layout = Layout.plan(params, [], self.opt)
        protect = mode in ("snapshot", "rmu")
        nbytes = padded_bytes(self.layout.state_bytes, erasure) if protect else self.layout.state_bytes
        self.state = torch.zeros(nbytes, dtype=torch.uint8)
        self.grads = torch.zeros(self.layout.grad_bytes, dtype=torch.uint8)
        for p, ps, gs, os_ in zip(params, self.layout.params, self.layout.grads, self.layout.optim, strict=True):
            data = ps.view(self.state)
            data.copy_(p.detach())
            torch.utils.swap_tensors(p, torch.nn.Parameter(data))
            p.grad = gs.view(self.grads)
            self.opt.state[p] = {k: s.view(self.state) for k, s in os_.items()}
        self.groups: list[ProtectionGroup] = []
        if protect:
            pb, h1, h2 = erasure.page_bytes, erasure.tier1_parity, erasure.tier2_parity
            spans = plan_groups(nbytes, erasure)
            p1 = torch.zeros(len(spans) * h1 * pb, dtype=torch.uint8)
            p2 = torch.zeros(len(spans) * h2 * pb, dtype=torch.uint8)
            self.groups = [
                ProtectionGroup(erasure, self.state[s.byte_offset : s.byte_offset + s.nbytes],
                                p1[i * h1 * pb : (i + 1) * h1 * pb], p2[i * h2 * pb : (i + 1) * h2 * pb], backend="torch")
                for i, s in enumerate(spans)
            ]
            for g in self.groups:
                g.encode_all()
        self.extra_bytes = 0
        if mode == "snapshot":
            self.snapshot = torch.zeros(nbytes, dtype=torch.uint8)
            self.extra_bytes = nbytes
        self.marker = Marker(torch.zeros(MARKER_BYTES, dtype=torch.uint8))
        self.marker.initialise(self.layout.digest)
        self.updater: ResumableUpdater | None = None
        if mode.startswith("rmu"):
            er = erasure if mode == "rmu" else None
            undo, parity = buffer_bytes(self.layout, nbytes, args.chunk_bytes, er)
            self.extra_bytes = undo + parity
            protected = SimpleNamespace(cfg=erasure, groups=self.groups) if self.groups else None
            self.updater = ResumableUpdater(
                layout=self.layout, state=self.state, grads=self.grads, rng_next=torch.get_rng_state().clone(),
                optimizer=self.opt, marker=self.marker, undo=torch.zeros(undo, dtype=torch.uint8),
                parity=torch.zeros(parity, dtype=torch.uint8) if parity else None, protected=protected,  # type: ignore[arg-type]
                injector=_NoFaults(), chunk_bytes=args.chunk_bytes,  # type: ignore[arg-type]
            )

    def compute(self, step: int) -> None:
        g = torch.Generator().manual_seed(step)
        data = torch.randint(0, self.args.vocab, (self.args.batch, self.args.seq + 1), generator=g)
        self.grads.zero_()
        loss = self.model(data[:, :-1], data[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)

    def update(self, step: int) -> None:
        if self.mode == "reference":
            self.opt.step()
            return
        if self.mode == "snapshot":
            self.snapshot.copy_(self.state)
            self.opt.step()
            for g in self.groups:
                g.encode_all()
            return
        assert self.updater is not None
        self.marker.record_lrs([1e-3])
        self.marker.advance(Phase.GRADS_READY)
        self.updater.run(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--page-bytes", type=int, default=65536)
    p.add_argument("--data-pages", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "update_overhead.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    erasure = ErasureConfig(page_bytes=args.page_bytes, data_pages=args.data_pages, tier1_parity=16, tier2_parity=1)
    trainers = {m: Trainer(m, args, erasure) for m in MODES}
    times: dict[str, dict[str, list[float]]] = {m: {"compute": [], "update": []} for m in MODES}
    for it in range(args.warmup + args.iters):
        for m, tr in trainers.items():
            t0 = time.perf_counter()
            tr.compute(it)
            t1 = time.perf_counter()
            tr.update(it)
            t2 = time.perf_counter()
            if it >= args.warmup:
                times[m]["compute"].append(t1 - t0)
                times[m]["update"].append(t2 - t1)
    ref = trainers["reference"]
    slots = [*ref.layout.params, *(s for o in ref.layout.optim for s in o.values())]
    same = all(torch.equal(s.view(ref.state), s.view(trainers[m].state)) for m in ("rmu", "rmu-noparity") for s in slots)
    state_mb = ref.layout.state_bytes / 2**20
    rows = {}
    print(f"model: {sum(p.numel() for p in ref.model.parameters()) / 1e6:.2f} M params, state {state_mb:.1f} MiB; "
          f"chunk {args.chunk_bytes >> 10} KiB; erasure {args.page_bytes >> 10} KiB pages, D={args.data_pages}, H1=16")
    print(f"{'mode':<14}{'compute ms':>12}{'update ms':>11}{'total ms':>10}{'vs ref':>9}{'extra MiB':>11}")
    base = None
    for m in MODES:
        c, u = statistics.median(times[m]["compute"]), statistics.median(times[m]["update"])
        total = c + u
        base = base or total
        rows[m] = {"compute_ms": 1e3 * c, "update_ms": 1e3 * u, "total_ms": 1e3 * total,
                   "overhead": total / base - 1, "extra_bytes": trainers[m].extra_bytes}
        print(f"{m:<14}{1e3 * c:>12.1f}{1e3 * u:>11.1f}{1e3 * total:>10.1f}{100 * (total / base - 1):>+8.1f}%"
              f"{trainers[m].extra_bytes / 2**20:>11.2f}")
    result = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "torch": torch.__version__,
              "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "rmu_equals_reference": same}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"rmu params + AdamW state == reference (bit-exact): {same}")
    print(f"RMU overhead ratio (total rmu / total reference): {rows['rmu']['total_ms'] / rows['reference']['total_ms']:.3f}")


if __name__ == "__main__":
    main()
