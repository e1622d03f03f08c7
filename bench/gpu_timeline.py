"""Where a steady step's GPU time goes: leto-run against torchrun, kernel by kernel.

One call, one model, two jobs (leto-run with ``examples/train_gpt.py``; torchrun with
``examples/torchrun_gpt_ckpt.py`` and torch's fused AdamW, no checkpoint), same kernels.
In each trainer a watcher thread (a ``sitecustomize`` this bench puts first on the
path: nothing in the scripts changes) waits for ``--from-step``, once the job's shadows
are ready, then records ``--window-s`` of CUDA activity with ``torch.profiler`` (CUPTI
sees every thread's kernels) and writes the trace. The bench prints, per step:

* GPU busy time (the union of kernels, copies and sets) and idle time: a step whose GPU
  idles is bound by its host;
* the kernels grouped (GEMMs, attention, AdamW/update, parity/erasure, elementwise,
  reductions, copies), leto-run against torchrun;
* the kernels both jobs run, matched by name: how much slower each is under leto-run
  (the same kernel over retained CUDA VMM memory vs the caching allocator's).

    python bench/gpu_timeline.py [--model gpt|hf-llama|goodput] [--steps 420 --from-step 300]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.recovery_gpu import LLAMA_MODEL, MODEL
from bench.recovery_gpu import _env as gpu_env
from leto.events import read_events

MODELS = {
    "gpt": (["examples/train_gpt.py"], ["examples/torchrun_gpt_ckpt.py"], MODEL),
    "hf-llama": (
        ["examples/train_hf_llama.py"],
        ["examples/torchrun_gpt_ckpt.py", "--arch", "hf-llama"],
        LLAMA_MODEL,
    ),
    "goodput": (
        ["examples/train_gpt.py"],
        ["examples/torchrun_gpt_ckpt.py"],
        ["--vocab", "32000", "--dim", "1024", "--layers", "12", "--heads", "16"]
        + ["--seq", "512", "--batch", "8", "--bf16"],
    ),
}
"""``--model``: (leto script, torchrun script and flags, model flags): the 1.1 B GPT and the
0.8 B Llama of bench/recovery_gpu.py, the mid-size GPT of bench/goodput.py."""

SITECUSTOMIZE = """
import json, os, sys, threading, time

def _leto_timeline_watch():
    out, events = os.environ["LETO_TIMELINE_OUT"], os.environ["LETO_EVENTS_FILE"]
    from_step, window = int(os.environ["LETO_TIMELINE_FROM"]), float(os.environ["LETO_TIMELINE_S"])
    need_shadow = os.environ.get("LETO_TIMELINE_SHADOWS") == "1"
    offset, ready, stepped = 0, not need_shadow, False
    while not (ready and stepped):
        time.sleep(0.05)
        try:
            with open(events, "rb") as f:
                f.seek(offset)
                chunk = f.read()
        except OSError:
            continue
        end = chunk.rfind(b"\\n") + 1
        offset += end
        for line in chunk[:end].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            ready = ready or e.get("kind") == "shadow_ready"
            stepped = stepped or (e.get("kind") == "step_done" and e.get("step", -1) >= from_step)
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return  # the launcher, the state manager, a shadow not yet on the device
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.start()
    t0 = time.time()
    time.sleep(window)
    torch.cuda.synchronize()
    t1 = time.time()
    prof.stop()
    path = os.path.join(out, f"{os.getpid()}.json")
    prof.export_chrome_trace(path)
    with open(path + ".window", "w") as f:
        json.dump({"t0": t0, "t1": t1, "pid": os.getpid()}, f)

if os.environ.get("LETO_TIMELINE_OUT"):
    threading.Thread(target=_leto_timeline_watch, daemon=True).start()
"""

GROUPS = [
    ("gemm", re.compile(r"gemm|cutlass|sm90_xmma|nvjet|cublas|matmul", re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient", re.IGNORECASE)),
    ("update", re.compile(r"adam|_rmu|fused_.*optim|multi_tensor_apply", re.IGNORECASE)),
    ("parity", re.compile(r"parity|syndrome|erasure|gf16|xor|_encode", re.IGNORECASE)),
    ("reduce", re.compile(r"reduce|norm|softmax|sum", re.IGNORECASE)),
    ("copy", re.compile(r"^Memcpy|^Memset|copy|cat", re.IGNORECASE)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|fill", re.IGNORECASE)),
]


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if pattern.search(name):
            return group
    return "other"


def gpu_activity(trace: Path) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every kernel, copy and set in a chrome trace."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    return [
        (e["name"], float(e["ts"]), float(e["dur"]))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]


def durations_by_name(acts: Iterable[tuple[str, float, float]]) -> dict[str, list[float]]:
    """The activities' durations (µs), grouped by name."""
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for name, _, dur in acts:
        by_name[name].append(dur)
    return by_name


def busy_us(acts: list[tuple[str, float, float]]) -> float:
    """The union of the activities' intervals (µs): what the GPU was busy for."""
    total, end = 0.0, -1.0
    for _, start, dur in sorted(acts, key=lambda a: a[1]):
        stop = start + dur
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def run_job(system: str, args: argparse.Namespace, tmp: Path, site: Path) -> dict:
    """One job with the watcher on; its step times and the profiled trainer's activity."""
    leto_script, torchrun_script, model = MODELS[args.model]
    out = tmp / system
    out.mkdir()
    events = tmp / f"{system}.jsonl"
    kernels = ["--deterministic"] if args.deterministic else []
    if system == "leto":
        cmd = [sys.executable, "-m", "leto_run", "--standalone", "--nproc-per-node", "1"]
        cmd += ["--no-dashboard", "--events", str(events), *kernels]
        cmd += [str(REPO / leto_script[0]), *leto_script[1:]]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", "1", str(REPO / torchrun_script[0]), *torchrun_script[1:]]
        cmd += ["--ckpt-dir", str(tmp / "ckpt"), "--ckpt-every", str(args.steps + 1), *kernels]
    cmd += ["--steps", str(args.steps), *model]
    env = gpu_env(
        PYTHONPATH=f"{site}{os.pathsep}{REPO}",
        LETO_EVENTS_FILE=str(events),
        LETO_TIMELINE_OUT=str(out),
        LETO_TIMELINE_FROM=str(args.from_step),
        LETO_TIMELINE_S=str(args.window_s),
        LETO_TIMELINE_SHADOWS="1" if system == "leto" else "0",
    )
    log = tmp / f"{system}.log"
    with log.open("wb") as f:
        rc = subprocess.run(
            cmd, check=False, env=env, cwd=tmp, stdout=f, stderr=subprocess.STDOUT
        ).returncode
    if rc:
        raise SystemExit(f"gpu_timeline: {system} exited {rc}:\n{log.read_text()[-3000:]}")
    traces = sorted(out.glob("*.json"), key=lambda p: p.stat().st_size)
    if not traces:
        raise SystemExit(f"gpu_timeline: {system} wrote no trace (window past the job's end?)")
    trace = traces[-1]  # the trainer: a shadow's trace, if any, holds next to nothing
    window = json.loads(Path(f"{trace}.window").read_text())
    done = [e for e in read_events(events) if e["kind"] == "step_done" and e["rank"] == 0]
    inside = [e for e in done if window["t0"] <= e["t"] <= window["t1"]]
    acts = gpu_activity(trace)
    if not acts or len(inside) < 3:
        raise SystemExit(f"gpu_timeline: {system}: {len(acts)} activities, {len(inside)} steps")
    span = (window["t1"] - window["t0"]) * 1e6
    steps = len(inside)
    by_name = durations_by_name(acts)
    return {
        "steps": steps,
        "iter_ms": statistics.median(e["iter_s"] for e in inside) * 1e3,
        "wall_per_step_ms": span / steps / 1e3,
        "busy_per_step_ms": busy_us(acts) / steps / 1e3,
        "by_name": {n: (len(d) / steps, sum(d) / steps / 1e3) for n, d in by_name.items()},
    }


def report(rows: dict[str, dict]) -> None:
    leto, ref = rows["leto"], rows["torchrun"]
    print("| per step | torchrun | leto-run | leto − torchrun |")
    print("|---|---:|---:|---:|")
    for key, label in (
        ("iter_ms", "step (median, host)"),
        ("wall_per_step_ms", "window / steps"),
        ("busy_per_step_ms", "GPU busy"),
    ):
        print(f"| {label} ms | {ref[key]:.2f} | {leto[key]:.2f} | {leto[key] - ref[key]:+.2f} |")
    idle = {k: r["wall_per_step_ms"] - r["busy_per_step_ms"] for k, r in rows.items()}
    print(
        f"| GPU idle ms | {idle['torchrun']:.2f} | {idle['leto']:.2f} | "
        f"{idle['leto'] - idle['torchrun']:+.2f} |"
    )
    groups: dict[str, dict[str, float]] = {k: collections.Counter() for k in rows}
    for k, r in rows.items():
        for name, (_, ms) in r["by_name"].items():
            groups[k][group_of(name)] += ms
    print("\n| kernel group, ms per step | torchrun | leto-run | leto − torchrun |")
    print("|---|---:|---:|---:|")
    for g in sorted(set(groups["leto"]) | set(groups["torchrun"])):
        a, b = groups["torchrun"][g], groups["leto"][g]
        print(f"| {g} | {a:.2f} | {b:.2f} | {b - a:+.2f} |")
    shared = set(leto["by_name"]) & set(ref["by_name"])
    diffs = []
    for name in shared:
        (nl, ml), (nr, mr) = leto["by_name"][name], ref["by_name"][name]
        diffs.append((ml - mr, name, nr, mr, nl, ml))
    print("\n| kernel both run (by leto − torchrun) | calls/step t / l | ms/step t | ms/step l |")
    print("|---|---:|---:|---:|")
    for d, name, nr, mr, nl, ml in sorted(diffs, reverse=True)[:12]:
        print(f"| {name[:90]} | {nr:.1f} / {nl:.1f} | {mr:.3f} | {ml:.3f} |")
    for label, row, top in (("leto-run", leto, 12), ("torchrun", ref, 8)):
        only = sorted(
            ((ms, n, c) for n, (c, ms) in row["by_name"].items() if n not in shared), reverse=True
        )
        print(f"\n| kernel only {label} runs | calls/step | ms/step |")
        print("|---|---:|---:|")
        for ms, name, calls in only[:top]:
            print(f"| {name[:90]} | {calls:.1f} | {ms:.3f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt")
    p.add_argument("--steps", type=int, default=420)
    p.add_argument("--from-step", type=int, default=300)
    p.add_argument("--window-s", type=float, default=2.0)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--systems", default="torchrun,leto")
    p.add_argument("--json", help="write the per-step numbers here")
    args = p.parse_args()
    if not 0 <= args.from_step < args.steps:
        p.exit(2, f"{p.prog}: error: --from-step must be in [0, --steps)\n")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="timeline-") as d:
        tmp = Path(d)
        site = tmp / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        for system in args.systems.split(","):
            t0 = time.monotonic()
            rows[system] = run_job(system, args, tmp, site)
            print(
                f"{system}: {rows[system]['steps']} steps profiled, "
                f"{time.monotonic() - t0:.0f} s for the job",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    kernels = "deterministic" if args.deterministic else "default"
    print(f"\nmodel {args.model} · kernels: {kernels} · window {args.window_s:g} s\n")
    if {"leto", "torchrun"} <= set(rows):
        report(rows)


if __name__ == "__main__":
    main()
