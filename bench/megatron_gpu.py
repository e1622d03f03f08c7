"""Megatron-Core GPTModel on one GPU: Leto's recovery time and steady-state overhead
against the same Megatron training without Leto, in one call.

Jobs of examples/megatron_gpt.py, one after the other, same model, data and seed:

(a) plain: ``torch.distributed.run ... --no-leto``, Megatron's GPTModel with torch's
    foreach AdamW, clipping and (DP > 1) one flat all-reduce; no Leto at all;
(b) leto-run, ``consistency: rmu`` (chunks of --rmu-chunk-mib of parameters): SIGKILL in
    backward, then one mid-chunk inside the optimizer update, each timed so that the
    shadows should be ready (the report says whether they were);
(c) with --parity, (b) again with two-tier parity (2 MiB pages, D=1024, H1=16, H2=1);
(d) with --distributed-optimizer, (b) again with Megatron's distributed optimizer
    (``--use-distributed-optimizer``: reduce-scattered gradients, each rank's shard of the
    Adam state updated by the RMU, parameters all-gathered after the update; "rmu_distopt").

``--warm-up both`` (the default) runs (b) twice: shadows that skip the warm-up of Megatron's
first iteration (``--no-shadow-warm-up``: "rmu_cold") and shadows that run it
(``lm.warm_up_shadow``: "rmu"). Each kill waits for ready shadows (``shadow_ready_steps_before: 1``).
Every promoted trainer prints its first iteration's phases (forward, backward, update,
device-synchronised) and the ``torch.compile`` graphs it compiled; the report repeats them.
``--fusions`` turns on Megatron's bias-GeLU and bias-dropout-add fusions (``jit_fuser``,
i.e. ``torch.compile``), in the plain run too.

Steady state: median iteration time over clean steps (warm-up and the steps around each
kill left out); Leto from its ``step_done`` event times, the plain run from its own loop.
Recovery: the paper's §8.1 metric (kill → the interrupted step done again), phase by
phase, from the event stream (leto/summary.py). Default model: ~1.1 B parameters (20
layers, hidden 2048, 16 heads, seq 2048, micro-batch 2, vocab 32000), bf16 compute over
fp32 parameters and Adam state, deterministic kernels.

    python bench/megatron_gpu.py [--json PATH] [--parity] [--nproc 1] [--fusions] [--warm-up both|on|off]
                                 [--distributed-optimizer]
    python bench/megatron_gpu.py --small      # a tiny model: checks the script (CPU or GPU)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from leto import summary
from leto.events import read_events

SCRIPT = str(REPO / "examples/megatron_gpt.py")
MODEL = (
    "--num-layers 20 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 2 "
    "--vocab-size 32000 --lr 1e-4 --lr-warmup-iters 10 --seed 1234 --bf16"
)
SMALL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--vocab-size 256 --lr 1e-3 --seed 1234"
)
PARITY = {"page_bytes": 2 << 20, "data_pages": 1024, "tier1_parity": 16, "tier2_parity": 1}
SMALL_PARITY = {"page_bytes": 4096, "data_pages": 32, "tier1_parity": 16, "tier2_parity": 1}
FIRST = re.compile(r"rank \d+ promoted, first iteration .*")
LOG_DIR: Path | None = None
"""Where each job's log is kept (the JSON's folder)."""


def _env() -> dict[str, str]:
    env = {
        **os.environ,
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    return env


def _run(cmd: list[str], tmp: Path, name: str) -> None:
    t0 = time.time()
    proc = subprocess.run(cmd, check=False, env=_env(), cwd=tmp, capture_output=True, text=True)
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if LOG_DIR is not None:
        (LOG_DIR / f"megatron_gpu_{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(
            f"{name} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    print(f"  {name}: {time.time() - t0:.0f} s", flush=True)


def run_plain(tmp: Path, model: list[str], iters: int, nproc: int) -> dict[str, Any]:
    out = tmp / "plain.json"
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            SCRIPT,
            "--no-leto",
            "--bench-out",
            str(out),
            "--train-iters",
            str(iters),
            *model,
        ],
        tmp,
        "plain",
    )
    return json.loads(out.read_text())


def run_leto(
    tmp: Path,
    name: str,
    model: list[str],
    iters: int,
    nproc: int,
    leto: dict[str, Any],
    script_args: list[str],
) -> tuple[list[dict], list[str]]:
    """One leto-run job: its events and the promoted trainers' first-iteration lines."""
    events, job = tmp / f"{name}.jsonl", tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump({"leto": leto}))
    _run(
        [
            sys.executable,
            "-m",
            "leto_run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--no-dashboard",
            "--events",
            str(events),
            "--config",
            str(job),
            SCRIPT,
            "--train-iters",
            str(iters),
            *model,
            *script_args,
        ],
        tmp,
        name,
    )
    return read_events(events), FIRST.findall((tmp / f"{name}.log").read_text())


def clean_steps(kills: list[int], warm: int, total: int) -> set[int]:
    """Steps whose iteration time is steady state: after warm-up, away from every kill."""
    return {s for s in range(warm, total) if all(not k - 1 <= s <= k + 3 for k in kills)}


def leto_iteration_s(events: list[dict], steps: set[int]) -> float:
    """Median time between consecutive ``step_done`` events of rank 0 (whole loop iteration)."""
    done = {e["step"]: e["t"] for e in events if e["kind"] == "step_done" and e["rank"] == 0}
    gaps = [
        done[s] - done[s - 1]
        for s in sorted(steps)
        if s in done and s - 1 in done and s - 1 in steps
    ]
    if not gaps:
        raise RuntimeError("no clean steps to measure; raise --steps")
    return statistics.median(gaps)


def shadows_ready_before(events: list[dict], rec: summary.Recovery) -> bool:
    """Were all the shadows that this recovery promoted ready when the kill came?"""
    fault = next(
        (e for e in events if e["kind"] == "fault_injected" and e["step"] == rec.step), None
    )
    ready = [e for e in events if e["kind"] == "shadow_ready" and e["gen"] == rec.gen]
    promoted = {e["rank"] for e in events if e["kind"] == "promoted" and e["gen"] == rec.gen}
    return (
        fault is not None
        and bool(promoted)
        and promoted <= {e["rank"] for e in ready if e["t"] <= fault["t"]}
    )


def leto_result(
    events: list[dict],
    firsts: list[str],
    kills: list[int],
    warm: int,
    total: int,
    plain_s: float,
    plain_loss: list[float],
) -> dict[str, Any]:
    recs = [r for r in summary.recoveries(events) if r.total_s is not None]
    iter_s = leto_iteration_s(events, clean_steps(kills, warm, total))
    losses = summary.losses(events, rank=0)
    common = [s for s in sorted(losses) if s < len(plain_loss)]
    return {
        "iteration_s": iter_s,
        "overhead": iter_s / plain_s - 1,
        "recovery_s": [r.total_s for r in recs],
        "recovery_phases_s": [r.phases for r in recs],
        "recovery_steps": [r.step for r in recs],
        "shadows_ready_before_kill": [shadows_ready_before(events, r) for r in recs],
        "max_abs_loss_diff_vs_plain": max(
            (abs(losses[s] - plain_loss[s]) for s in common), default=None
        ),
        "loss_steps_compared": len(common),
        "first_step_s": [r.phases.get("first step") for r in recs],
        "first_iterations": firsts,
        "shadow_warm_up": [
            {
                k: e[k]
                for k in (
                    "rank",
                    "gen",
                    "ran",
                    "reason",
                    "warm_s",
                    "transient_bytes",
                    "peak_bytes",
                    "compiled_graphs",
                )
            }
            for e in events
            if e["kind"] == "model_warmed"
        ],
    }


def main() -> None:
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench/results"
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", default=str(out_dir / "megatron_gpu.json"))
    p.add_argument(
        "--model-args",
        default=None,
        help=f"examples/megatron_gpt.py model arguments (default: {MODEL!r})",
    )
    p.add_argument(
        "--small", action="store_true", help="a tiny fp32 model: checks the script on CPU or GPU"
    )
    p.add_argument("--nproc", type=int, default=1, help="ranks (gloo when they share one GPU)")
    p.add_argument("--plain-iters", type=int, default=30)
    p.add_argument("--warm", type=int, default=8, help="iterations left out at the start")
    p.add_argument(
        "--first-kill-s", type=float, default=20.0, help="seconds of training before the first kill"
    )
    p.add_argument(
        "--gap-s", type=float, default=30.0, help="seconds between kills (a new shadow gets ready)"
    )
    p.add_argument("--max-steps", type=int, default=400, help="cap on the Leto run's steps")
    p.add_argument(
        "--rmu-chunk-mib",
        type=int,
        default=256,
        help="RMU chunk: MiB of parameters per transaction",
    )
    p.add_argument("--parity", action="store_true", help="also run (b) with two-tier parity")
    p.add_argument(
        "--fusions", action="store_true", help="Megatron's jit_fuser fusions (torch.compile) on"
    )
    p.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="also run (b) with Megatron's distributed optimizer (--use-distributed-optimizer)",
    )
    p.add_argument(
        "--warm-up",
        choices=["both", "on", "off"],
        default="both",
        help="shadows warm Megatron's first iteration (on), skip it (off), or one run of each",
    )
    args = p.parse_args()
    global LOG_DIR
    LOG_DIR = Path(args.json).parent
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    if args.nproc < 1 or args.plain_iters <= args.warm:
        raise SystemExit("need --nproc >= 1 and --plain-iters > --warm")
    # one learning-rate schedule for runs of different lengths: their losses are comparable
    model = [
        *shlex.split(args.model_args or (SMALL if args.small else MODEL)),
        "--lr-decay-iters",
        str(args.max_steps),
        *(["--fusions"] if args.fusions else []),
    ]
    t_start = time.time()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "model_args": model,
        "nproc": args.nproc,
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(
            f"[{time.time() - t_start:.0f}s] (a) plain torchrun, {args.plain_iters} iterations",
            flush=True,
        )
        plain = run_plain(tmp, model, args.plain_iters, args.nproc)
        plain_s = statistics.median(plain["iter_s"][args.warm :])
        result["plain"] = {
            "iteration_s": plain_s,
            "iter_s": plain["iter_s"],
            "first_iteration_s": plain["iter_s"][0],
        }
        k1 = min(args.warm + math.ceil(args.first_kill_s / plain_s), args.max_steps // 3)
        k2 = min(k1 + math.ceil(args.gap_s / plain_s), args.max_steps - 12)
        total = k2 + 12
        if k2 <= k1 + 6:
            raise SystemExit(
                f"--max-steps {args.max_steps} leaves no room for two kills {k1}, {k2}"
            )
        kills = [
            {
                "rank": args.nproc - 1,
                "step": k1,
                "phase": "backward",
                "shadow_ready_steps_before": 1,
            },
            {
                "rank": 0,
                "step": k2,
                "phase": "update",
                "point": "optimizer",
                "chunk": 0,
                "shadow_ready_steps_before": 1,
            },
        ]
        rmu = {"consistency": "rmu", "rmu_chunk_bytes": args.rmu_chunk_mib << 20, "faults": kills}
        runs: dict[str, tuple[dict[str, Any], list[str]]] = {}
        if args.warm_up in ("both", "off"):
            runs["rmu_cold"] = (rmu, ["--no-shadow-warm-up"])
        if args.warm_up in ("both", "on"):
            runs["rmu"] = (rmu, [])
        if args.parity:
            runs["rmu_parity"] = ({**rmu, "erasure": SMALL_PARITY if args.small else PARITY}, [])
        if args.distributed_optimizer:
            runs["rmu_distopt"] = (rmu, ["--use-distributed-optimizer"])
        for name, (leto, script_args) in runs.items():
            print(
                f"[{time.time() - t_start:.0f}s] (b) leto-run {name}: {total} steps, kills at {k1}, {k2}",
                flush=True,
            )
            try:
                events, firsts = run_leto(tmp, name, model, total, args.nproc, leto, script_args)
                result[name] = leto_result(
                    events, firsts, [k1, k2], args.warm, total, plain_s, plain["loss"]
                )
            except RuntimeError as e:  # keep what the other runs measured
                print(f"  {name} failed: {e}", flush=True)
                result[name] = {"error": str(e)[-3000:]}
    print(f"[{time.time() - t_start:.0f}s] done; {args.json}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    _report(result, runs)


def _report(result: dict[str, Any], runs: dict[str, tuple[dict[str, Any], list[str]]]) -> None:
    plain_s = result["plain"]["iteration_s"]
    print(f"Megatron GPTModel {' '.join(result['model_args'])}, {result['nproc']} rank(s)")
    print(f"{'run':40s} {'iteration (ms)':>14s}")
    print(f"{'(a) plain torchrun, no Leto':40s} {plain_s * 1e3:14.1f}")
    print(
        f"    its first iteration (a fresh process): {result['plain']['first_iteration_s'] * 1e3:.0f} ms"
    )
    ok = [name for name in runs if "error" not in result[name]]
    for name in runs:
        r = result[name]
        if "error" in r:
            print(f"{'(b) leto-run ' + name:40s} {'failed':>14s}")
            continue
        print(f"{'(b) leto-run ' + name:40s} {r['iteration_s'] * 1e3:14.1f}")
        for step, total, phases, ready in zip(
            r["recovery_steps"],
            r["recovery_s"],
            r["recovery_phases_s"],
            r["shadows_ready_before_kill"],
            strict=True,
        ):
            print(
                f"    recovery, kill at step {step}: "
                + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in phases.items())
                + f" ms → total {total * 1e3:.0f} ms"
                + ("" if ready else " (shadows were NOT ready at the kill)")
            )
        print(
            f"    losses vs plain: max |diff| {r['max_abs_loss_diff_vs_plain']} over {r['loss_steps_compared']} steps"
        )
        for line in r["first_iterations"]:
            print(f"    {line}")
        for w in r["shadow_warm_up"]:
            print(
                f"    shadow rank {w['rank']} gen {w['gen']} warm-up: "
                + (
                    f"{w['warm_s']:.2f} s, peak {w['peak_bytes'] / 2**30:.2f} GiB (estimate "
                    f"{w['transient_bytes'] / 2**30:.2f}), {w['compiled_graphs']} graphs compiled"
                    if w["ran"]
                    else f"skipped ({w['reason']})"
                )
            )
    if "rmu_cold" in ok and "rmu" in ok:
        cold, warm = (statistics.median(result[n]["first_step_s"]) for n in ("rmu_cold", "rmu"))
        print(
            f"promoted trainers' first step (median): {cold * 1e3:.0f} ms without the shadow warm-up, "
            f"{warm * 1e3:.0f} ms with it"
        )
    for name in ok:
        r = result[name]
        print(
            f"{name}: recovery median {statistics.median(r['recovery_s']):.3f} s "
            f"= {statistics.median(r['recovery_s']) / plain_s:.1f} plain iterations"
        )
    for name in ok:
        r = result[name]
        print(
            f"{name}: Leto / plain iteration = {r['iteration_s'] / plain_s:.4f} ({100 * r['overhead']:+.2f} %)"
        )
    if len(ok) < len(runs):
        raise SystemExit(
            "a Leto run failed (see above); the numbers that were measured are in the JSON"
        )


if __name__ == "__main__":
    main()
