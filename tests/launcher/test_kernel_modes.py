"""Kernel modes (``leto.kernels``): PyTorch's defaults unless ``--deterministic``.

The default-mode contract is checked within one faulty run, with no fault-free reference:
every promoted trainer's state right after attach has the digest its predecessor wrote
when it committed the step before (kills outside the update: the step is re-run; a
finished update is checked against a fault-free run by the exactness tests). ``--deterministic`` must reach every trainer, shadows
included, before the script runs.
"""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import run_leto

FAULTS = [FaultSpec(rank=1, step=3, phase="backward"), FaultSpec(rank=0, step=7, phase="forward")]


@pytest.mark.timeout(300)
def test_promoted_trainers_resume_from_the_committed_state(tmp_path) -> None:
    proc, events = run_leto(tmp_path, steps=10, faults=FAULTS, deterministic=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = [e for e in events if e["kind"] == Kind.TRAINER_STARTED.value]
    assert started and not any(e["deterministic"] for e in started), (
        "default kernels are the default"
    )
    resumed = [e for e in events if e["kind"] == Kind.RESUMED.value]
    assert len(resumed) == 2 * len(FAULTS)
    # The killed rank re-runs its step. A peer may still have been inside (or about to
    # begin) the previous step's update when the group stopped (ranks drift by up to one
    # step): its promoted trainer finishes that update ("finish", "restore+finish"), a
    # state no predecessor committed, so it has no digest to compare with here (the
    # exactness tests compare it with a fault-free run). A peer SIGKILLed by the agent
    # between committing a step and writing its digest has none either.
    killed = {(f.rank, f.step) for f in FAULTS}
    checked = set()
    for r in resumed:
        if r["action"] not in ("rerun", "none"):
            continue
        src, step = f"trainer{r['rank']}", r["step"]
        digests = [
            e
            for e in events
            if e["kind"] == Kind.DIGEST.value and e["src"] == src and e["step"] == step
        ]
        before = [e for e in digests if e["t"] < r["t"]]
        after = [e for e in digests if e["t"] > r["t"]]
        if not before and (r["rank"], step) not in killed:
            continue
        assert before and after, (r, digests)
        assert after[0]["digest"] == before[-1]["digest"], (
            f"rank {r['rank']} resumed at {step} from other state"
        )
        checked.add((r["rank"], step))
    assert checked >= killed, "every killed rank resumed from its committed state"


@pytest.mark.timeout(300)
def test_deterministic_flag_reaches_every_trainer(tmp_path) -> None:
    proc, events = run_leto(
        tmp_path, steps=4, deterministic=True, faults=[FaultSpec(rank=1, step=2, phase="forward")]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = [e for e in events if e["kind"] == Kind.TRAINER_STARTED.value]
    roles = {e["role"] for e in started}
    assert roles == {"active", "shadow"} and all(e["deterministic"] for e in started), started
