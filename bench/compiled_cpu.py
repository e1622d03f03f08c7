"""``torch.compile``'d models under leto-run on CPU (2 gloo ranks, PyTorch's default kernels):
the steady step against torchrun's, and a promoted trainer's first step with and without
the shadow's compile warm-ups.

Steady: ``examples/train_llama_fsdp.py --compile`` fault-free under leto-run against the
same script's ``--plain`` loop under torchrun (``AdamW(foreach=True)``, torch's
``clip_grad_norm_``), mean step after the first 5, same call.

First step: two jobs, each run twice in this call (warm-ups on, then off), two SIGKILLs
each, every kill once the shadow is ready:

* ``fsdp2``: ``examples/train_llama_fsdp.py --compile`` (each block compiled, then
  ``fully_shard``): no forward replay (off on CPU; on a GPU it runs the blocks eager,
  unsharded), so the shadow warms the compiler (``model_warmup.warm_compiler``) and the
  sharded clip; off: ``preinit.warm_kernels: false``.
* ``gpt``: ``examples/train_gpt.py --compile`` (each block compiled) with
  ``preinit.replay_forward: true`` (the replay compiles the model's blocks, so the
  promoted trainer's first step compiles nothing); off: ``replay_forward: false`` and
  ``warm_kernels: false``.

Each recovery's phases come from the agent's ``recovery_done`` event; the steady step is
the median of rank 0's step periods outside recoveries (``summary.step_periods``); the graphs
Dynamo compiled in each promoted trainer's first step come from its ``step_done``. Inductor's on-disk cache is warm
for every run (a first run fills it). Prints one row per run and, last, the first step's
excess over a steady step with the warm-ups over without.

    python bench/compiled_cpu.py [--json bench/results/compiled_cpu.json]
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

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from leto.events import Kind, read_events
from leto.summary import step_periods

JOBS = {
    "fsdp2": (
        "examples/train_llama_fsdp.py",
        ["--dim", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--batch", "2"],
        {"warm_kernels": False},
        {},
    ),
    "gpt": (
        "examples/train_gpt.py",
        ["--dim", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--dropout", "0"],
        {"warm_kernels": False, "replay_forward": False},
        {"replay_forward": True},
    ),
}
KILLS = (
    "rank=1,step=4,phase=backward,shadow_ready_steps_before=1",
    "rank=0,step=8,phase=forward,shadow_ready_steps_before=1",
)


def _env(cache: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(cache),
    }


def _leto_run(events: Path, *flags: str) -> list[str]:
    """leto-run on 2 local ranks, no dashboard, its events to ``events``; then ``flags``."""
    return [
        str(Path(sys.executable).with_name("leto-run")),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-dashboard",
        "--events",
        str(events),
        *flags,
    ]


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        raise SystemExit(f"compiled_cpu: {what} failed:\n{proc.stderr[-3000:]}")


def run(job: str, warm: bool, tmp: Path, cache: Path, steps: int) -> dict[str, object]:
    script, model_args, off, on = JOBS[job]
    events = tmp / f"{job}-{'on' if warm else 'off'}.jsonl"
    cfg = tmp / f"{job}-{'on' if warm else 'off'}.yaml"
    cfg.write_text(yaml.safe_dump({"leto": {"preinit": on if warm else off}}))
    cmd = _leto_run(events, "--config", str(cfg))
    for kill in KILLS:
        cmd += ["--inject-fault", kill]
    cmd += [str(REPO / script), "--steps", str(steps), "--compile", *model_args]
    proc = subprocess.run(
        cmd, check=False, env=_env(cache), cwd=tmp, capture_output=True, text=True
    )
    _check(proc, job)
    evs = read_events(events)
    recoveries = [e["phases_s"] for e in evs if e["kind"] == Kind.RECOVERY_DONE]
    warmups = [
        {
            k: e[k]
            for k in ("t", "rank", "gen", "name", "ran", "reason", "warm_s", "compiled_graphs")
        }
        for e in evs
        if e["kind"] == Kind.MODEL_WARMED
    ]
    steady = step_periods(evs, 0, first_step=2)
    return {
        "job": job,
        "warm": warm,
        "recoveries_s": recoveries,
        "first_step_graphs": first_step_graphs(evs),
        "steady_ms": round(1e3 * statistics.median(steady), 1),
        "warmups": warmups,
    }


def first_step_graphs(evs: list[dict]) -> list[int]:
    """Graphs Dynamo compiled in each promoted trainer's first step, in promotion order."""
    out = []
    for promoted in (e for e in evs if e["kind"] == Kind.PROMOTED):
        first = next(
            e
            for e in evs
            if e["kind"] == Kind.STEP_DONE
            and e["rank"] == promoted["rank"]
            and e["t"] > promoted["t"]
        )
        out.append(first.get("compiled_graphs", 0))
    return out


def steady(tmp: Path, cache: Path, steps: int) -> dict[str, float]:
    """Mean step (ms) after the first 5: leto-run fault-free, torchrun ``--plain``."""
    script, model_args, _, _ = JOBS["fsdp2"]
    events = tmp / "steady.jsonl"
    leto_cmd = _leto_run(events)
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    args = [str(REPO / script), "--steps", str(steps), "--compile", *model_args]
    out = {}
    for name, cmd in (("torchrun", [*torchrun, *args, "--plain"]), ("leto", [*leto_cmd, *args])):
        proc = subprocess.run(
            cmd, check=False, env=_env(cache), cwd=tmp, capture_output=True, text=True
        )
        _check(proc, f"steady {name}")
        if name == "torchrun":
            out[name] = float(proc.stdout.split("mean step ")[1].split(" ms")[0])
        else:
            periods = step_periods(read_events(events), 0, first_step=6)
            out[name] = round(1e3 * statistics.mean(periods), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--jobs", default="fsdp2,gpt")
    p.add_argument("--steady-steps", type=int, default=40, help="0: no steady comparison")
    p.add_argument("--json", default=str(REPO / "bench/results/compiled_cpu.json"))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp, cache = Path(d), Path(d) / "inductor"
        ratio = None
        if args.steady_steps:
            run("fsdp2", True, tmp, cache, 3)  # fills Inductor's on-disk cache
            ratio = steady(tmp, cache, args.steady_steps)
        for job in args.jobs.split(","):
            run(job, True, tmp, cache, 3)  # fills Inductor's on-disk cache
            for warm in (True, False):
                rows.append(run(job, warm, tmp, cache, args.steps))
    print(
        f"{'job':<6} {'warm-ups':<8} | first step ms per recovery | recovery ms | steady ms "
        "| graphs in first steps"
    )
    for r in rows:
        firsts = [1e3 * rec.get("first step", float("nan")) for rec in r["recoveries_s"]]
        totals = [1e3 * sum(rec.values()) for rec in r["recoveries_s"]]
        print(
            f"{r['job']:<6} {'on' if r['warm'] else 'off':<8} | "
            f"{', '.join(f'{x:.0f}' for x in firsts):<26} | "
            f"{', '.join(f'{x:.0f}' for x in totals):<11} | {r['steady_ms']:<9} "
            f"| {r['first_step_graphs']}"
        )
        r["first_step_ms"] = firsts
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"steady_ms": ratio, "first_step": rows}, indent=1))
    for job in args.jobs.split(","):
        on, off = (
            next(r for r in rows if r["job"] == job and r["warm"] is w) for w in (True, False)
        )
        excess = [statistics.median(r["first_step_ms"]) - r["steady_ms"] for r in (on, off)]
        print(f"{job}: first-step excess with warm-ups / without = {excess[0] / excess[1]:.3f}")
    if ratio is None:
        return
    print(
        f"fsdp2 steady step: torchrun {ratio['torchrun']} ms, leto-run {ratio['leto']} ms, "
        f"leto / torchrun = {ratio['leto'] / ratio['torchrun']:.3f}"
    )


if __name__ == "__main__":
    main()
