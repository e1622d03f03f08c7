"""How long a node is without a ready shadow after a recovery: promotion → replacement ready.

A leto-run job (the demo GPT, 2 gloo ranks on CPU, or ``--device cuda`` on a GPU machine)
with ``--kills`` SIGKILLs, each once the previous replacement shadows are ready. For every
recovery: the time from the promotion (``shadows_promoted.promote_t``) to the last local
rank's replacement ``shadow_ready``, split into spawn (until ``shadows_spawned``), process
start (until the replacement's ``trainer_started``: interpreter + imports) and
pre-initialisation (until ``shadow_ready``). And the job's own start: from the first
``workers_started`` to the first step every rank committed, and to the first shadows' last
``shadow_ready``. ``--baseline-rev REV`` also runs the same job from a git worktree of REV
in this call (before/after); the last line is the ratio of the recovery windows.

    python bench/shadow_ready.py --kills 4 [--baseline-rev 89d410c] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from leto.events import read_events

CPU_MODEL = ["--dim", "32", "--layers", "2", "--seq", "16", "--batch", "4"]


def run(
    repo: Path, tmp: Path, kills: int, gap: int, script_args: list[str], nproc: int
) -> list[dict]:
    events = tmp / "events.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "leto_run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--no-dashboard",
        "--events",
        str(events),
    ]
    for i in range(kills):
        step = gap * (i + 1)
        cmd += [
            "--inject-fault",
            f"rank={i % nproc},step={step},phase=backward,shadow_ready_steps_before=3",
        ]
    cmd += [str(repo / "examples/train_gpt.py"), "--steps", str(gap * (kills + 1)), *script_args]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"job from {repo} failed:\n{proc.stderr[-3000:]}")
    return read_events(events)


def windows(events: list[dict]) -> list[dict[str, float]]:
    """Per recovery: promotion → replacement ready, and its parts (seconds)."""
    out = []
    for p in (e for e in events if e["kind"] == "shadows_promoted"):
        gen, t0 = p["gen"] + 1, p["promote_t"]
        spawned = next(
            (
                e["t"]
                for e in events
                if e["kind"] == "shadows_spawned" and e["gen"] == gen and e["t"] >= t0
            ),
            None,
        )
        started = [
            e["t"]
            for e in events
            if e["kind"] == "trainer_started" and e["gen"] == gen and e["t"] >= t0
        ]
        ready = [
            e["t"]
            for e in events
            if e["kind"] == "shadow_ready" and e["gen"] == gen and e["t"] >= t0
        ]
        if spawned is None or not ready:
            continue
        parts = [
            e for e in events if e["kind"] == "trainer_started" and e["gen"] == gen and e["t"] >= t0
        ]
        window = {
            "spawn_s": spawned - t0,
            "start_s": max(started) - spawned if started else float("nan"),
            "preinit_s": max(ready) - (max(started) if started else spawned),
            "ready_s": max(ready) - t0,
        }
        for key in (
            "before_init_s",
            "store_s",
            "device_wait_s",
            "context_s",
        ):  # inside start_s (recent trainers report them)
            if parts and all(key in e for e in parts):
                window[key] = max(e[key] for e in parts)
        out.append(window)
    return out


def job_start(events: list[dict]) -> dict[str, float]:
    """From the first ``workers_started``: every rank's first committed step, and the first
    shadows' readiness (seconds)."""
    t0 = next(e["t"] for e in events if e["kind"] == "workers_started")
    first_steps: dict[int, float] = {}
    for e in events:
        if e["kind"] == "step_done":  # the first of each rank: before any kill
            first_steps.setdefault(e["rank"], e["t"])
    ready = [e["t"] for e in events if e["kind"] == "shadow_ready" and e["gen"] == 1]
    return {
        "first_step_s": max(first_steps.values()) - t0,
        "shadows_ready_s": (max(ready) - t0) if ready else float("nan"),
    }


def _row(name: str, ws: list[dict[str, float]]) -> str:
    med = {k: statistics.median(w[k] for w in ws) for k in ws[0]}
    return (
        f"{name:10s} {len(ws):3d}  {med['spawn_s']:8.2f} {med['start_s']:8.2f} {med['preinit_s']:9.2f} "
        f"{med['ready_s']:8.2f}  (max {max(w['ready_s'] for w in ws):.2f})"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--gap", type=int, default=30, help="steps between kills")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--baseline-rev", help="also run this git revision's leto-run (a temporary worktree)"
    )
    p.add_argument(
        "--baseline-dir",
        type=Path,
        help="also run the leto-run of this checkout (e.g. an older one)",
    )
    p.add_argument("--json", type=Path)
    p.add_argument(
        "script_args", nargs="*", help="train_gpt.py arguments (default: the CPU test model)"
    )
    args = p.parse_args()
    script_args = args.script_args or CPU_MODEL
    results: dict[str, list[dict[str, float]]] = {}
    starts: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="leto-ready-") as d:
        tmp = Path(d)
        if args.baseline_dir:
            (tmp / "b").mkdir()
            events = run(
                args.baseline_dir.resolve(),
                tmp / "b",
                args.kills,
                args.gap,
                script_args,
                args.nproc,
            )
            results["baseline"], starts["baseline"] = windows(events), job_start(events)
        elif args.baseline_rev:
            base = tmp / "baseline"
            subprocess.run(
                [
                    "git",
                    "-C",
                    str(REPO),
                    "worktree",
                    "add",
                    "--detach",
                    str(base),
                    args.baseline_rev,
                ],
                check=True,
                capture_output=True,
            )
            try:
                (tmp / "b").mkdir()
                events = run(base, tmp / "b", args.kills, args.gap, script_args, args.nproc)
                results["baseline"], starts["baseline"] = windows(events), job_start(events)
            finally:
                subprocess.run(
                    ["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)],
                    check=False,
                )
        (tmp / "l").mkdir()
        events = run(REPO, tmp / "l", args.kills, args.gap, script_args, args.nproc)
        results["leto"], starts["leto"] = windows(events), job_start(events)
    print(
        f"{'':10s} {'n':>3s}  {'spawn':>8s} {'start':>8s} {'pre-init':>9s} {'ready':>8s}  (medians, s)"
    )
    for name, ws in results.items():
        if not ws:
            sys.exit(f"{name}: no replacement became ready")
        print(_row(name, ws))
        if "context_s" in ws[0]:
            parts = {
                k: statistics.median(w[k] for w in ws)
                for k in ("before_init_s", "store_s", "context_s")
            }
            wait = statistics.median(w.get("device_wait_s", 0.0) for w in ws)
            print(
                f"{'':10s} start = process until leto.init {parts['before_init_s']:.2f} + store "
                f"{parts['store_s']:.2f} + the predecessor's first step {wait:.2f} + context "
                f"{parts['context_s']:.2f} (+ the fork)"
            )
    print(
        f"{'job start':10s} {'first step':>11s} {'shadows ready':>14s}  (s after workers_started)"
    )
    for name, st in starts.items():
        print(f"{name:10s} {st['first_step_s']:11.2f} {st['shadows_ready_s']:14.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**results, "job_start": starts}, indent=1))
    now = statistics.median(w["ready_s"] for w in results["leto"])
    if "baseline" in results:
        before = statistics.median(w["ready_s"] for w in results["baseline"])
        print(
            f"replacement shadows ready {now:.2f} s after promotion (p50), {before:.2f} s before: "
            f"{before / now:.1f}x sooner"
        )
    else:
        print(f"replacement shadows ready {now:.2f} s after promotion (p50)")


if __name__ == "__main__":
    main()
