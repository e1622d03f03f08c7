"""Recovery time on one GPU: leto-run vs torchrun restart + checkpoint (in memory, on disk).

The paper's §8.1 metric: recovery = initialisation (kill → training resumes) + recomputation
(regaining the progress lost since the last checkpoint). One call, one model (a GPT of
about 1.1 B parameters, bf16 compute, fp32 master weights and AdamW state), world size 1
with NCCL (or ``--nproc 2``: DP=2, one GPU per rank, each shadow with its own NCCL communicator):

(a) leto-run: SIGKILLs in backward and in the update, each after the shadow is ready;
    recovery measured end to end (kill → the interrupted step completes again).
(b) torchrun + in-memory checkpoint (Gemini-style; DCP to a tmpfs, i.e. host memory):
    the kill lands just after a checkpoint, so the run measures restart + load exactly;
    the recomputation a random failure costs on average, I/2 iterations with I from
    Young's formula sqrt(2·C·MTTF)/T_iter (C the measured save cost, MTTF 10 min), is
    added from the measured iteration time.
(c) the same with the checkpoint on local disk.

Every job runs the same kernels: PyTorch's defaults, or ``--kernels deterministic``
(leto-run ``--deterministic`` and the baseline's ``--deterministic``); the baseline updates
with torch's fused AdamW. ``--iteration-only`` compares the steady iteration alone, job
against job (``bench/steady_gpu.py`` compares the steps in one process, taking turns: a
lent GPU drifts between jobs by more than a percent).
``--model hf-llama`` runs transformers' 0.8 B ``LlamaForCausalLM`` (``examples/train_hf_llama.py``;
the baseline runs the same model with ``--arch hf-llama``) instead of the GPT.

    python bench/recovery_gpu.py --json OUT.json [--mem-dir /dev/shm/x] [--disk-dir /tmp/x]
    python bench/recovery_gpu.py --profile-from OUT.json   # only (re)write OUT_profile.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pstats
import shutil
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


LLAMA_MODEL = [
    *("--vocab", "32000", "--dim", "2048", "--layers", "14", "--heads", "16"),
    *("--kv-heads", "8", "--ffn", "5632", "--seq", "512", "--batch", "4"),
    *("--dropout", "0", "--bf16"),
]
"""``--model hf-llama``: transformers' LlamaForCausalLM of examples/train_hf_llama.py, 0.8 B."""
SCRIPTS = {"leto": "examples/train_gpt.py", "torchrun": ["examples/torchrun_gpt_ckpt.py"]}
"""The scripts every job of the call runs (``--model`` picks them)."""


def _env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    env.update(extra)
    return env


def _profiled(env: dict[str, str]) -> list[str]:
    """The profiling wrapper's path, to put before the script, where ``env`` asks for it."""
    return [str(REPO / "bench" / "profiled.py")] if "LETO_BENCH_PROFILE" in env else []


KERNELS = {"mode": "default"}
"""``--kernels``: every job of the call runs PyTorch's default kernels or deterministic ones."""


def _deterministic() -> list[str]:
    return ["--deterministic"] if KERNELS["mode"] == "deterministic" else []


def run_leto(
    tmp: Path,
    steps: int,
    kills: list[tuple[int, int, str]] | list[tuple[int, int, str, str]],
    nproc: int,
    consistency: str,
    extra: tuple[str, ...] = (),
    output: list[str] | None = None,
    **env: str,
) -> list[dict]:
    """One leto-run job's events; ``output`` (if given) gets its stdout and stderr."""
    events = tmp / "leto.jsonl"
    events.unlink(missing_ok=True)
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
        "--consistency",
        consistency,
        *_deterministic(),
        *extra,
    ]
    for rank, step, phase, *more in kills:
        cmd += ["--inject-fault", ",".join([f"rank={rank},step={step},phase={phase}", *more])]
    cmd += [*_profiled(env), str(REPO / SCRIPTS["leto"]), "--steps", str(steps), *MODEL]
    proc = subprocess.run(
        cmd, check=False, env=_env(**env), cwd=tmp, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(f"leto-run failed:\n{proc.stderr[-4000:]}")
    if output is not None:
        output.append(proc.stdout + proc.stderr)
    return read_events(events)


def run_torchrun(
    tmp: Path, ckpt_dir: Path, every: int, kill: int, steps: int, name: str, nproc: int, **env: str
) -> list[dict]:
    events = tmp / f"{name}.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "1",
        *_profiled(env),
        str(REPO / SCRIPTS["torchrun"][0]),
        *SCRIPTS["torchrun"][1:],
        "--steps",
        str(steps),
        "--ckpt-dir",
        str(ckpt_dir),
        "--ckpt-every",
        str(every),
        "--kill-at-step",
        str(kill),
        *MODEL,
        *_deterministic(),
    ]
    proc = subprocess.run(
        cmd,
        check=False,
        env=_env(LETO_EVENTS_FILE=str(events), **env),
        cwd=tmp,
        capture_output=True,
        text=True,
    )
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    if proc.returncode:
        raise SystemExit(f"torchrun baseline {name} failed:\n{proc.stderr[-4000:]}")
    return read_events(events)


def baseline(events: list[dict]) -> dict[str, float]:
    fault = next(e for e in events if e["kind"] == "fault_injected")
    loaded = min(e["t"] for e in events if e["kind"] == "resumed")
    save = statistics.median(e["save_s"] for e in events if e["kind"] == "digest")
    iter_s = statistics.median(summary.step_periods(events, first_step=2))
    interval = max(1, round(math.sqrt(2 * save * MTTF_S) / iter_s))
    init = loaded - fault["t"]
    recompute = interval / 2 * iter_s
    return {
        "iteration_s": iter_s,
        "checkpoint_s": save,
        "young_interval_steps": interval,
        "restart_and_load_s": init,
        "expected_recompute_s": recompute,
        "recovery_s": init + recompute,
    }


def sim_profile(result: dict) -> dict:
    """The measurements as a `leto-run sim` profile (configs/sim/h200-gpt1b-measured.yaml)."""
    phases = result["leto_phases_s"][0]
    mem, disk = result["torchrun_mem"], result["torchrun_disk"]
    return {
        "source": f"bench/recovery_gpu.py, H200, {result['date']}",
        "iteration_time_s": mem["iteration_s"],
        "systems": {
            "Leto": {
                "detection_s": phases["detect"],
                "init_s": statistics.median(result["leto_recovery_s"]) - phases["detect"],
                "checkpoint_cost_s": disk["checkpoint_s"],
                "ff_init_s": disk["restart_and_load_s"],
                # steady-state cost of the consistency mode measured (snapshot: a full copy per step)
                "overhead_ratio": result["leto_iteration_s"] / mem["iteration_s"] - 1,
            },
            "torchrun+mem": {
                "checkpoint_cost_s": mem["checkpoint_s"],
                "init_s": mem["restart_and_load_s"],
            },
            "torchrun+disk": {
                "checkpoint_cost_s": disk["checkpoint_s"],
                "init_s": disk["restart_and_load_s"],
            },
        },
    }


def write_profile(result: dict, result_path: Path) -> Path:
    """Write :func:`sim_profile` of ``result`` beside ``result_path`` as ``<stem>_profile.json``."""
    out = result_path.with_name(result_path.stem + "_profile.json")
    out.write_text(json.dumps(sim_profile(result), indent=2))
    return out


def profile_from(result_path: Path) -> Path:
    """The simulator profile of a stored result JSON, without measuring anything."""
    try:
        result = json.loads(result_path.read_text())
        return write_profile(result, result_path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(
            f"recovery_gpu: --profile-from {result_path}: {type(e).__name__}: {e}"
        ) from None


SETTLED = ("shadow_ready", "kernels_warmed", "model_warmed")
"""Events after which the shadows leave the GPU alone (their warm-ups run kernels on it)."""


def _settled_t(events: list[dict]) -> float:
    return max((e["t"] for e in events if e["kind"] in SETTLED), default=0.0)


def after_shadows_settled(events: list[dict]) -> tuple[float, int]:
    """Median step period (``leto.summary.step_periods``: neither loop waits for the device
    at a step's end, so a step's own ``iter_s`` is the host's) of the steps >= 5 that began
    after the shadows' last warm-up event, and how many there were (a shadow warming up
    shares the GPU with the active trainer)."""
    periods = summary.step_periods(events, first_step=5, after_t=_settled_t(events))
    if len(periods) < 5:
        raise SystemExit(
            f"recovery_gpu: only {len(periods)} steps ran after the shadows settled: raise --steps"
        )
    return statistics.median(periods), len(periods)


def median_phases(events: list[dict], settled: bool = False) -> dict[str, float]:
    """Rank 0's median seconds per phase (``LETO_PHASE_TIMES=1`` runs), steps >= 5 (and
    begun after the shadows settled, with ``settled``), and the total."""
    t0 = _settled_t(events) if settled else 0.0
    timed = [
        e
        for e in events
        if e["kind"] == "step_done"
        and "phases_s" in e  # a step finished in recovery has none
        and e["step"] >= 5
        and e.get("rank", 0) == 0
        and e["t"] - e["iter_s"] > t0
    ]
    if not timed:
        raise SystemExit("recovery_gpu: no timed step ran after the shadows settled: raise --steps")
    phases = {k: statistics.median(e["phases_s"][k] for e in timed) for k in timed[0]["phases_s"]}
    return {**phases, "total": statistics.median(e["iter_s"] for e in timed)}


def plain_torchrun(tmp: Path, args: argparse.Namespace, name: str, **env: str) -> list[dict]:
    """The events of a torchrun job of ``args.steps`` steps with no kill and no checkpoint."""
    return run_torchrun(
        tmp, Path(args.mem_dir), args.steps + 1, -1, args.steps, name, args.nproc, **env
    )


def torchrun_phases(tmp: Path, args: argparse.Namespace, mode: str = "1") -> dict[str, float]:
    """:func:`median_phases` of a torchrun run on the same kernels (``mode``: the value of
    ``LETO_PHASE_TIMES``, ``1`` synchronised or ``host``)."""
    return median_phases(plain_torchrun(tmp, args, f"plain_phases_{mode}", LETO_PHASE_TIMES=mode))


def host_phases(tmp: Path, args: argparse.Namespace) -> None:
    """leto-run's and torchrun's host time per phase (``LETO_PHASE_TIMES=host``: nothing
    waits for the device at a boundary, so each phase's time is the host's), and the calls at
    which leto-run's host waited for the device from its second step on (``LETO_SYNC_DEBUG``,
    torch's sync debug mode: one warning per call site, printed once each)."""
    output: list[str] = []
    leto = median_phases(
        run_leto(
            tmp,
            args.steps,
            [],
            args.nproc,
            args.consistency,
            output=output,
            LETO_PHASE_TIMES="host",
            LETO_SYNC_DEBUG="1",
        ),
        settled=True,
    )
    torchrun = torchrun_phases(tmp, args, "host")
    for name, phases in (("leto-run", leto), ("torchrun", torchrun)):
        print(
            f"{name} phases, host time (ms): "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items()),
            flush=True,
        )
    lines = output[0].splitlines()
    waits = [  # a warning's line names the call site; the next one quotes its source
        f"{line.strip()} | {lines[i + 1].strip() if i + 1 < len(lines) else ''}"
        for i, line in enumerate(lines)
        if "synchronizing CUDA operation" in line
    ]
    print(f"leto-run waits for the device ({len(set(waits))} call sites):", flush=True)
    for site in dict.fromkeys(waits):
        print(f"  {site}", flush=True)


def host_profile(tmp: Path, args: argparse.Namespace, top: int = 30) -> None:
    """Each job's trainer under cProfile (``bench/profiled.py``): the functions with the most
    host time of their own, per step, leto-run's and torchrun's, from the 20th step on."""
    for name in ("leto-run", "torchrun"):
        out = tmp / f"profile-{name}"
        shutil.rmtree(out, ignore_errors=True)
        if name == "leto-run":
            run_leto(tmp, args.steps, [], args.nproc, args.consistency, LETO_BENCH_PROFILE=str(out))
        else:
            plain_torchrun(tmp, args, "profiled", LETO_BENCH_PROFILE=str(out))
        files = sorted(out.glob("*.prof"))
        if not files:
            print(f"{name}: no profile written", flush=True)
            continue
        kept = Path(args.json).with_name(f"{Path(args.json).stem}_profile_{name}.prof")
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(files[0], kept)  # for pstats: callers, callees
        stats = pstats.Stats(str(files[0]))
        steps = json.loads(files[0].with_suffix(".json").read_text())["steps"]
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
        print(
            f"{name}: host time per step by function (own / with callees, us; calls per "
            f"step), {steps} steps",
            flush=True,
        )
        ours = sorted(  # Leto's own functions, by time with their callees
            ((k, v) for k, v in stats.stats.items() if f"{os.sep}leto{os.sep}" in k[0]),
            key=lambda kv: -kv[1][3],
        )[:top]
        for title, listed in (("by own time", rows), ("Leto's, by time with callees", ours)):
            print(f" {title}:", flush=True)
            for (file, line, func), (_, calls, own, cum, _) in listed:
                print(
                    f"  {own / steps * 1e6:8.1f} {cum / steps * 1e6:9.1f} "
                    f"{calls / steps:7.2f}  {Path(file).name}:{line}({func})",
                    flush=True,
                )


def print_phases(timed: dict[str, dict[str, float]]) -> None:
    for name, phases in timed.items():
        print(
            f"{name} phases, synchronised (ms): "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items()),
            flush=True,
        )


def config_args(tmp: Path, no_lend: bool = False, no_replay: bool = False) -> tuple[str, ...]:
    """leto-run's arguments for a job with ``lend_activation_memory: false`` and/or
    ``preinit.replay_forward: false`` (none if neither)."""
    lines = ["leto:"]
    if no_lend:
        lines.append("  lend_activation_memory: false")
    if no_replay:
        lines.append("  preinit:\n    replay_forward: false")
    if len(lines) == 1:
        return ()
    job = tmp / "leto-job.yaml"
    job.write_text("\n".join(lines) + "\n")
    return ("--config", str(job))


def write_result(path: str, fields: dict) -> None:
    """``fields`` as JSON at ``path``, with the date and the kernel mode."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "kernels": KERNELS["mode"],
        "script": SCRIPTS["leto"],
        "model": MODEL,
        **fields,
    }
    Path(path).write_text(json.dumps(result, indent=2))


def ablate(args: argparse.Namespace) -> None:
    """Diagnostic: where leto-run's steady step goes. The same job unsynchronised (median
    step, steps >= 5 after the shadows settled) as torchrun with fused AdamW, leto-run,
    leto-run without lending, without shadows, and without either; then
    leto-run and torchrun synchronised at every phase boundary."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        restart = ("--recovery", "restart")
        runs = {
            "leto-run": (),
            "leto-run, no lending": config_args(tmp, no_lend=True),
            "leto-run, no shadows": restart,
            "leto-run, no shadows, no lending": (*restart, *config_args(tmp, no_lend=True)),
        }
        iters = {
            "torchrun": after_shadows_settled(
                run_torchrun(
                    tmp, Path(args.mem_dir), args.steps + 1, -1, args.steps, "plain", args.nproc
                )
            )[0]
        }
        for name, extra in runs.items():
            events = run_leto(tmp, args.steps, [], args.nproc, args.consistency, extra)
            iters[name] = after_shadows_settled(events)[0]
            spread = sorted(summary.step_periods(events, first_step=5))
            print(
                f"{name}: step time p10 / p50 / p90 "
                + " / ".join(
                    f"{spread[int(q * (len(spread) - 1))] * 1e3:.1f}" for q in (0.1, 0.5, 0.9)
                )
                + " ms",
                flush=True,
            )
        for name, value in iters.items():
            ratio = value / iters["torchrun"]
            print(f"{name:<36} {value * 1e3:7.1f} ms  {ratio:.3f}x torchrun", flush=True)
        phases = {
            "leto-run": median_phases(
                run_leto(tmp, args.steps, [], args.nproc, args.consistency, LETO_PHASE_TIMES="1"),
                settled=True,
            ),
            "torchrun": torchrun_phases(tmp, args),
        }
        print_phases(phases)
    write_result(args.json, {"iteration_s": iters, "phases_s": phases})


def iteration_only(args: argparse.Namespace) -> None:
    """Steady-state iteration of leto-run (its default protection, ``--consistency``) and of
    plain torchrun with torch's fused AdamW and ``zero_grad()``, on the same model and
    kernels, in ``--rounds`` rounds that alternate which job runs first (a lent host's speed
    drifts by tens of percent within a call: a ratio is taken within a round, and the
    median over the rounds is the result). The first 5 steps are left out, and for leto-run
    the steps before its shadows' warm-ups finished (they share the GPU)."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)

        def steady(events: list[dict]) -> float:
            return statistics.median(summary.step_periods(events, first_step=5))

        if args.no_shadows_only:  # diagnostic: leto-run without shadows on the GPU, and torchrun
            timed = {
                "leto-run, no shadows": median_phases(
                    run_leto(
                        tmp,
                        args.steps,
                        [],
                        args.nproc,
                        args.consistency,
                        ("--recovery", "restart"),
                        LETO_PHASE_TIMES="1",
                    )
                ),
                "torchrun": torchrun_phases(tmp, args),
            }
            print_phases(timed)
            write_result(args.json, {"phases_s": timed})
            return

        def torchrun_round() -> dict:
            return {"s": steady(plain_torchrun(tmp, args, "plain"))}

        def leto_round(*extra: str) -> dict:
            events = run_leto(tmp, args.steps, [], args.nproc, args.consistency, extra)
            settled, quiet = after_shadows_settled(events)
            return {
                "s": settled,
                "steps_after_shadows_settled": quiet,
                "all_steps_s": steady(events),
            }

        jobs = {"torchrun": torchrun_round, "leto-run": leto_round}
        if args.with_no_lend:
            jobs["leto-run, no lending"] = lambda: leto_round(*config_args(tmp, no_lend=True))
        names = list(jobs)
        rounds = []
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # each job first in turn
            got = {name: jobs[name]() for name in order}
            base = got["torchrun"]["s"]
            for name in names[1:]:
                got[name]["ratio"] = got[name]["s"] / base
            rounds.append({"order": order, **got, "ratio": got["leto-run"]["ratio"]})
            print(
                f"round {r + 1}/{args.rounds}: torchrun {base * 1e3:.1f} ms; "
                + "; ".join(
                    f"{name} {got[name]['s'] * 1e3:.1f} ms ({got[name]['steps_after_shadows_settled']} "
                    f"steps after its shadows settled), ratio {got[name]['ratio']:.3f}"
                    for name in names[1:]
                ),
                flush=True,
            )
        if args.host_phases:  # where the host's time goes, and what makes it wait
            host_phases(tmp, args)
        if args.host_profile:
            host_profile(tmp, args)
        phases: dict = {}
        if args.phase_times:  # synchronised at every phase boundary
            phases = {
                "leto-run": median_phases(
                    run_leto(
                        tmp, args.steps, [], args.nproc, args.consistency, LETO_PHASE_TIMES="1"
                    ),
                    settled=True,
                ),
                "torchrun": torchrun_phases(tmp, args),
            }
            print_phases(phases)
    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "nproc": args.nproc,
        "consistency": args.consistency,
        "kernels": KERNELS["mode"],
        "model": MODEL,
        "baseline": "torchrun, AdamW(fused=True), zero_grad() (set_to_none=True)",
        "rounds": rounds,
        "overhead": ratio - 1,
        "leto_phases_synchronised_s": phases,
    }
    print(
        f"kernels: {KERNELS['mode']}; leto-run ({args.consistency}) / torchrun with fused AdamW and "
        f"zero_grad(), same kernels, median of {len(rounds)} rounds: {ratio:.3f} "
        f"({100 * (ratio - 1):+.1f} %; rounds "
        + ", ".join(f"{r['ratio']:.3f}" for r in rounds)
        + ")"
    )
    if args.with_no_lend:
        no_lend = statistics.median(r["leto-run, no lending"]["ratio"] for r in rounds)
        result["overhead_no_lending"] = no_lend - 1
        print(f"leto-run without lending / torchrun, median of {len(rounds)} rounds: {no_lend:.3f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


def recoveries_by_phase(args: argparse.Namespace) -> None:
    """leto-run alone: ``--kills-per-phase`` kills in each of forward, backward and the
    update, each once the shadow is ready; the recovery's p50 and phases per kill phase."""
    phases = ("forward", "backward", "update")
    n = args.kills_per_phase
    kills = [
        (
            args.nproc - 1,
            20 + KILL_SPACING * (i * len(phases) + k),
            phase,
            f"shadow_ready_steps_before={SHADOW_READY_BEFORE}",
        )
        for i in range(n)
        for k, phase in enumerate(phases)
    ]
    steps = kills[-1][1] + 12
    env = {"LETO_PHASE_TIMES": "1"} if args.phase_times else {}
    with tempfile.TemporaryDirectory() as d:
        extra = config_args(Path(d), no_lend=args.no_lend, no_replay=args.no_replay)
        events = run_leto(Path(d), steps, kills, args.nproc, args.consistency, extra, **env)
        if args.events_out:
            args.events_out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(d) / "leto.jsonl", args.events_out)
    recs = [r for r in summary.recoveries(events) if r.total_s is not None]
    iters = summary.step_periods(events)  # across no recovery: steady steps only
    print(
        f"kernels: {KERNELS['mode']}; {len(recs)} recoveries of {len(kills)} kills; "
        f"median step {statistics.median(iters) * 1e3:.1f} ms"
    )
    by_phase: dict[str, list] = {}
    for (_, step, phase, _), r in zip(kills, recs, strict=False):
        by_phase.setdefault(phase, []).append(r)
        print(
            f"  {phase:<9} step {step:>4}: "
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r.phases.items())
            + f" → {r.total_s * 1e3:.0f} ms"
        )
    if args.phase_times:  # each promoted trainer's first step by phase, against the median
        done = [e for e in events if e["kind"] == "step_done" and "phases_s" in e]
        steady = median_phases(events)
        print("steady (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in steady.items()))
        promoted = [e for e in events if e["kind"] == "promoted"]
        for p in promoted:
            first = next((e for e in done if e["rank"] == p["rank"] and e["t"] > p["t"]), None)
            if first is not None:
                print(
                    f"  first step after promotion at {first['step']} (ms): "
                    + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in first["phases_s"].items())
                    + f", total {first['iter_s'] * 1e3:.1f}"
                    + f"; graphs compiled {first.get('compiled_graphs', 0)}"
                )
    spans = first_steps_spans(events, args.nproc - 1, FIRST_STEPS)
    steady = steady_spans(events, args.nproc - 1, FIRST_STEPS, [step for _, step, _, _ in kills])
    by_span: dict[str, list[float]] = {}  # per kill: its first step over a steady step nearby
    for (_, _, phase, _), span, local in zip(kills, spans, steady, strict=False):
        if local:
            base = statistics.median(local)
            by_span.setdefault(phase, []).append(1 + (span - base) / (base / FIRST_STEPS))
    for phase, rs in by_phase.items():
        p50 = statistics.median(r.total_s for r in rs)
        first = statistics.median(r.phases.get("first step", 0.0) for r in rs)
        print(
            f"{phase:<9} p50 {p50 * 1e3:.0f} ms over {len(rs)} kills (first step p50 "
            f"{first * 1e3:.0f} ms; over the first {FIRST_STEPS} steps "
            f"{statistics.median(by_span.get(phase) or [float('nan')]):.2f}x a steady step "
            f"after the same recovery)"
        )
    write_result(
        args.json,
        {
            "kills": kills,
            "recoveries": [
                {"step": r.step, "total_s": r.total_s, "phases_s": r.phases} for r in recs
            ],
            "median_step_s": statistics.median(iters),
            "first_steps": FIRST_STEPS,
            "first_steps_s": spans,
            "steady_spans_s": steady,
            "first_step_ratios": by_span,
        },
    )


FIRST_STEPS = 3
"""Steps after a promotion whose time the first step's cost is read from."""
KILL_SPACING = 16
"""Steps between kills: room for steady windows between a recovery and the next kill's wait."""
SHADOW_READY_BEFORE = 3
"""A kill's trainer waits for its shadow this many steps before the kill (in that forward)."""
STEADY_AFTER = 5
"""Steps after a kill before a steady window may start: the recovery's first steps are past."""


def step_done_times(events: list[dict], rank: int) -> dict[int, float]:
    """Each step's ``step_done`` time for ``rank``: the newest run of a step, the one after a
    recovery that re-ran it."""
    return {e["step"]: e["t"] for e in events if e["kind"] == "step_done" and e["rank"] == rank}


def first_steps_spans(events: list[dict], rank: int, n: int) -> list[float]:
    """Per recovery of ``rank``: from its ``resumed`` event to the ``step_done`` of its n-th
    step. The host's time per step is not the device's: a promoted trainer's host runs ahead
    of its idle device first and waits for it in the steps after, so a first step's cost
    is this span less ``n - 1`` median steps, not its own ``step_done``'s time."""
    done = step_done_times(events, rank)
    spans = []
    for e in events:
        if e["kind"] == "resumed" and e["rank"] == rank:
            last = e["step"] + n - 1
            if last in done and done[last] > e["t"]:
                spans.append(done[last] - e["t"])
    return spans


def steady_spans(events: list[dict], rank: int, n: int, kill_steps: list[int]) -> list[list[float]]:
    """Per kill: the same span as ``first_steps_spans`` over windows of ``n`` steady steps after
    its recovery, each from a step's ``step_done`` to the ``step_done`` ``n`` steps on: past
    the recovery's first steps, before the next kill's wait for its shadow, and so beside the
    same replacement shadow's start-up. A first step's cost is read against these, not against
    ``n`` median steps of the whole run: a host-bound job's step drifts over a run by tens of
    per cent, and a step's period is skewed (the host runs ahead of the device, then waits), so
    ``n`` periods sum to more than ``n`` medians."""
    done = step_done_times(events, rank)
    per_kill = []
    for k in kill_steps:
        wait = k + KILL_SPACING - SHADOW_READY_BEFORE  # the next kill's wait, in this forward
        per_kill.append(
            [
                done[first + n - 1] - done[first - 1]
                for first in range(k + STEADY_AFTER + 1, wait - n + 1)
                if first - 1 in done and first + n - 1 in done
            ]
        )
    return per_kill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=str(REPO / "bench/results/recovery_gpu.json"))
    p.add_argument("--mem-dir", default="/dev/shm/leto-bench-ckpt")
    p.add_argument("--disk-dir", default=str(Path(tempfile.gettempdir()) / "leto-bench-ckpt"))
    p.add_argument(
        "--steps",
        type=int,
        help="kills at step 40 and steps-12: keep them >= ~15 s apart so the replacement shadow "
        "is ready (default: 120 for the GPT, 300 for the HF Llama, whose shadows settle later)",
    )
    p.add_argument("--small", action="store_true", help="a tiny model: checks the script on CPU")
    p.add_argument(
        "--model",
        choices=("gpt", "hf-llama"),
        default="gpt",
        help="the 1.1 B GPT of examples/train_gpt.py, or transformers' 0.8 B LlamaForCausalLM "
        "(examples/train_hf_llama.py; the baseline runs it with --arch hf-llama)",
    )
    p.add_argument(
        "--nproc", type=int, default=1, help="ranks (one GPU each when there are enough GPUs)"
    )
    p.add_argument(
        "--consistency",
        choices=("rmu", "snapshot"),
        default="rmu",
        help="leto's update consistency (rmu: the product default)",
    )
    p.add_argument(
        "--phase-times",
        action="store_true",
        help="with --iteration-only: a second leto-run, each step's phases timed (LETO_PHASE_TIMES=1)",
    )
    p.add_argument(
        "--host-phases",
        action="store_true",
        help="with --iteration-only: leto-run and torchrun timed by phase on the host alone "
        "(LETO_PHASE_TIMES=host), and the calls at which leto-run waited for the device "
        "(LETO_SYNC_DEBUG=1)",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="with --iteration-only: leto-run's and torchrun's trainers under cProfile "
        "(bench/profiled.py), the functions with the most host time per step",
    )
    p.add_argument(
        "--no-shadows-only",
        action="store_true",
        help="with --iteration-only: only leto-run without shadows (--recovery restart) and torchrun, "
        "both timed by phase (is the shadow on the GPU what slows the compute phase?)",
    )
    p.add_argument(
        "--kernels",
        choices=("default", "deterministic"),
        default="default",
        help="PyTorch's default kernels (what users run) or deterministic ones, in every job",
    )
    p.add_argument(
        "--no-lend",
        action="store_true",
        help="with --kills-per-phase: lend_activation_memory: false",
    )
    p.add_argument(
        "--no-replay",
        action="store_true",
        help="with --kills-per-phase: preinit.replay_forward: false (no forward replay)",
    )
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="micro-batches per step in every job (the paper's operating point, compute : "
        "update ~250, is about 80 on the GPT)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="leto-run's script compiles each block (examples/train_gpt.py --compile)",
    )
    p.add_argument(
        "--ablate",
        action="store_true",
        help="diagnostic: leto-run's steady step with and without shadows and lending, and by "
        "phase, against torchrun",
    )
    p.add_argument(
        "--kills-per-phase",
        type=int,
        default=0,
        help="leto-run alone: this many kills in each of forward, backward and the update "
        "(each once the shadow is ready); recovery p50 by kill phase",
    )
    p.add_argument(
        "--events-out",
        type=Path,
        metavar="JSONL",
        help="with --kills-per-phase: keep the job's event log here (every process's events, "
        "wall-clock stamped)",
    )
    p.add_argument(
        "--iteration-only",
        action="store_true",
        help="no failures: leto-run's and torchrun's steady iteration for --steps steps, same call",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="with --iteration-only: this many torchrun/leto-run pairs, alternating which runs first",
    )
    p.add_argument(
        "--with-no-lend",
        action="store_true",
        help="with --iteration-only: each round also runs leto-run with lend_activation_memory: false",
    )
    p.add_argument(
        "--profile-from",
        type=Path,
        metavar="RESULT_JSON",
        help="write RESULT_JSON's simulator profile (<stem>_profile.json beside it) and exit",
    )
    args = p.parse_args()
    if args.rounds < 1:
        p.exit(2, f"{p.prog}: error: --rounds must be >= 1, got {args.rounds}\n")
    KERNELS["mode"] = args.kernels
    if args.profile_from is not None:
        print(f"wrote {profile_from(args.profile_from)}")
        return
    if args.steps is None:
        args.steps = 300 if args.model == "hf-llama" else 120
    if args.model == "hf-llama":
        MODEL[:] = LLAMA_MODEL
        SCRIPTS["leto"] = "examples/train_hf_llama.py"
        SCRIPTS["torchrun"] = ["examples/torchrun_gpt_ckpt.py", "--arch", "hf-llama"]
    if args.small:
        MODEL[:] = ["--dim", "32", "--layers", "2", "--seq", "16", "--batch", "4"]
    if args.grad_accum < 1:
        p.exit(2, f"{p.prog}: error: --grad-accum must be >= 1, got {args.grad_accum}\n")
    if args.grad_accum > 1 and args.model != "gpt":
        p.exit(2, f"{p.prog}: error: --grad-accum runs the GPT only (--model gpt)\n")
    if args.grad_accum > 1:
        MODEL.extend(("--grad-accum", str(args.grad_accum)))
    if args.compile:
        MODEL.append("--compile")
    if args.iteration_only:
        iteration_only(args)
        return
    if args.kills_per_phase:
        recoveries_by_phase(args)
        return
    if args.ablate:
        ablate(args)
        return
    t_start = time.time()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        last = args.nproc - 1
        leto_events = run_leto(
            tmp,
            args.steps,
            [(last, 40, "backward"), (0, args.steps - 12, "update")],
            args.nproc,
            args.consistency,
        )
        print(f"[{time.time() - t_start:.0f}s] leto-run done", flush=True)
        recs = [r for r in summary.recoveries(leto_events) if r.total_s is not None]
        print(
            "leto recoveries (ms): "
            + "; ".join(
                ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r.phases.items())
                + f" → {r.total_s * 1e3:.0f}"
                for r in recs
            ),
            flush=True,
        )
        mem = baseline(run_torchrun(tmp, Path(args.mem_dir), 5, 6, 9, "mem", args.nproc))
        print(f"[{time.time() - t_start:.0f}s] torchrun + in-memory checkpoint done", flush=True)
        disk = baseline(run_torchrun(tmp, Path(args.disk_dir), 5, 6, 9, "disk", args.nproc))
        print(f"[{time.time() - t_start:.0f}s] torchrun + disk checkpoint done", flush=True)
    leto_iter = statistics.median(summary.step_periods(leto_events))
    params = next((e for e in leto_events if e["kind"] == "step_done"), {})
    leto_median = statistics.median(r.total_s for r in recs)
    print(
        f"kernels: {KERNELS['mode']}; model ~1.1B params (dim 2048 x 20 layers, vocab 32000), bf16 compute, fp32 AdamW; leto iteration "
        f"{leto_iter * 1e3:.0f} ms ({args.consistency} consistency)"
    )
    for r in recs:
        print(
            f"  leto recovery at step {r.step}: "
            + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in r.phases.items())
            + f" ms → total {r.total_s * 1e3:.0f} ms"
        )
    for name, b in (("in-memory", mem), ("disk", disk)):
        print(
            f"  torchrun + {name} ckpt: iteration {b['iteration_s'] * 1e3:.0f} ms, save {b['checkpoint_s']:.2f} s, "
            f"Young I={b['young_interval_steps']}, restart+load {b['restart_and_load_s']:.2f} s, "
            f"expected recompute {b['expected_recompute_s']:.2f} s"
        )
    print(f"{'system':42s} {'recovery (s)':>12s}")
    print(f"{'(a) leto-run in place (median)':42s} {leto_median:12.3f}")
    print(f"{'(b) torchrun + in-memory checkpoint':42s} {mem['recovery_s']:12.3f}")
    print(f"{'(c) torchrun + disk checkpoint':42s} {disk['recovery_s']:12.3f}")
    ettr = summary.ettr(leto_events)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "kernels": KERNELS["mode"],
        "leto_recovery_s": [r.total_s for r in recs],
        "leto_phases_s": [r.phases for r in recs],
        "leto_iteration_s": leto_iter,
        "leto_ettr": ettr,
        "consistency": args.consistency,
        "torchrun_mem": mem,
        "torchrun_disk": disk,
        "first_step_event": params,
        "speedup_vs_mem": mem["recovery_s"] / leto_median,
        "speedup_vs_disk": disk["recovery_s"] / leto_median,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    write_profile(result, Path(args.json))
    print(f"leto ETTR over the run: {ettr * 100:.1f} % (two failures in {args.steps} steps)")
    print(f"speedup vs disk: {result['speedup_vs_disk']:.1f}x")
    print(f"speedup vs in-memory: {result['speedup_vs_mem']:.1f}x")


if __name__ == "__main__":
    main()
