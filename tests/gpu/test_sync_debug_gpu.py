"""``LETO_SYNC_DEBUG=1`` (``leto.trainer.timing``): from its second step on, a trainer warns
at each call that makes the host wait for the GPU, which is how a step that cannot run
ahead of its kernels is diagnosed. Every step ends with one such wait (its loss, read for
``step_done``), so a job with the switch warns and the same job without it does not."""

from __future__ import annotations

import pytest

from leto.trainer.timing import ENV_SYNC_DEBUG
from tests.launcher.harness import run_leto

WARNING = "called a synchronizing CUDA operation"  # torch's own text


@pytest.mark.parametrize("debug", [True, False])
def test_sync_debug_warns_at_the_step_s_waits(tmp_path, monkeypatch, debug: bool) -> None:
    if debug:
        monkeypatch.setenv(ENV_SYNC_DEBUG, "1")
    else:
        monkeypatch.delenv(ENV_SYNC_DEBUG, raising=False)
    proc, events = run_leto(tmp_path, steps=4, nproc=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(e["kind"] == "step_done" for e in events) == 4
    assert (WARNING in proc.stdout + proc.stderr) == debug
