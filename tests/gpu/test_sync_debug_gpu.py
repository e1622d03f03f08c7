"""``LETO_SYNC_DEBUG=1`` (``leto.trainer.timing``): from its second step on, a trainer warns
at each call that makes the host wait for the GPU. leto-run's own step makes none (its loss
is read a step late, ``leto.trainer.loss``), so a plain job with the switch does not warn;
the same job with ``--digest``, which reads the state back at every commit, does. Every
step's loss is still reported, once."""

from __future__ import annotations

import math

import pytest

from leto import summary
from leto.trainer.timing import ENV_SYNC_DEBUG
from tests.launcher.harness import run_leto

WARNING = "called a synchronizing CUDA operation"  # torch's own text
STEPS = 6


@pytest.mark.parametrize("digest", [False, True])
def test_only_a_job_that_reads_the_device_warns(tmp_path, monkeypatch, digest: bool) -> None:
    monkeypatch.setenv(ENV_SYNC_DEBUG, "1")
    proc, events = run_leto(tmp_path, steps=STEPS, nproc=1, digest=digest)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(e["kind"] == "step_done" for e in events) == STEPS
    assert (WARNING in proc.stdout + proc.stderr) == digest, proc.stderr[-3000:]
    losses = summary.losses(events, rank=0)
    assert sorted(losses) == list(range(STEPS))
    assert all(math.isfinite(v) for v in losses.values())
