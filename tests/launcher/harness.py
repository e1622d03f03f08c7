"""Run real leto-run / torchrun jobs (real processes, SIGKILLs, gloo) and read their events."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import yaml

from leto.config import PHASES, FaultSpec
from leto.events import read_events

REPO = Path(__file__).resolve().parents[2]
LETO_RUN = [sys.executable, "-m", "leto_run"]  # the console script, without needing it installed
GPT = str(REPO / "examples" / "train_gpt.py")
# Small enough to be quick on 2 cores, large enough to have a middle module to kill in.
GPT_ARGS = ["--dim", "32", "--layers", "2", "--seq", "16", "--batch", "4"]


def run_leto(tmp: Path, *, steps: int, faults: list[FaultSpec] = (), extra: list[str] = (),
             script_args: list[str] = (), leto: dict | None = None, nproc: int = 2,
             model_args: list[str] = GPT_ARGS, timeout_s: float = 240, script: str = GPT,
             steps_flag: str = "--steps") -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """One leto-run job; ``leto`` is a job file's ``leto:`` section (faults go there too).

    ``script`` (default: the demo GPT) gets ``steps_flag`` (its step-count argument) and
    ``model_args`` then ``script_args``."""
    events = tmp / f"events-{len(list(tmp.glob('events-*')))}.jsonl"
    cmd = [*LETO_RUN, "--standalone", "--nproc-per-node", str(nproc), "--no-dashboard", "--digest",
           "--events", str(events), *extra]
    section = dict(leto or {})
    section["faults"] = [dataclasses.asdict(f) for f in faults]
    job = tmp / f"job-{events.stem}.yaml"
    job.write_text(yaml.safe_dump({"leto": section}))
    cmd += ["--config", str(job)]
    cmd += [script, steps_flag, str(steps), *model_args, *script_args]
    proc = subprocess.run(cmd, check=False, cwd=tmp, capture_output=True, text=True, timeout=timeout_s, env=_env())
    return proc, read_events(events)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def digests(events: list[dict]) -> dict[tuple[int, int], set[str]]:
    """(rank, committed step) -> every digest reported for it (one per report)."""
    out: dict[tuple[int, int], set[str]] = defaultdict(set)
    for e in events:
        if e["kind"] == "digest":
            out[(e["rank"], e["step"])].add(e["digest"])
    return dict(out)


def random_schedule(seed: int, steps: int, count: int, min_gap: int, first: int = 4) -> list[FaultSpec]:
    """``count`` kills at random (step, rank, phase), at least ``min_gap`` steps apart."""
    rng = random.Random(seed)
    chosen: list[int] = []
    while len(chosen) < count:
        s = rng.randrange(first, steps - 1)
        if all(abs(s - c) >= min_gap for c in chosen):
            chosen.append(s)
    return [FaultSpec(rank=rng.randrange(2), step=s, phase=rng.choice(PHASES)) for s in sorted(chosen)]
