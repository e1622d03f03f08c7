"""Megatron's first iteration in a fresh process against steady state, and what the
shadow's model warm-up (``lm.run_throwaway``, as ``lm.warm_up_shadow`` runs it) takes off it.

Each case is a fresh process, world size 1 (gloo with the ``torch.cuda`` shims on CPU,
NCCL on a GPU), examples/megatron_gpt.py's model and step without Leto (torch AdamW,
clipping); every time is device-synchronised:

* cold: build the model, then --iters iterations;
* warmed: first one forward+backward of a throwaway one-layer GPTModel with the job's
  shapes (timed: what a shadow spends), then the same.

Reported: iteration 0 and 1, the steady median, the first iteration's excess over it, and
the ``torch.compile`` (``jit_fuser``) compilations of each phase, function by function.

    python bench/megatron_first_iter.py [--fusions] [--model-args "..."] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SMALL = "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 4 --seed 1234"
GPU = (
    "--num-layers 20 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 2 "
    "--vocab-size 32000 --seed 1234 --bf16"
)


def compiles() -> list[dict[str, Any]]:
    """Dynamo's compilations so far: function, forward or backward, seconds."""
    from torch._dynamo.utils import get_compilation_metrics

    out = []
    for m in get_compilation_metrics():
        seconds = getattr(m, "entire_frame_compile_time_s", None)
        if seconds is None and getattr(m, "duration_us", None) is not None:
            seconds = m.duration_us / 1e6
        out.append({"function": m.co_name, "forward": getattr(m, "is_forward", None), "s": seconds})
    return out


def child(case: str, script_args: list[str], iters: int) -> dict[str, Any]:
    """One fresh process: (warm-up,) build, iterations; returns the timings."""
    t_start = time.perf_counter()
    sys.path.insert(0, str(REPO / "examples"))
    import megatron_gpt as ex
    import torch
    import torch.distributed as dist

    from leto.integrations import megatron as lm

    sys.argv = [sys.argv[0], *script_args]
    args = ex.parse_args()
    lm.require_megatron()
    ex.setup_torch()
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=0,
        world_size=1,
        device_id=device if device.type == "cuda" else None,
    )
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    lm.reseed_tracker(args.seed, -1)
    from leto.trainer.context import warm_up

    warm_up(device)  # what every shadow runs in leto.init(), L2+
    result: dict[str, Any] = {
        "case": case,
        "device": str(device),
        "startup_s": time.perf_counter() - t_start,
    }
    if case == "warmed":
        ex._sync(device)
        t0 = time.perf_counter()
        config = dataclasses.replace(ex.transformer_config(args), num_layers=1)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            lm.run_throwaway(
                device,
                config,
                vocab_size=args.vocab_size,
                max_sequence_length=args.max_position_embeddings or args.seq_length,
                loss_fn=lambda m: ex.forward_loss(m, ex.get_batch(0, 0, args, device), args.bf16),
            )
        ex._sync(device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        result["warm_up_s"] = time.perf_counter() - t0
        result["warm_up_compiles"] = compiles()
    before = len(compiles())
    t0 = time.perf_counter()
    plain = ex.Baseline(ex.Rank(0, 1, device), args, isolated=False)
    ex._sync(device)
    result["build_s"] = time.perf_counter() - t0
    result["iter_s"] = [plain.step(it)[0] for it in range(iters)]
    result["first_iteration_compiles"] = compiles()[before:]
    dist.destroy_process_group()
    return result


def run_case(case: str, script_args: list[str], iters: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
        ),
    }
    cmd = [
        sys.executable,
        __file__,
        "--child",
        case,
        "--iters",
        str(iters),
        "--model-args",
        shlex.join(script_args),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"{case} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(lines[-1])


def _compiled(entries: list[dict[str, Any]]) -> str:
    if not entries:
        return "none"
    return ", ".join(
        f"{e['function']} {e['s']:.2f} s" if e["s"] is not None else e["function"] for e in entries
    )


def main() -> None:
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench/results"
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model-args",
        default=None,
        help=f"examples/megatron_gpt.py model arguments (default CPU: {SMALL!r}; GPU: {GPU!r})",
    )
    p.add_argument(
        "--fusions", action="store_true", help="Megatron's jit_fuser fusions (torch.compile) on"
    )
    p.add_argument("--iters", type=int, default=8)
    p.add_argument(
        "--json", default=None, help=f"default {out_dir}/megatron_first_iter[_fusions].json"
    )
    p.add_argument("--child", choices=["cold", "warmed"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, shlex.split(args.model_args), args.iters)), flush=True)
        return
    if args.iters < 4:
        raise SystemExit("--iters must be >= 4 (iteration 0, 1 and a steady median)")
    import torch

    default = GPU if torch.cuda.is_available() else SMALL
    script_args = [
        *shlex.split(args.model_args or default),
        *(["--fusions"] if args.fusions else []),
    ]
    results = {case: run_case(case, script_args, args.iters) for case in ("cold", "warmed")}
    print(
        f"Megatron GPTModel {' '.join(script_args)}, one fresh process per case on {results['cold']['device']}"
    )
    print(
        f"{'case':10s} {'warm-up s':>10s} {'iter 0 ms':>10s} {'iter 1 ms':>10s} {'steady ms':>10s} {'excess ms':>10s}"
    )
    for case, r in results.items():
        steady = statistics.median(r["iter_s"][2:])
        r["steady_s"], r["first_excess_s"] = steady, r["iter_s"][0] - steady
        warm = f"{r['warm_up_s']:10.2f}" if "warm_up_s" in r else f"{'-':>10s}"
        print(
            f"{case:10s} {warm} {r['iter_s'][0] * 1e3:10.1f} {r['iter_s'][1] * 1e3:10.1f} {steady * 1e3:10.1f} "
            f"{r['first_excess_s'] * 1e3:10.1f}"
        )
    print(f"  compiled in the warm-up: {_compiled(results['warmed'].get('warm_up_compiles', []))}")
    for case, r in results.items():
        print(
            f"  compiled in the first iteration, {case}: {_compiled(r['first_iteration_compiles'])}"
        )
    path = Path(
        args.json or out_dir / f"megatron_first_iter{'_fusions' if args.fusions else ''}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"date": time.strftime("%Y-%m-%d"), "model_args": script_args, **results}, indent=2
        )
    )
    cold, warmed = results["cold"]["first_excess_s"], results["warmed"]["first_excess_s"]
    print(
        f"first-iteration excess over steady state: {cold * 1e3:.0f} ms cold → {warmed * 1e3:.0f} ms after the "
        f"warm-up ({warmed / cold:.2f}x)"
        if cold > 0
        else "no first-iteration excess to remove"
    )


if __name__ == "__main__":
    main()
