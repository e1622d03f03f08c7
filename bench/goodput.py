"""Goodput: the number a user decides on. Wall time to finish N steps under one failure schedule.

One call, one model (the demo GPT of examples/train_gpt.py on CPU; a mid-size GPT with
``--device cuda``), one failure schedule: kill times drawn from an exponential
distribution (mean ``--mtbf-s``, seeded), each with a rank, the same list for every
system. At each scheduled wall time (seconds since the job's launch) the bench SIGKILLs
that rank's live trainer process itself (found from the events file for leto-run, from
/proc for torchrun: no system's own fault injector). A kill that finds no live trainer
(a torchrun group still restarting) is delivered as soon as one is up again.

Systems, each fault-free and then under the schedule:

* ``leto``: leto-run, in-place recovery (default flags; PyTorch's default kernels unless
  ``--deterministic``), ``examples/train_gpt.py``;
* ``dcp``: torchrun ``--max-restarts`` + ``examples/torchrun_gpt_ckpt.py`` (``AdamW(fused=True)``)
  + synchronous ``dcp.save`` to a local-disk folder every I steps;
* ``async``: the same with ``dcp.async_save`` to ``/dev/shm`` (DCP's ``DefaultStager``,
  pinned host buffers on a GPU), I from its *blocking* cost: the strongest plain-torch setup.

I is Young's interval sqrt(2·C·MTBF)/T_iter with C and T_iter measured by a short
calibration run of each checkpointing baseline in the same call. A killed torchrun group
restarts and resumes from its newest complete checkpoint, recomputing the steps since.

ETTR = T_ref / T_failures, with T_ref the fault-free wall time of plain torchrun with fused
AdamW and no checkpoint at all (the useful work); "ETTR own" divides by the system's own
fault-free time instead (failures only, not its steady cost). Every process the bench
starts gets NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.

    python bench/goodput.py [--steps 600 --mtbf-s 20 --seed 0] [--json OUT]
    python bench/goodput.py --device cuda --steps 3000     # one GPU, one rank
                                   # (a job of a few MTBFs: the default 600 steps end in ~30 s)
    python bench/goodput.py --device cuda --fault-free leto --calib-saves 3   # within 10 min:
                                   # the torchrun systems only under failures ("ETTR own": -)

Peers (``lm-resiliency``'s GEMINI, ``nvidia-resiliency-ext``'s in-process restart) are
checked when the call starts; each one that cannot run prints one line saying why.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PEERS = REPO / ".bench-peers"
"""Where ``make bench`` installs the peers (``pip install --no-deps --target``): outside the
venv, because lm-resiliency's broken torchrun.handlers entry point makes every torchrun in
an environment that has it log a traceback. Only this process looks there."""
if PEERS.is_dir():
    sys.path.append(str(PEERS))

from bench.recovery_gpu import _env as gpu_env
from leto import summary
from leto.events import read_events

CPU_MODEL: list[str] = []  # examples/train_gpt.py's defaults: the demo GPT
CUDA_MODEL = [
    "--vocab",
    "32000",
    "--dim",
    "1024",
    "--layers",
    "12",
    "--heads",
    "16",
    "--seq",
    "512",
    "--batch",
    "8",
    "--bf16",
]
NAMES = {
    "leto": "leto-run (in place)",
    "dcp": "torchrun + DCP (sync, disk)",
    "async": "torchrun + async DCP (/dev/shm)",
}


def _env(**extra: str) -> dict[str, str]:
    """``recovery_gpu``'s environment (the NCCL/NVSHMEM variables), one thread per rank."""
    return gpu_env(**{"OMP_NUM_THREADS": "1", **extra})


def schedule(mtbf_s: float, seed: int, nproc: int, horizon_s: float) -> list[tuple[float, int]]:
    """(wall time since launch, rank) of every kill up to ``horizon_s``: exponential gaps."""
    rng = random.Random(seed)
    kills, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t > horizon_s:
            return kills
        kills.append((t, rng.randrange(nproc)))


def _alive(pid: int) -> bool:
    """A running process (not a zombie, not already exiting)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] not in ("Z", "X", "x") and not int(fields[6]) & 0x4  # PF_EXITING


class LetoPids:
    """The active trainer of a rank from leto-run's events: the newest generation a trainer
    of that rank reported ``promoted`` in (0 before any) since the last group restart, its
    pid from ``trainer_started``."""

    def __init__(self, events: Path) -> None:
        self.path, self.offset = events, 0
        self.pids: dict[tuple[int, int], int] = {}
        self.gen: dict[int, int] = {}

    def __call__(self, rank: int) -> int | None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return None
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("kind") == "group_restart":  # generations count from 0 again
                self.pids, self.gen = {}, {}
            elif e.get("kind") == "trainer_started":
                self.pids[(e["rank"], e["gen"])] = e["pid"]
            elif e.get("kind") == "promoted":
                self.gen[e["rank"]] = max(self.gen.get(e["rank"], 0), e["gen"])
        return self.pids.get((rank, self.gen.get(rank, 0)))


class TorchrunPids:
    """A rank's worker under torchrun: a child of the torchrun process with RANK=rank."""

    def __init__(self, launcher: int) -> None:
        self.launcher = launcher

    def __call__(self, rank: int) -> int | None:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                status = (d / "status").read_text()
                if f"\nPPid:\t{self.launcher}\n" not in status:
                    continue
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(d.name)
        return None


@dataclass
class Killer:
    """SIGKILLs the scheduled rank's live trainer at each scheduled time, until the job ends."""

    kills: list[tuple[float, int]]
    find: object
    t0: float
    done: threading.Event = field(default_factory=threading.Event)
    delivered: list[dict] = field(default_factory=list)

    def run(self) -> None:
        killed: set[int] = set()
        for at, rank in self.kills:
            if self.done.wait(max(0.0, self.t0 + at - time.monotonic())):
                return
            while not self.done.is_set():
                pid = self.find(rank)
                if pid is not None and pid not in killed and _alive(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    killed.add(pid)
                    late = time.monotonic() - self.t0 - at
                    self.delivered.append(
                        {"at_s": at, "late_s": late, "rank": rank, "pid": pid, "t": time.time()}
                    )
                    break
                self.done.wait(0.02)


def launch(
    cmd: list[str],
    env: dict[str, str],
    cwd: Path,
    kills: list,
    finder: str,
    events: Path,
    limit_s: float,
) -> tuple[float, list[dict], int, str]:
    """Run one job under the schedule; (wall s, kills delivered, exit code, stderr tail)."""
    log = cwd / f"{events.stem}.log"
    with log.open("wb") as out:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        find = LetoPids(events) if finder == "leto" else TorchrunPids(proc.pid)
        killer = Killer(kills, find, t0)
        thread = threading.Thread(target=killer.run, daemon=True)
        thread.start()
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        wall = time.monotonic() - t0
        killer.done.set()
        thread.join()
    return wall, killer.delivered, rc, log.read_text(errors="replace")[-3000:]


@dataclass
class Job:
    """One system's launch command and checkpoint folder."""

    key: str
    args: argparse.Namespace
    every: int = 0  # checkpoint interval in steps (torchrun systems)
    ckpt_dir: Path | None = None

    def command(self, events: Path, steps: int) -> tuple[list[str], dict[str, str], str]:
        a = self.args
        det = ["--deterministic"] if a.deterministic else []
        model = a.model_args
        if self.key == "leto":
            cmd = [
                sys.executable,
                "-m",
                "leto_run",
                "--standalone",
                "--nproc-per-node",
                str(a.nproc),
                "--max-restarts",
                str(a.max_restarts),
                "--no-dashboard",
                "--events",
                str(events),
                *det,
                str(REPO / "examples/train_gpt.py"),
                "--steps",
                str(steps),
                *model,
            ]
            return cmd, _env(), "leto"
        assert self.ckpt_dir is not None
        every = self.every if self.every > 0 else steps + 1  # 0: no checkpoint at all
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(a.nproc),
            "--max-restarts",
            str(a.max_restarts),
            str(REPO / "examples/torchrun_gpt_ckpt.py"),
            "--steps",
            str(steps),
            "--ckpt-dir",
            str(self.ckpt_dir),
            "--ckpt-every",
            str(every),
            "--ckpt-keep",
            "2",
            "--adamw",
            a.adamw,
            *(["--ckpt-async"] if self.key == "async" else []),
            *det,
            *model,
        ]
        return cmd, _env(LETO_EVENTS_FILE=str(events)), "torchrun"

    def run(self, tmp: Path, name: str, steps: int, kills: list, limit_s: float) -> dict:
        events = tmp / f"{name}.jsonl"
        events.unlink(missing_ok=True)
        if self.ckpt_dir is not None:
            shutil.rmtree(self.ckpt_dir, ignore_errors=True)
        cmd, env, finder = self.command(events, steps)
        wall, delivered, rc, tail = launch(cmd, env, tmp, kills, finder, events, limit_s)
        if self.ckpt_dir is not None:
            shutil.rmtree(self.ckpt_dir, ignore_errors=True)
        if self.args.keep:
            Path(self.args.keep).mkdir(parents=True, exist_ok=True)
            for f in (events, tmp / f"{events.stem}.log"):
                if f.exists():
                    shutil.copy(f, Path(self.args.keep) / f.name)
        evs = read_events(events) if events.exists() else []
        committed = [e for e in evs if e["kind"] == "step_done" and e["rank"] == 0]
        # a step a promoted trainer finished for its predecessor is committed once, not re-run
        done = [e for e in committed if not e.get("finished_in_recovery")]
        unique = {e["step"] for e in done}
        # neither loop waits for the device at each step's end: the period between steps,
        # not a step's own iter_s (the host's queueing time), is the step time
        periods = summary.step_periods(evs)
        return {
            "wall_s": wall,
            "rc": rc,
            "kills": delivered,
            "steps_done": len({e["step"] for e in committed}),
            "recomputed_steps": len(done) - len(unique),
            "iter_s": statistics.median(periods) if periods else None,
            "save_s": [
                e["save_s"] - e.get("wait_s", 0.0)
                for e in evs
                if e["kind"] == "digest" and e["rank"] == 0
            ],
            "recoveries": sum(e["kind"] == "recovery_done" for e in evs),
            "recovery_s": [e["total_s"] for e in evs if e["kind"] == "recovery_done"],
            "restarts": max((e.get("attempt", 0) or 0 for e in done), default=0)
            if self.key != "leto"
            else next((e["restarts"] for e in evs if e["kind"] == "job_finished"), 0),
            "restart_s": restart_times(evs, delivered) if self.key != "leto" else [],
            "log_tail": tail if rc else "",
        }


def restart_times(events: list[dict], kills: list[dict]) -> list[float]:
    """A torchrun group's restart after each kill: from the kill to the start of the first
    step of the next attempt (torchrun's detection, the new processes, their imports and
    process group, the model, the checkpoint load)."""
    first: dict[int, float] = {}
    for e in events:
        if e["kind"] == "step_done" and e["rank"] == 0 and (e.get("attempt") or 0) > 0:
            first.setdefault(e["attempt"], e["t"] - e["iter_s"])
    out = []
    for start in sorted(first.values()):
        before = [k["t"] for k in kills if k["t"] < start]
        if before:
            out.append(start - max(before))
    return out


def sim_profile(result: dict) -> dict:
    """This call's measurements as a ``leto-run sim`` profile (``workload.profile``): the
    reference iteration, leto-run's steady overhead and recoveries, each torchrun system's
    blocking checkpoint cost, interval and restart."""
    iteration_s = result["reference_iteration_s"]
    systems: dict[str, dict] = {}
    for key, row in result["systems"].items():
        iteration = row["iteration_s"] or row["iteration_with_failures_s"]
        if not row["ok"] or not iteration:
            continue
        entry = {"overhead_ratio": max(0.0, iteration / iteration_s - 1)}
        if key == "leto":
            if not row["recovery_s"]:
                continue
            entry["recovery_s"] = statistics.median(row["recovery_s"])
        else:
            if not row["restart_s"]:
                continue
            entry["init_s"] = statistics.median(row["restart_s"])
            entry["checkpoint_cost_s"] = result["calibration"][key]["checkpoint_s"]
        systems[row["name"]] = entry
    return {
        "source": f"bench/goodput.py, {result['device']}, {result['date']}",
        "iteration_time_s": iteration_s,
        "systems": systems,
    }


def sim_prediction(result: dict, profile_path: Path) -> dict[str, float]:
    """The simulator's closed-form ETTR of each profiled system at this call's MTBF (every
    failure recoverable in place), from the profile at ``profile_path``."""
    import yaml

    from leto.sim.config import load_scenario
    from leto.sim.evaluate import closed_form

    profile = json.loads(profile_path.read_text())
    systems = []
    for key, row in result["systems"].items():
        if row["name"] not in profile["systems"]:
            continue
        if key == "leto":
            systems.append(
                {"name": row["name"], "kind": "leto", "max_checkpoint_interval_iters": 10**9}
            )
        else:
            systems.append(
                {
                    "name": row["name"],
                    "kind": "checkpoint",
                    "checkpoint_interval_iters": row["interval_steps"],
                }
            )
    if not systems:
        return {}
    scenario = {
        "name": "goodput-measured",
        "workload": {"name": "goodput", "num_gpus": result["nproc"], "profile": profile_path.name},
        "failures": {"mttf_min": result["mtbf_s"] / 60, "hof_ratio": 1.0},
        "monte_carlo": {"runs": 0},
        "sweep": {"hof_ratios": [1.0]},  # no fatal failures measured: no checkpoint fallback
        "systems": systems,
    }
    path = profile_path.with_name(profile_path.stem + "_scenario.yaml")
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    return {name: p.ettr for name, p in closed_form(load_scenario(path)).items()}


def young(cost_s: float, iter_s: float, mtbf_s: float) -> int:
    return max(1, round(math.sqrt(2 * cost_s * mtbf_s) / iter_s))


def calibrate(job: Job, tmp: Path, steps: int, every: int, limit_s: float) -> tuple[float, float]:
    """(blocking checkpoint cost C, iteration T) from a short fault-free run saving every
    ``every`` steps; the first save (buffers allocated, plans built) is left out, and so is
    an async save's wait for the previous one's write (the calibration saves more often than
    Young's interval will)."""
    job.every = every
    r = job.run(tmp, f"calib_{job.key}", steps, [], limit_s)
    if r["rc"]:
        raise SystemExit(f"goodput: calibration of {job.key} failed:\n{r['log_tail']}")
    saves = r["save_s"][1:] or r["save_s"]
    return statistics.median(saves), r["iter_s"]


def peers() -> list[str]:
    """One line per pip-installable peer that this call does not run, saying why."""
    lines = []
    try:
        version = importlib.metadata.version("lm-resiliency")
    except importlib.metadata.PackageNotFoundError:
        lines.append(
            "lm-resiliency: not run: not installed (make bench installs it into .bench-peers; "
            "or pip install -e '.[bench]')"
        )
    else:
        eps = [
            ep
            for ep in importlib.metadata.entry_points(group="torchrun.handlers")
            if ep.name == "lm_resiliency"
        ]
        why = "it registers no torchrun.handlers entry point"
        for ep in eps:
            try:
                ep.load()()  # what torch's rendezvous registry does with it
                why = "its rendezvous backend registers, but this bench has no runner for it yet"
            except TypeError as e:
                why = (
                    f"its torchrun rendezvous backend does not register under torch "
                    f"{importlib.metadata.version('torch')}: the torchrun.handlers entry point "
                    f"{ep.value} is called with no arguments by torch's registry ({e}), so "
                    "torchrun --rdzv-backend lm_resiliency (GEMINI's restart path) cannot start"
                )
        lines.append(f"lm-resiliency {version}: not run: {why}")
    try:
        version = importlib.metadata.version("nvidia-resiliency-ext")
        have = f"{version} installed"
    except importlib.metadata.PackageNotFoundError:
        have = "not installed; the package index has 0.4.1 at most for this Python, not 0.7"
    lines.append(
        f"nvidia-resiliency-ext ({have}): not run: its in-process restart re-runs the training "
        "function inside the surviving processes; a SIGKILLed trainer's process is gone, and "
        "in-process restart then goes on only with spare ranks or a smaller world (this job "
        "has neither); its whole-process path (ft_launcher) is torchrun's group restart, "
        "which the torchrun rows measure"
    )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--mtbf-s", type=float, default=20.0, help="mean time between kills (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, help="ranks (default: 2 on CPU, 1 on a GPU)")
    p.add_argument("--systems", default="leto,dcp,async", help="comma-separated: leto,dcp,async")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels everywhere")
    p.add_argument("--adamw", choices=("fused", "foreach"), default="fused")
    p.add_argument("--max-restarts", type=int, default=1000)
    p.add_argument("--model-args", help="the model's flags for both scripts, one string")
    p.add_argument("--disk-dir", help="the sync DCP baseline's folder (default: a temp folder)")
    p.add_argument("--shm-dir", default="/dev/shm", help="where the async baseline writes")
    p.add_argument("--calib-steps", type=int, default=120)
    p.add_argument(
        "--calib-saves",
        type=int,
        default=6,
        help="checkpoints in each calibration run (the first is left out of C)",
    )
    p.add_argument(
        "--fault-free",
        metavar="SYSTEMS",
        help="the systems also run fault-free, for their own steady cost and 'ETTR own' "
        "(default: every system of --systems); the others only under failures",
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--keep", metavar="DIR", help="copy every run's events file and log here")
    args = p.parse_args()
    if args.steps < 1 or args.mtbf_s <= 0:
        p.exit(2, f"{p.prog}: error: --steps must be >= 1 and --mtbf-s > 0\n")
    args.nproc = args.nproc or (2 if args.device == "cpu" else 1)
    args.model_args = (
        args.model_args.split()
        if args.model_args is not None
        else (CPU_MODEL if args.device == "cpu" else CUDA_MODEL)
    )
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(NAMES)
    if unknown:
        p.exit(2, f"{p.prog}: error: --systems: unknown {', '.join(sorted(unknown))}\n")
    args.fault_free = (
        systems if args.fault_free is None else [s for s in args.fault_free.split(",") if s]
    )
    unknown = set(args.fault_free) - set(systems)
    if unknown:
        p.exit(
            2, f"{p.prog}: error: --fault-free: not in --systems: {', '.join(sorted(unknown))}\n"
        )
    if args.calib_saves < 2 or args.calib_steps < args.calib_saves:
        p.exit(2, f"{p.prog}: error: --calib-saves must be >= 2 and <= --calib-steps\n")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.exit(2, f"{p.prog}: error: --device cuda: no CUDA device\n")
    kernels = "deterministic" if args.deterministic else "default"
    for line in peers():
        print(line, flush=True)

    with tempfile.TemporaryDirectory(prefix="goodput-") as d:
        tmp = Path(d)
        disk = Path(args.disk_dir) if args.disk_dir else tmp / "ckpt"
        shm = Path(args.shm_dir) / f"goodput-{os.getpid()}"
        jobs = {
            "leto": Job("leto", args),
            "dcp": Job("dcp", args, ckpt_dir=disk),
            "async": Job("async", args, ckpt_dir=shm),
        }
        ref_job = Job("ref", args, every=0, ckpt_dir=tmp / "ref")
        try:
            return _measure(args, systems, jobs, ref_job, tmp, kernels)
        finally:
            shutil.rmtree(shm, ignore_errors=True)


def _save(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))


def _measure(args, systems, jobs, ref_job, tmp: Path, kernels: str) -> None:
    fault_free = set(args.fault_free)
    # Calibration first: it also warms the file cache the reference would otherwise pay.
    limit = 3600.0
    calib_every = max(1, args.calib_steps // args.calib_saves)
    cal = {}
    for key in ("dcp", "async"):
        if key in systems:
            cost, it = calibrate(jobs[key], tmp, args.calib_steps, calib_every, limit)
            cal[key] = {"checkpoint_s": cost, "iteration_s": it}
    # Reference: fault-free plain torchrun, no checkpoint. Its time bounds the others' limits.
    ref = ref_job.run(tmp, "ref", args.steps, [], limit)
    if ref["rc"]:
        raise SystemExit(f"goodput: the reference run failed:\n{ref['log_tail']}")
    t_ref, iter_s = ref["wall_s"], ref["iter_s"]
    limit = 20 * t_ref + 300
    kills = schedule(args.mtbf_s, args.seed, args.nproc, limit)
    for key, c in cal.items():
        jobs[key].every = c["interval_steps"] = young(c["checkpoint_s"], iter_s, args.mtbf_s)
    print(
        f"device {args.device} · {args.nproc} rank(s) · kernels: {kernels} · {args.steps} steps · "
        f"kills: exponential, mean {args.mtbf_s:g} s, seed {args.seed} "
        f"(first: {', '.join(f'{t:.1f}s/r{r}' for t, r in kills[:6])}, ...)",
        flush=True,
    )
    print(
        f"reference (torchrun, {args.adamw} AdamW, no checkpoint, no failure): {t_ref:.1f} s, "
        f"iteration {iter_s * 1e3:.1f} ms",
        flush=True,
    )
    for key, c in cal.items():
        print(
            f"{NAMES[key]}: blocking checkpoint cost C {c['checkpoint_s'] * 1e3:.1f} ms, "
            f"Young interval {c['interval_steps']} steps (MTBF {args.mtbf_s:g} s)",
            flush=True,
        )
    rows = {}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "device": args.device,
        "nproc": args.nproc,
        "kernels": kernels,
        "steps": args.steps,
        "mtbf_s": args.mtbf_s,
        "seed": args.seed,
        "model_args": args.model_args,
        "reference_s": t_ref,
        "reference_iteration_s": iter_s,
        "calibration": cal,
        "systems": rows,
        "peers": peers(),
    }
    for key in systems:
        ff = jobs[key].run(tmp, f"{key}_ff", args.steps, [], limit) if key in fault_free else None
        fail = jobs[key].run(tmp, f"{key}_fail", args.steps, kills, limit)
        for label, r in (("fault-free", ff), ("with failures", fail)):
            if r is not None and (r["rc"] or r["steps_done"] < args.steps):
                print(
                    f"{NAMES[key]} {label}: exit {r['rc']}, {r['steps_done']}/{args.steps} steps\n"
                    + r["log_tail"],
                    flush=True,
                )
        ok = not fail["rc"] and fail["steps_done"] >= args.steps
        rows[key] = {
            "name": NAMES[key],
            "fault_free_s": ff["wall_s"] if ff else None,
            "wall_s": fail["wall_s"],
            "ettr": t_ref / fail["wall_s"] if ok else 0.0,
            "ettr_own": ff["wall_s"] / fail["wall_s"] if ok and ff else None,
            "failures": len(fail["kills"]),
            "recomputed_steps": fail["recomputed_steps"],
            "interval_steps": jobs[key].every or None,
            "iteration_s": ff["iter_s"] if ff else None,
            "iteration_with_failures_s": fail["iter_s"],
            "recovery_s": fail["recovery_s"],
            "restart_s": fail["restart_s"],
            "recoveries": fail["recoveries"],
            "restarts": fail["restarts"],
            "kills": fail["kills"],
            "ok": ok,
        }
        fault_free_line = (
            f"fault-free {ff['wall_s']:.1f} s (median iteration {(ff['iter_s'] or 0) * 1e3:.1f} ms), "
            if ff
            else ""
        )
        print(
            f"  {NAMES[key]}: {fault_free_line}with failures {fail['wall_s']:.1f} s "
            f"({len(fail['kills'])} kills, median iteration {(fail['iter_s'] or 0) * 1e3:.1f} ms)"
            + (
                f"; recoveries (s): {', '.join(f'{x:.2f}' for x in fail['recovery_s'] if x)}"
                if fail["recovery_s"]
                else ""
            ),
            flush=True,
        )
        if args.json:  # each system's row as soon as it is measured: a cut call keeps them
            _save(Path(args.json), result)
    print()
    print(
        "| system | ckpt every | wall, failures (s) | fault-free (s) | ETTR | ETTR own | "
        "failures | recomputed steps | in place / restarts |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for key, r in rows.items():
        every = f"{r['interval_steps']}" if r["interval_steps"] else "-"
        own = "-" if r["ettr_own"] is None else f"{r['ettr_own'] * 100:.1f} %"
        ff_s = "-" if r["fault_free_s"] is None else f"{r['fault_free_s']:.1f}"
        print(
            f"| {r['name']} | {every} | {r['wall_s']:.1f} | {ff_s} | "
            f"{r['ettr'] * 100:.1f} % | {own} | {r['failures']} | "
            f"{r['recomputed_steps']} | {r['recoveries']} / {r['restarts']} |"
        )
    print(f"(ETTR = reference {t_ref:.1f} s / wall with failures; kernels: {kernels})")
    if args.json:
        _save(Path(args.json), result)  # also when no system ran
        out = Path(args.json)
        profile_path = out.with_name(out.stem + "_profile.json")
    else:
        profile_path = tmp / "goodput_profile.json"
    profile_path.write_text(json.dumps(sim_profile(result), indent=2))
    predicted = sim_prediction(result, profile_path)
    for key, r in rows.items():
        if r["name"] in predicted:
            print(
                f"leto-run sim ({profile_path.name}): {r['name']}: ETTR {predicted[r['name']] * 100:.1f} % "
                f"predicted, {r['ettr'] * 100:.1f} % measured (the measured wall time includes "
                "one job start-up)"
            )
    base = {k: r for k, r in rows.items() if k != "leto"}
    if "leto" in rows and base:
        best = max(base, key=lambda k: base[k]["ettr"])
        ratio = rows["leto"]["ettr"] / base[best]["ettr"] if base[best]["ettr"] else math.inf
        print(
            f"leto ETTR / best baseline ETTR ({base[best]['name']}): "
            f"{rows['leto']['ettr'] * 100:.1f} % / {base[best]['ettr'] * 100:.1f} % = {ratio:.3f}x"
        )


if __name__ == "__main__":
    main()
