"""Memory pressure on a GPU (paper §6): an activation peak that fits only without the shadow.

One rank with NCCL, so its L3 shadow holds a CUDA context and a communicator on the GPU.
At step ``BALLAST`` the demo script (``--oom-ballast-step``) waits until the shadow is
ready, then holds through forward and backward a transient activation of the device's free
memory plus 256 MiB: with the shadow alive it cannot be allocated; the retry also takes all
but 1 GiB of what the reclaim freed. The run must finish without OOM: the shadow reclaimed
(reaped, its memory seen free), the step retried, the shadow relaunched below L3 (the
retried step's peak leaves no room for it), the kill at ``KILL`` recovered in place from
that lower-level shadow, and after the recovery (fresh trainer, no ballast) the level back
at L3. Digests equal the fault-free run at every step.
Writes ``memory_pressure_gpu.json`` under ``$OUT`` (else ``bench/results/``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import REPO, assert_exact, fault_free_digests, run_leto

STEPS, BALLAST, KILL = 20, 6, 12
MODEL = ["--dim", "256", "--layers", "4", "--heads", "8", "--seq", "128", "--batch", "8", "--bf16"]


@pytest.mark.timeout(900)
def test_activation_peak_reclaims_the_shadow_and_recovery_stays_exact(tmp_path) -> None:
    reference = fault_free_digests(tmp_path, steps=STEPS, nproc=1, model_args=MODEL, timeout_s=400)

    faults = [FaultSpec(rank=0, step=KILL, phase="backward")]
    proc, events = run_leto(
        tmp_path,
        steps=STEPS,
        nproc=1,
        model_args=MODEL,
        faults=faults,
        timeout_s=400,
        script_args=["--oom-ballast-step", str(BALLAST)],
    )
    out = Path(os.environ.get("OUT") or REPO / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    kinds = (
        Kind.SHADOW_LEVEL,
        Kind.SHADOW_RECLAIMED,
        Kind.OOM_RETRY,
        Kind.SHADOW_READY,
        Kind.PROMOTED,
        Kind.RECOVERY_DONE,
    )
    (out / "memory_pressure_gpu.json").write_text(
        json.dumps(
            {"returncode": proc.returncode, "events": [e for e in events if e["kind"] in kinds]},
            indent=1,
        )
    )
    assert proc.returncode == 0, proc.stderr[-5000:]

    assert_exact(reference, events)
    reclaimed = [e for e in events if e["kind"] == Kind.SHADOW_RECLAIMED]
    assert [(e["ranks"], e["level"]) for e in reclaimed] == [([0], 3)]
    (retry,) = [e for e in events if e["kind"] == Kind.OOM_RETRY]
    assert (retry["rank"], retry["step"], retry["reclaimed_level"]) == (0, BALLAST, 3)
    assert retry["freed_bytes"] > 128 << 20, "the shadow's memory came back to the device"
    levels = [(e["reason"], e["level"]) for e in events if e["kind"] == Kind.SHADOW_LEVEL]
    assert levels[0] == ("configured", 3) and levels[2] == ("recovery", 3) and len(levels) == 3, (
        levels
    )
    assert levels[1][0] == "oom" and levels[1][1] < 3, levels
    assert [e["level"] for e in events if e["kind"] == Kind.PROMOTED] == [levels[1][1]]
    assert not [e for e in events if e["kind"] == Kind.GROUP_RESTART]
