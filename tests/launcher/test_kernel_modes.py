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
from tests.launcher.harness import assert_resumed_from_committed, run_leto

FAULTS = [FaultSpec(rank=1, step=3, phase="backward"), FaultSpec(rank=0, step=7, phase="forward")]


@pytest.mark.timeout(300)
def test_promoted_trainers_resume_from_the_committed_state(tmp_path) -> None:
    proc, events = run_leto(tmp_path, steps=10, faults=FAULTS, deterministic=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = [e for e in events if e["kind"] == Kind.TRAINER_STARTED.value]
    assert started and not any(e["deterministic"] for e in started), (
        "default kernels are the default"
    )
    assert_resumed_from_committed(events, FAULTS, nproc=2)


@pytest.mark.timeout(300)
def test_deterministic_flag_reaches_every_trainer(tmp_path) -> None:
    proc, events = run_leto(
        tmp_path, steps=4, deterministic=True, faults=[FaultSpec(rank=1, step=2, phase="forward")]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    started = [e for e in events if e["kind"] == Kind.TRAINER_STARTED.value]
    roles = {e["role"] for e in started}
    assert roles == {"active", "shadow"} and all(e["deterministic"] for e in started), started
