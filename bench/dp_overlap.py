"""Plain data parallelism's steady step: the gradient mean overlapped with backward.

Four jobs of the same GPT (``examples/train_gpt.py`` / ``examples/torchrun_gpt_ckpt.py``),
no failure, no checkpoint, PyTorch's default kernels, each run ``--rounds`` times with the
order rotating (a host's speed drifts within a call):

* ``leto-run``: this tree (buckets launched as backward lands the gradients,
  ``leto.trainer.grad_buckets``);
* ``leto-run, before``: the tree at ``--baseline-dir`` (e.g. ``git archive`` of the commit
  before), if given: one mean all-reduce after backward;
* ``torchrun + DDP``: ``DistributedDataParallel``, torch's fused AdamW, the strongest plain
  setup;
* ``torchrun, flat``: one all-reduce of the flattened gradients after backward.

CPU: gloo ranks on this host; GPU: one rank per GPU, NCCL. The result is the median step
period of rank 0 from step 5 on (``summary.step_periods``), per job the median over the
rounds, and each job's ratio to torchrun + DDP.

    python bench/dp_overlap.py [--nproc 2] [--rounds 3] [--steps 40] [--baseline-dir DIR] \\
        [-- <model args of examples/train_gpt.py>]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from leto.events import read_events
from leto.summary import step_periods

CPU_MODEL = ["--vocab", "4096", "--dim", "256", "--layers", "4", "--heads", "4", "--seq", "64"]
"""A model whose gradients (about 4.6 M parameters) take a gloo all-reduce some time."""


def _env(repo: Path, events: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(repo),
        "OMP_NUM_THREADS": "1",
        "LETO_EVENTS_FILE": str(events),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }


def _job(name: str, repo: Path, tmp: Path, args: argparse.Namespace) -> float:
    """Median step period (s) of one job."""
    events = tmp / f"{name.replace(' ', '_').replace(',', '').replace('+', '')}.jsonl"
    events.unlink(missing_ok=True)
    common = ["--steps", str(args.steps), *args.model]
    if name.startswith("leto-run"):
        cmd = [sys.executable, "-m", "leto_run", "--standalone", "--nproc-per-node"]
        cmd += [str(args.nproc), "--no-dashboard", "--events", str(events)]
        cmd += [str(repo / "examples/train_gpt.py"), *common]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
        cmd += [str(args.nproc), str(repo / "examples/torchrun_gpt_ckpt.py"), *common]
        cmd += ["--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", str(args.steps + 1)]
        cmd += ["--allreduce", "ddp" if name == "torchrun + DDP" else "flat"]
    proc = subprocess.run(
        cmd, check=False, env=_env(repo, events), cwd=tmp, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(f"dp_overlap: {name} failed:\n{proc.stderr[-3000:]}")
    return statistics.median(step_periods(read_events(events), first_step=5))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--baseline-dir", type=Path, help="a tree of leto before the overlap")
    p.add_argument("--json", default=str(REPO / "bench/results/dp_overlap.json"))
    p.add_argument("model", nargs="*", help="examples/train_gpt.py's model arguments")
    args = p.parse_args()
    if args.rounds < 1 or args.steps < 10:
        p.exit(2, f"{p.prog}: error: --rounds must be >= 1 and --steps >= 10\n")
    args.model = args.model or CPU_MODEL
    jobs = {"torchrun + DDP": REPO, "torchrun, flat": REPO, "leto-run": REPO}
    if args.baseline_dir is not None:
        jobs["leto-run, before"] = args.baseline_dir.resolve()
    names = list(jobs)
    times: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                times[name].append(_job(name, jobs[name], tmp, args))
            print(
                f"round {r + 1}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.1f} ms" for n in names),
                flush=True,
            )
    median = {n: statistics.median(v) for n, v in times.items()}
    base = median["torchrun + DDP"]
    for n in names:
        print(f"{n:<18} {median[n] * 1e3:8.1f} ms  / torchrun + DDP = {median[n] / base:.3f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d"),
                "nproc": args.nproc,
                "model": args.model,
                "steps": args.steps,
                "step_s": times,
                "median_s": median,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
