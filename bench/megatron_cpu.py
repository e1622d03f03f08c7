"""Megatron-Core GPTModel on CPU: Leto's steady-state overhead and in-place recovery time.

Two leto-run jobs of examples/megatron_gpt.py (2 ranks, gloo, the CPU torch.cuda shims,
``consistency: rmu`` with two-tier erasure protection):

* overhead: ``--compare-baseline`` interleaves, step by step in the same processes, the
  same Megatron model trained without Leto (torch AdamW, one flat all-reduce, clipping)
  with the Leto run; medians after a 20 % warm-up;
* recovery: SIGKILLs (backward, then inside the update), each after the replacement
  shadows are ready; recovery time is the paper's §8.1 metric (kill → the interrupted step
  done again on every rank), from the event stream.

    python bench/megatron_cpu.py [--json bench/results/megatron_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from leto import summary
from leto.events import read_events

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "4", "--lr", "3e-4", "--seed", "1234"]
LETO = {"consistency": "rmu", "erasure": {"page_bytes": 65536, "data_pages": 64, "tier1_parity": 16, "tier2_parity": 1}}


def run(tmp: Path, name: str, iters: int, faults: list[dict], script_args: list[str], leto: dict = LETO) -> list[dict]:
    events, job = tmp / f"{name}.jsonl", tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"leto": {**leto, "faults": faults}}))
    cmd = [sys.executable, "-m", "leto_run", "--standalone", "--nproc-per-node", "2", "--no-dashboard",
           "--events", str(events), "--config", str(job), str(REPO / "examples/megatron_gpt.py"),
           "--train-iters", str(iters), *MODEL, *script_args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True)
    return read_events(events)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=str(REPO / "bench/results/megatron_cpu.json"))
    p.add_argument("--iters", type=int, default=300, help="iterations of the overhead run")
    p.add_argument("--gap", type=int, default=300, help="iterations between kills (shadows ready by then)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        overhead = {}
        for name, leto in (("parity", LETO), ("no_parity", {"consistency": "rmu"})):
            out = tmp / f"{name}.json"
            run(tmp, name, args.iters, [], ["--compare-baseline", "--bench-out", str(out)], leto)
            overhead[name] = json.loads(out.read_text())
        kills = [{"rank": 1, "step": args.gap, "phase": "backward"},
                 {"rank": 0, "step": 2 * args.gap, "phase": "update", "point": "optimizer", "chunk": 0}]
        events = run(tmp, "recovery", 2 * args.gap + 50, kills, [])
    recs = [r for r in summary.recoveries(events) if r.total_s is not None]
    print(f"{'Megatron GPTModel, 2 CPU ranks':48s} {'iteration (ms)':>14s}")
    for name, label in (("no_parity", "rmu, no erasure"), ("parity", "rmu + two-tier parity")):
        o = overhead[name]
        print(f"{'  without Leto (same processes, interleaved)':48s} {o['baseline_iter_s'] * 1e3:14.2f}")
        print(f"{'  with Leto, ' + label:48s} {o['leto_iter_s'] * 1e3:14.2f}")
        o["overhead"] = o["leto_iter_s"] / o["baseline_iter_s"] - 1
    for r in recs:
        print(f"  recovery at step {r.step}: " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r.phases.items())
              + f" → total {r.total_s * 1e3:.0f} ms")
    result = {"date": time.strftime("%Y-%m-%d"), "iterations": overhead,
              "recovery_s": [r.total_s for r in recs], "recovery_phases_s": [r.phases for r in recs]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"Leto overhead: {100 * overhead['no_parity']['overhead']:+.1f} % (rmu) / "
          f"{100 * overhead['parity']['overhead']:+.1f} % (rmu + parity) of the iteration")


if __name__ == "__main__":
    main()
