"""FSDP2 on one GPU: leto-run's steady iteration and in-place recovery vs the same script
under torchrun.

One call, one model (``examples/train_llama_fsdp.py`` at about 1.2 B parameters: Llama
blocks, ``fully_shard`` per block and at the root, ``MixedPrecisionPolicy(bf16, fp32)``),
world size 1 with NCCL, PyTorch's default kernels:

(a) torchrun, the script's ``--plain`` loop with ``AdamW(fused=True)``: mean step after
    the first 5;
(b) leto-run, the same script (leto's fused AdamW over the retained shards): the median
    step after the shadows settled, then SIGKILLs in backward, the update and forward,
    each once the shadow is ready; per recovery, its phases (``recovery_done``).

    python bench/fsdp2_gpu.py [--steps 60] [--json OUT.json]
    python bench/fsdp2_gpu.py --small      # a tiny model: checks the script on CPU
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.recovery_gpu import _env, after_shadows_settled, config_args
from leto.events import Kind, read_events

SCRIPT = str(REPO / "examples" / "train_llama_fsdp.py")
MODEL = ["--vocab", "32000", "--dim", "2048", "--layers", "20", "--heads", "16"]
MODEL += ["--seq", "512", "--batch", "4", "--bf16"]
SMALL = ["--vocab", "128", "--dim", "32", "--layers", "2", "--heads", "4", "--seq", "16"]
SMALL += ["--batch", "2"]
KILLS = ("backward", "update", "forward")


def plain(args: argparse.Namespace, model: list[str], cwd: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    cmd += [str(args.nproc), SCRIPT, "--plain", "--steps", str(args.steps), *model]
    cmd += [] if args.small else ["--fused"]
    proc = subprocess.run(cmd, env=_env(), cwd=cwd, capture_output=True, text=True, check=False)
    found = re.findall(r"mean step (\S+) ms", proc.stdout)
    if proc.returncode or not found:
        raise SystemExit(f"fsdp2_gpu: torchrun failed:\n{proc.stderr[-4000:]}")
    return float(found[0]) / 1e3


def leto(args: argparse.Namespace, model: list[str], cwd: Path) -> list[dict]:
    events = cwd / "leto.jsonl"
    cmd = [sys.executable, "-m", "leto_run", "--standalone", "--nproc-per-node", str(args.nproc)]
    cmd += ["--no-dashboard", "--events", str(events), *config_args(cwd, no_replay=args.no_replay)]
    every = args.steps // (len(KILLS) + 1)
    for k, phase in enumerate(KILLS):
        step = every * (k + 1)
        cmd += ["--inject-fault", f"rank=0,step={step},phase={phase},shadow_ready_steps_before=1"]
    cmd += [SCRIPT, "--steps", str(args.steps), *model]
    env = _env(LETO_PHASE_TIMES="1") if args.phase_times else _env()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"fsdp2_gpu: leto-run failed:\n{proc.stderr[-4000:]}")
    return read_events(events)


def print_first_steps(events: list[dict]) -> None:
    """Rank 0's phases: the first full step after each resume, and the median step."""
    timed, firsts, after_resume = [], [], False
    for e in events:
        if e["kind"] == Kind.RESUMED and e.get("rank") == 0:
            after_resume = True
        elif (
            e["kind"] == Kind.STEP_DONE
            and e.get("rank") == 0
            and "phases_s" in e
            and not e.get("finished_in_recovery")
        ):
            timed.append(e)
            if after_resume:
                firsts.append(e)
                after_resume = False
    steady = timed[5:]
    phases = {k: statistics.median(e["phases_s"][k] for e in steady) for k in steady[0]["phases_s"]}

    def show(name: str, phases: dict[str, float], total: float) -> None:
        items = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items())
        print(f"{name}: {total * 1e3:.1f} ms ({items})")

    show("steady (median)", phases, statistics.median(e["iter_s"] for e in steady))
    for e in firsts:
        show(f"first step after promotion, step {e['step']}", e["phases_s"], e["iter_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--small", action="store_true", help="a tiny model: checks the script on CPU")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument(
        "--phase-times",
        action="store_true",
        help="synchronised phases per step (LETO_PHASE_TIMES=1): the first step after each "
        "promotion against the steady median",
    )
    p.add_argument(
        "--no-replay",
        action="store_true",
        help="preinit.replay_forward: false (no unsharded forward replay in the shadows)",
    )
    p.add_argument("--leto-only", action="store_true", help="no torchrun run")
    args = p.parse_args()
    model = SMALL if args.small else MODEL
    with tempfile.TemporaryDirectory() as d:
        cwd = Path(d)
        torch_s = float("nan") if args.leto_only else plain(args, model, cwd)
        events = leto(args, model, cwd)
    for e in events:
        if e["kind"] == Kind.MODEL_WARMED:
            print(
                f"rank {e['rank']} gen {e['gen']} {e['name']}: ran {e['ran']} ({e['reason']}), "
                f"{e['warm_s']:.2f} s, peak {e['peak_bytes'] / 2**30:.2f} GiB"
            )
    leto_s, n = after_shadows_settled(
        [e for e in events if e["kind"] != Kind.STEP_DONE or not e.get("finished_in_recovery")]
    )
    recoveries = [e for e in events if e["kind"] == Kind.RECOVERY_DONE]
    print(f"kernels: default; model: {' '.join(model)}")
    print(f"torchrun (fused AdamW): {torch_s * 1e3:.1f} ms/step")
    print(f"leto-run:               {leto_s * 1e3:.1f} ms/step (median of {n} settled steps)")
    print(f"leto-run / torchrun:    {leto_s / torch_s:.3f}")
    for e in recoveries:
        phases = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in e["phases_s"].items())
        print(f"recovery gen {e['gen']}: total {e['total_s'] * 1e3:.0f} ms ({phases})")
    totals = [e["total_s"] for e in recoveries]
    if totals:
        print(f"recovery median: {statistics.median(totals) * 1e3:.0f} ms over {len(totals)} kills")
    if args.phase_times:
        print_first_steps(events)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "kernels": "default",
                    "model": model,
                    "torchrun_s": torch_s,
                    "leto_s": leto_s,
                    "recoveries": [
                        {"gen": e["gen"], "total_s": e["total_s"], "phases_s": e["phases_s"]}
                        for e in recoveries
                    ],
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
