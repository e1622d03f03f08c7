"""Peak device memory of the update buffers, with and without lending (issue 4).

One call, one GPU, the 1.1 B GPT of bench/recovery_gpu.py (bf16 compute, fp32 state), three
fault-free leto-run jobs of ``--steps`` steps in a row:

(a) ``consistency: snapshot``: the update's copy goes to host memory, no device buffer: the
    peak the RMU must not raise;
(b) ``consistency: rmu``, ``lend_activation_memory: false``: the undo buffer is its own
    device memory;
(c) ``consistency: rmu``, ``lend_activation_memory: true``: the compute phase's activations
    borrow it (``leto.pool.lend``).

Each trainer reports its peak device footprint in ``step_done`` (``device_peak_bytes``:
retained regions + the caching allocator's peak reservation − the lent bytes it holds);
printed per job with the steady iteration and, for (c), the bytes lent. (b) and (c) also
report digests, which must be equal: lending changes no number.

    python bench/lend_gpu.py [--steps 25] [--erasure] [--json OUT.json] [--small]
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

from leto.events import read_events

MODEL = [
    "--vocab",
    "32000",
    "--dim",
    "2048",
    "--layers",
    "20",
    "--heads",
    "16",
    "--seq",
    "512",
    "--batch",
    "4",
    "--bf16",
]
SMALL = ["--dim", "64", "--layers", "2", "--seq", "32", "--batch", "4"]
JOBS = {
    "snapshot": {"consistency": "snapshot"},
    "rmu, own undo buffer": {"consistency": "rmu", "lend_activation_memory": False},
    "rmu, undo lent to activations": {"consistency": "rmu", "lend_activation_memory": True},
}


def run(tmp: Path, name: str, section: dict, steps: int, model: list[str]) -> dict:
    events = tmp / f"{len(list(tmp.glob('*.jsonl')))}.jsonl"
    job = events.with_suffix(".yaml")
    job.write_text(yaml.safe_dump({"leto": section}))
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "leto_run",
        "--standalone",
        "--nproc-per-node",
        "1",
        "--no-dashboard",
        "--digest",
        "--events",
        str(events),
        "--config",
        str(job),
        str(REPO / "examples/train_gpt.py"),
        "--steps",
        str(steps),
        *model,
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"lend_gpu: job {name!r} failed:\n{proc.stderr[-4000:]}")
    got = read_events(events)
    done = [e for e in got if e["kind"] == "step_done" and e["step"] >= 5]
    peaks = [
        e["device_peak_bytes"] for e in got if e["kind"] == "step_done" and "device_peak_bytes" in e
    ]
    return {
        "iteration_s": statistics.median(e["iter_s"] for e in done),
        "device_peak_bytes": max(peaks) if peaks else None,
        "lent_bytes": max((e.get("lent_bytes", 0) for e in done), default=0),
        "digests": {str(e["step"]): e["digest"] for e in got if e["kind"] == "digest"},
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=25)
    p.add_argument(
        "--small",
        action="store_true",
        help="a tiny model (checks the script; on CPU nothing is lent)",
    )
    p.add_argument(
        "--erasure",
        action="store_true",
        help="every job with two-tier parity (2 MiB pages, D=1024, H1=16, H2=1): the working parity "
        "(not lent) and the gradients' parity join the update",
    )
    p.add_argument("--json", default=str(REPO / "bench/results/lend_gpu.json"))
    args = p.parse_args()
    if args.erasure:
        for section in JOBS.values():
            section["erasure"] = {
                "page_bytes": 2 << 20,
                "data_pages": 1024,
                "tier1_parity": 16,
                "tier2_parity": 1,
            }
    model = SMALL if args.small else MODEL
    import torch

    if not torch.cuda.is_available():  # nothing to lend on CPU: (c) runs with the default, off
        del JOBS["rmu, undo lent to activations"]["lend_activation_memory"]
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name, section in JOBS.items():
            results[name] = run(Path(d), name, section, args.steps, model)
            r = results[name]
            peak = (
                "n/a (CPU)"
                if r["device_peak_bytes"] is None
                else f"{r['device_peak_bytes'] / 2**30:.2f} GiB"
            )
            print(
                f"{name:32s} peak {peak:>12s}  iteration {r['iteration_s'] * 1e3:7.1f} ms  "
                f"lent {r['lent_bytes'] / 2**20:8.1f} MiB",
                flush=True,
            )
    own, lent = results["rmu, own undo buffer"], results["rmu, undo lent to activations"]
    same = own["digests"] == lent["digests"] and len(own["digests"]) == args.steps
    print(f"digests of the two rmu jobs equal at all {args.steps} steps: {same}")
    if own["device_peak_bytes"] is not None:
        base = results["snapshot"]["device_peak_bytes"]
        for name in ("rmu, own undo buffer", "rmu, undo lent to activations"):
            extra = results[name]["device_peak_bytes"] - base
            print(
                f"peak over snapshot (no device update buffer), {name}: {extra / 2**20:+.1f} MiB "
                f"({100 * extra / base:+.2f} %)"
            )
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "steps": args.steps,
        "model": model,
        "erasure": args.erasure,
        "digests_equal": same,
        "jobs": {
            k: {kk: vv for kk, vv in v.items() if kk != "digests"} for k, v in results.items()
        },
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    if not same:
        raise SystemExit("lend_gpu: lending changed the digests")


if __name__ == "__main__":
    main()
