"""Megatron-Core GPTModel on CPU: Leto's steady-state overhead and in-place recovery time.

Two leto-run jobs of examples/megatron_gpt.py (2 ranks, gloo, the CPU torch.cuda shims,
``consistency: rmu`` with two-tier erasure protection):

* overhead: ``--compare-baseline`` interleaves, step by step in the same processes, the
  same Megatron model trained without Leto (torch AdamW, one flat all-reduce, clipping)
  with the Leto run; medians after a 20 % warm-up;
* recovery: SIGKILLs (backward, then inside the update), each with ready shadows (the step
  before waits for them: ``shadow_ready_steps_before: 1``); recovery time is the paper's
  §8.1 metric (kill → the interrupted step done again on every rank), from the event stream. Run twice: shadows that skip the
  warm-up of Megatron's first iteration (``--no-shadow-warm-up``), then shadows that run
  it (``lm.warm_up_shadow``); each promoted trainer prints its first iteration's phases
  and the ``torch.compile`` graphs it compiled.

    python bench/megatron_cpu.py [--json bench/results/megatron_cpu.json]
    python bench/megatron_cpu.py --fusions --skip-overhead   # Megatron's jit_fuser fusions on
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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

MODEL = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "4",
    "--lr",
    "3e-4",
    "--seed",
    "1234",
]
LETO = {
    "consistency": "rmu",
    "erasure": {"page_bytes": 65536, "data_pages": 64, "tier1_parity": 16, "tier2_parity": 1},
}


def run(
    tmp: Path, name: str, iters: int, faults: list[dict], script_args: list[str], leto: dict = LETO
) -> tuple[list[dict], list[str]]:
    """One leto-run job: its events and the promoted trainers' first-iteration lines."""
    events, job = tmp / f"{name}.jsonl", tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"leto": {**leto, "faults": faults}}))
    cmd = [
        sys.executable,
        "-m",
        "leto_run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-dashboard",
        "--events",
        str(events),
        "--config",
        str(job),
        str(REPO / "examples/megatron_gpt.py"),
        "--train-iters",
        str(iters),
        *MODEL,
        *script_args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True, text=True)
    firsts = [
        line.strip()
        for line in (proc.stdout + proc.stderr).splitlines()
        if "promoted, first iteration" in line
    ]
    return read_events(events), firsts


def recovery(tmp: Path, name: str, gap: int, script_args: list[str]) -> dict:
    """Two kills (backward, mid-update), each held until the shadows are ready; their recoveries."""
    kills = [
        {"rank": 1, "step": gap, "phase": "backward", "shadow_ready_steps_before": 1},
        {
            "rank": 0,
            "step": 2 * gap,
            "phase": "update",
            "point": "optimizer",
            "chunk": 0,
            "shadow_ready_steps_before": 1,
        },
    ]
    events, firsts = run(tmp, name, 2 * gap + 50, kills, script_args)
    recs = [r for r in summary.recoveries(events) if r.total_s is not None]
    warmed = [e for e in events if e["kind"] == "model_warmed" and e["ran"]]
    return {
        "recovery_s": [r.total_s for r in recs],
        "recovery_phases_s": [r.phases for r in recs],
        "first_step_s": [r.phases.get("first step") for r in recs],
        "first_iterations": firsts,
        "shadow_warm_up_s": [e["warm_s"] for e in warmed],
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", default=str(REPO / "bench/results/megatron_cpu.json"))
    p.add_argument("--iters", type=int, default=300, help="iterations of the overhead run")
    p.add_argument(
        "--gap",
        type=int,
        default=300,
        help="iterations between kills (each also waits for ready shadows)",
    )
    p.add_argument(
        "--fusions", action="store_true", help="Megatron's jit_fuser fusions (torch.compile) on"
    )
    p.add_argument("--skip-overhead", action="store_true", help="measure recovery only")
    args = p.parse_args()
    fusions = ["--fusions"] if args.fusions else []
    overhead: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name, leto in (
            () if args.skip_overhead else (("parity", LETO), ("no_parity", {"consistency": "rmu"}))
        ):
            out = tmp / f"{name}.json"
            run(
                tmp,
                name,
                args.iters,
                [],
                ["--compare-baseline", "--bench-out", str(out), *fusions],
                leto,
            )
            overhead[name] = json.loads(out.read_text())
        recoveries = {
            "cold": recovery(tmp, "cold", args.gap, ["--no-shadow-warm-up", *fusions]),
            "warm": recovery(tmp, "warm", args.gap, fusions),
        }
    print(
        f"{'Megatron GPTModel, 2 CPU ranks' + (', fusions' if args.fusions else ''):48s} {'iteration (ms)':>14s}"
    )
    for name, label in (("no_parity", "rmu, no erasure"), ("parity", "rmu + two-tier parity")):
        if name not in overhead:
            continue
        o = overhead[name]
        print(
            f"{'  without Leto (same processes, interleaved)':48s} {o['baseline_iter_s'] * 1e3:14.2f}"
        )
        print(f"{'  with Leto, ' + label:48s} {o['leto_iter_s'] * 1e3:14.2f}")
        o["overhead"] = o["leto_iter_s"] / o["baseline_iter_s"] - 1
    for name, label in (
        ("cold", "shadows without warm-up"),
        ("warm", "shadows warmed (lm.warm_up_shadow)"),
    ):
        r = recoveries[name]
        print(f"  {label}:")
        for total, phases in zip(r["recovery_s"], r["recovery_phases_s"], strict=True):
            print(
                "    recovery: "
                + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in phases.items())
                + f" → total {total * 1e3:.0f} ms"
            )
        for line in r["first_iterations"]:
            print(f"    {line}")
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "fusions": args.fusions,
        "iterations": overhead,
        **recoveries["warm"],
        "cold": recoveries["cold"],
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    if overhead:
        print(
            f"Leto overhead: {100 * overhead['no_parity']['overhead']:+.1f} % (rmu) / "
            f"{100 * overhead['parity']['overhead']:+.1f} % (rmu + parity) of the iteration"
        )
    cold, warm = (statistics.median(recoveries[n]["first_step_s"]) for n in ("cold", "warm"))
    print(
        f"promoted trainers' first step (median): {cold * 1e3:.0f} ms cold → {warm * 1e3:.0f} ms warmed "
        f"({warm / cold:.2f}x)"
    )


if __name__ == "__main__":
    main()
