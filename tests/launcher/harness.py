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
from leto.events import Kind, read_events

REPO = Path(__file__).resolve().parents[2]
LETO_RUN = [sys.executable, "-m", "leto_run"]  # the console script, without needing it installed
GPT = str(REPO / "examples" / "train_gpt.py")
# Small enough to be quick on 2 cores, large enough to have a middle module to kill in.
GPT_ARGS = ["--dim", "32", "--layers", "2", "--seq", "16", "--batch", "4"]


def run_leto(
    tmp: Path,
    *,
    steps: int,
    faults: list[FaultSpec] = (),
    extra: list[str] = (),
    script_args: list[str] = (),
    leto: dict | None = None,
    nproc: int = 2,
    model_args: list[str] = GPT_ARGS,
    timeout_s: float = 240,
    script: str = GPT,
    steps_flag: str = "--steps",
    deterministic: bool | None = None,
    digest: bool = True,
) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """One leto-run job; ``leto`` is a job file's ``leto:`` section (faults go there too).

    ``script`` (default: the demo GPT) gets ``steps_flag`` (its step-count argument) and
    ``model_args`` then ``script_args``. ``deterministic`` (None: where there is a GPU)
    runs it with ``--deterministic``, as a comparison with a fault-free run needs on a GPU
    (on CPU the default kernels are deterministic already). ``digest``: every rank digests
    its state at every commit (``--digest``), which reads the state back from the device."""
    events = tmp / f"events-{len(list(tmp.glob('events-*')))}.jsonl"
    if deterministic is None:
        import torch

        deterministic = torch.cuda.is_available()
    cmd = [
        *LETO_RUN,
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--no-dashboard",
        *(["--digest"] if digest else []),
        "--events",
        str(events),
        *(["--deterministic"] if deterministic else []),
        *extra,
    ]
    section = dict(leto or {})
    section["faults"] = [dataclasses.asdict(f) for f in faults]
    job = tmp / f"job-{events.stem}.yaml"
    job.write_text(yaml.safe_dump({"leto": section}))
    cmd += ["--config", str(job)]
    cmd += [script, steps_flag, str(steps), *model_args, *script_args]
    proc = subprocess.run(
        cmd, check=False, cwd=tmp, capture_output=True, text=True, timeout=timeout_s, env=_env()
    )
    return proc, read_events(events)


def run_plain(tmp: Path, script: str, steps: int, args: list[str], timeout_s: float = 300) -> str:
    """The stdout of ``script --plain`` (the same training with torch alone) under torchrun
    on 2 ranks, which must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [script, "--plain", "--steps", str(steps), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=tmp,
        env=_env(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def digests(events: list[dict]) -> dict[tuple[int, int], set[str]]:
    """(rank, committed step) -> every digest reported for it (one per report)."""
    out: dict[tuple[int, int], set[str]] = defaultdict(set)
    for e in events:
        if e["kind"] == Kind.DIGEST:
            out[(e["rank"], e["step"])].add(e["digest"])
    return dict(out)


def fault_free_run(
    tmp: Path, *, steps: int, nproc: int = 2, **run_kwargs
) -> tuple[dict[tuple[int, int], set[str]], list[dict]]:
    """The reference: a fault-free run's digests (every rank, every step, one each) and events.
    ``run_kwargs`` go to :func:`run_leto` (job section, model, script, ...)."""
    proc, events = run_leto(tmp, steps=steps, nproc=nproc, **run_kwargs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = digests(events)
    assert set(ref) == {(r, s) for r in range(nproc) for s in range(1, steps + 1)}
    assert all(len(v) == 1 for v in ref.values()), "the fault-free run must be deterministic"
    return ref, events


def fault_free_digests(
    tmp: Path, *, steps: int, nproc: int = 2, **run_kwargs
) -> dict[tuple[int, int], set[str]]:
    """The digests of :func:`fault_free_run`."""
    return fault_free_run(tmp, steps=steps, nproc=nproc, **run_kwargs)[0]


def assert_exact(reference: dict[tuple[int, int], set[str]], events: list[dict]) -> None:
    """Every digest of a run with failures equals the fault-free run's, and none is missing."""
    got = digests(events)
    assert set(got) >= set(reference), f"missing digests: {sorted(set(reference) - set(got))}"
    for key, values in got.items():
        assert values == reference.get(key), (
            f"rank {key[0]} step {key[1]} diverged from the fault-free run"
        )


def assert_recovered(
    reference: dict[tuple[int, int], set[str]],
    events: list[dict],
    faults: list[FaultSpec],
    *,
    nproc: int,
    resumed_at: list[int],
    fields: tuple[str, ...] = ("rank", "step", "phase"),
) -> None:
    """The faults fired as scheduled (compared on ``fields``), every rank resumed once per
    fault, at the steps ``resumed_at`` (a kill before the update re-runs its step, one inside
    it finishes it), and every digest equals the fault-free run's (:func:`assert_exact`)."""
    injected = [e for e in events if e["kind"] == Kind.FAULT_INJECTED]
    assert [tuple(e[k] for k in fields) for e in injected] == [
        tuple(getattr(f, k) for k in fields) for f in faults
    ]
    resumed = [e for e in events if e["kind"] == Kind.RESUMED]
    assert len(resumed) == nproc * len(faults)
    assert sorted({e["step"] for e in resumed}) == resumed_at
    assert_exact(reference, events)


def assert_resumed_from_committed(
    events: list[dict], faults: list[FaultSpec], *, nproc: int
) -> None:
    """Within one run, with no fault-free reference (kernels that are not bit-reproducible
    between jobs): every rank resumed once per fault, and each promoted trainer that re-runs
    a step has, right after attach, the digest its predecessor wrote when it committed the
    step before. A peer may still have been inside (or about to begin) the previous step's
    update when the group stopped (ranks drift by up to one step): its promoted trainer
    finishes that update ("finish", "restore+finish"), a state no predecessor committed, so
    it has no digest to compare with here, as a kill inside the update has not; a peer
    SIGKILLed by the agent between committing a step and writing its digest has none
    either. Every rank killed outside the update is checked."""
    resumed = [e for e in events if e["kind"] == Kind.RESUMED]
    assert len(resumed) == nproc * len(faults)
    killed = {(f.rank, f.step) for f in faults if f.phase != "update"}
    checked = set()
    for r in resumed:
        if r["action"] not in ("rerun", "none"):
            continue
        src, step = f"trainer{r['rank']}", r["step"]
        reported = [
            e for e in events if e["kind"] == Kind.DIGEST and e["src"] == src and e["step"] == step
        ]
        before = [e for e in reported if e["t"] < r["t"]]
        after = [e for e in reported if e["t"] > r["t"]]
        if not before and (r["rank"], step) not in killed:
            continue
        assert before and after, (r, reported)
        assert after[0]["digest"] == before[-1]["digest"], (
            f"rank {r['rank']} resumed at {step} from other state"
        )
        checked.add((r["rank"], step))
    assert checked >= killed, "every killed rank resumed from its committed state"


def resume_steps(faults: list[FaultSpec]) -> list[int]:
    """The steps every rank resumes at after ``faults``, each recovered in place (the
    ``resumed_at`` of :func:`assert_recovered`): a kill before the update (forward,
    backward, sync) re-runs its step, one inside the update finishes it."""
    return sorted({f.step + (f.phase == "update") for f in faults})


def random_schedule(
    seed: int, steps: int, count: int, min_gap: int, first: int = 4
) -> list[FaultSpec]:
    """``count`` kills at random (step, rank, phase), at least ``min_gap`` steps apart."""
    rng = random.Random(seed)
    chosen: list[int] = []
    while len(chosen) < count:
        s = rng.randrange(first, steps - 1)
        if all(abs(s - c) >= min_gap for c in chosen):
            chosen.append(s)
    return [
        FaultSpec(rank=rng.randrange(2), step=s, phase=rng.choice(PHASES)) for s in sorted(chosen)
    ]
