"""Where an FSDP2 model's first step in a fresh process goes, and what a shadow's warm-ups
buy: torch alone, no leto-run, world size 1.

Each variant runs in a fresh process: the model of ``examples/train_llama_fsdp.py`` built
on meta and ``fully_shard``'ed, materialised, then (per variant) warmed as a Leto shadow
warms it, then its first steps' forward and backward timed, synchronised:

* ``cold``: no warm-up;
* ``replay``: the shadow's forward replay of an unsharded copy (``leto.preinit.replay``);
* ``replay+empty``: that, then ``torch.cuda.empty_cache()``, as a shadow returns the
  replay's memory: the first step's allocations all reach the driver again;
* ``replay+twin``: that, then a second instance of the model sharded over the same
  (one-rank) group run through one forward and backward and dropped: what warming FSDP2's
  own first run could buy at most (a shadow of a larger world could not run its
  collectives);
* ``replay+twin2``: the same with a two-block twin.

``--profile`` prints each variant's first step's top host events (torch.profiler, CUDA
runtime calls among them) next to its second step's.

    python bench/fsdp2_first_step.py [--variants cold,replay,replay+fsdp] [--profile]
    python bench/fsdp2_first_step.py --small      # a tiny model on CPU (gloo)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

MODEL = {"vocab": 32000, "dim": 2048, "layers": 20, "heads": 16, "seq": 512, "batch": 4}
SMALL = {"vocab": 128, "dim": 32, "layers": 2, "heads": 4, "seq": 16, "batch": 2}
VARIANTS = ("cold", "replay", "replay+empty", "replay+twin", "replay+twin2")


def child(variant: str, small: bool, profile: bool, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    import train_llama_fsdp as ex

    from leto.preinit import replay as rp

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    dist.init_process_group(
        "nccl" if cuda else "gloo", rank=0, world_size=1, device_id=device if cuda else None
    )
    a = argparse.Namespace(**(SMALL if small else MODEL), bf16=True, reshard=False)
    a.compile, a.seed = False, 1
    model = ex.build(a, device, 1)
    x, y = ex.batch(0, 0, a, device)
    warm: dict[str, float] = {}
    t = time.perf_counter()
    if variant.startswith("replay"):
        scratch = rp.unsharded_copy(model)
        spec = rp.ForwardSpec.of((x, y), {})
        rp._replay(scratch, spec, device)
        del scratch
        warm["replay_s"] = time.perf_counter() - t
    if variant.endswith("+empty") and cuda:
        torch.cuda.empty_cache()
    if "+twin" in variant:
        t = time.perf_counter()
        b = argparse.Namespace(**vars(a))
        if variant.endswith("2"):
            b.layers = 2
        twin = ex.build(b, device, 1)
        ex.materialise(twin, device, a.seed)
        twin(x, y).backward()
        del twin
        warm["twin_s"] = time.perf_counter() - t
    ex.materialise(model, device, a.seed)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()

    def mallocs() -> int:
        return torch.cuda.memory_stats().get("num_device_alloc", 0) if cuda else 0

    def step() -> tuple[float, float, int]:
        m0 = mallocs()
        t0 = time.perf_counter()
        loss = model(x, y)
        sync()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        for p in model.parameters():
            p.grad = None
        return round(1e3 * (t1 - t0), 2), round(1e3 * (t2 - t1), 2), mallocs() - m0

    out: dict = {"variant": variant, "warm": warm, "steps": []}
    prof_tables = []
    for i in range(steps):
        if profile and i < 2:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as tp

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with tp(activities=acts) as prof:
                out["steps"].append(step())
            prof_tables.append(
                prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22)
            )
        else:
            out["steps"].append(step())
    out["tables"] = prof_tables
    dist.destroy_process_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--small", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.small, args.profile, args.steps)))
        return
    results = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            p.exit(2, f"{p.prog}: error: --variants: unknown {variant!r}\n")
        cmd = [sys.executable, __file__, "--child", variant, "--steps", str(args.steps)]
        cmd += ["--small"] * args.small + ["--profile"] * args.profile
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            raise SystemExit(f"fsdp2_first_step: {variant} failed:\n{proc.stderr[-4000:]}")
        r = json.loads(lines[-1][7:])
        results.append(r)
        steps = ", ".join(f"{f}+{b} ({n})" for f, b, n in r["steps"])
        warm = " ".join(f"{k} {v:.2f}" for k, v in r["warm"].items())
        print(f"{variant:12s} fwd+bwd ms (driver allocations): {steps}  warm: {warm or '-'}")
        for i, table in enumerate(r["tables"]):
            print(f"--- {variant}, step {i + 1}\n{table}")
    if args.json:
        for r in results:
            r.pop("tables")
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
