"""Recovery time on CPU: leto-run in-place recovery vs torchrun + torch.distributed.checkpoint.

Both jobs train the demo GPT (2 ranks, gloo) in this one invocation. Recovery time is the
paper's §8.1 metric: from the SIGKILL until the interrupted step has completed again on
every rank (initialisation + recomputation).

* leto-run: several kills, each after the shadows are ready.
* torchrun: DCP checkpoint every N steps, N from Young's formula sqrt(2·C·MTTF)/T_iter with
  C the measured checkpoint cost and MTTF the paper's 10-minute HOF interval; the kill lands
  mid-interval (the expected case), so recovery = restart + load + N/2 steps recomputed.

    python bench/recovery_cpu.py [--json bench/results/recovery_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from leto import summary
from leto.events import read_events

MTTF_S = 600.0


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run_leto(tmp: Path, steps: int, kills: list[int]) -> list[dict]:
    events = tmp / "leto.jsonl"
    cmd = [
        str(Path(sys.executable).with_name("leto-run")),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-dashboard",
        "--events",
        str(events),
    ]
    for i, s in enumerate(kills):
        cmd += ["--inject-fault", f"rank={i % 2},step={s},phase={('backward', 'update')[i % 2]}"]
    cmd += [str(REPO / "examples/train_gpt.py"), "--steps", str(steps)]
    subprocess.run(cmd, check=True, env=_env(), cwd=tmp, capture_output=True)
    return read_events(events)


def run_torchrun(tmp: Path, steps: int, every: int, kill: int) -> list[dict]:
    events = tmp / "torchrun.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(REPO / "examples/torchrun_gpt_ckpt.py"),
        "--steps",
        str(steps),
        "--ckpt-dir",
        str(tmp / "ckpt"),
        "--ckpt-every",
        str(every),
        "--kill-at-step",
        str(kill),
    ]
    subprocess.run(
        cmd,
        check=True,
        env={**_env(), "LETO_EVENTS_FILE": str(events)},
        cwd=tmp,
        capture_output=True,
    )
    return read_events(events)


def torchrun_recovery_s(events: list[dict]) -> tuple[float, float]:
    fault = next(e for e in events if e["kind"] == "fault_injected")
    done = [
        e["t"]
        for e in events
        if e["kind"] == "step_done" and e["step"] == fault["step"] and e.get("attempt") == 1
    ]
    loads = [e["t"] for e in events if e["kind"] == "resumed"]
    return max(done) - fault["t"], min(loads) - fault["t"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=str(REPO / "bench/results/recovery_cpu.json"))
    p.add_argument(
        "--kills", type=int, default=3, help="leto-run kills (each waits for ready shadows)"
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        gap = 130  # steps between leto kills: the replacement shadows are ready by then
        leto_steps = 150 + gap * args.kills
        leto_events = run_leto(tmp, leto_steps, [150 + gap * i for i in range(args.kills)])
        recs = [r for r in summary.recoveries(leto_events) if r.total_s is not None]
        iter_s = statistics.median(
            e["iter_s"]
            for e in leto_events
            if e["kind"] == "step_done" and not e.get("finished_in_recovery")
        )
        # Checkpoint cost C: measured by a calibration run of the baseline (no kill).
        (tmp / "calib").mkdir()
        calib = run_torchrun(tmp / "calib", 40, 10, -1)
        ckpt_s = statistics.median(e["save_s"] for e in calib if e["kind"] == "digest")
        every = max(1, round(math.sqrt(2 * ckpt_s * MTTF_S) / iter_s))
        kill = 2 * every + every // 2
        tr_events = run_torchrun(tmp, kill + 10, every, kill)
        tr_total, tr_to_load = torchrun_recovery_s(tr_events)
    leto_totals = [r.total_s for r in recs]
    leto_median = statistics.median(leto_totals)
    rows = [
        (f"leto-run in-place (median of {len(recs)})", leto_median),
        (f"torchrun + DCP every {every} steps", tr_total),
    ]
    print(
        f"iteration {iter_s * 1e3:.1f} ms · checkpoint cost {ckpt_s * 1e3:.1f} ms · Young interval {every} steps "
        f"(MTTF {MTTF_S:.0f} s) · torchrun kill at step {kill}"
    )
    print(f"{'system':40s} {'recovery (s)':>12s}")
    for name, value in rows:
        print(f"{name:40s} {value:12.3f}")
    for r in recs:
        print(
            "  leto phases (ms): "
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r.phases.items())
            + f" → total {r.total_s * 1e3:.0f}"
        )
    print(
        f"  torchrun: kill → checkpoint loaded {tr_to_load:.3f} s, then {tr_total - tr_to_load:.3f} s recomputing"
    )
    speedup = tr_total / leto_median
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "iteration_s": iter_s,
        "checkpoint_s": ckpt_s,
        "young_interval_steps": every,
        "leto_recovery_s": leto_totals,
        "leto_phases_s": [r.phases for r in recs],
        "torchrun_recovery_s": tr_total,
        "torchrun_kill_to_loaded_s": tr_to_load,
        "speedup": speedup,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    # The same measurements as a simulator profile (configs/sim/cpu-demo-measured.yaml).
    leto_phases = recs[len(recs) // 2].phases
    profile = {
        "source": f"bench/recovery_cpu.py, 2-core CPU, {result['date']}",
        "iteration_time_s": iter_s,
        "systems": {
            "Leto": {
                "detection_s": leto_phases["detect"],
                "init_s": leto_median - leto_phases["detect"],
                "checkpoint_cost_s": ckpt_s,
                "ff_init_s": tr_to_load,
            },
            "torchrun+DCP": {"checkpoint_cost_s": ckpt_s, "init_s": tr_to_load},
        },
    }
    Path(args.json).with_name("profile_cpu.json").write_text(json.dumps(profile, indent=2))
    print(f"speedup: {speedup:.1f}x")


if __name__ == "__main__":
    main()
