"""``LETO_PHASE_TIMES=1``: each step's phases in its ``step_done`` event, results unchanged."""

from __future__ import annotations

from leto.events import Kind
from leto.trainer.timing import ENV_PHASE_TIMES
from tests.launcher.harness import assert_exact, fault_free_digests, run_leto

PHASES = ["compute", "allreduce", "clip", "encode_grads", "join", "barrier", "update", "lend_check"]


def test_phase_times_are_reported_and_change_no_result(tmp_path, monkeypatch) -> None:
    reference = fault_free_digests(tmp_path, steps=4)
    monkeypatch.setenv(ENV_PHASE_TIMES, "1")
    proc, events = run_leto(tmp_path, steps=4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    done = [e for e in events if e["kind"] == Kind.STEP_DONE]
    assert sorted((e["rank"], e["step"]) for e in done) == [
        (r, s) for r in range(2) for s in range(4)
    ]
    for e in done:
        assert list(e["phases_s"]) == PHASES
        assert all(v >= 0 for v in e["phases_s"].values())
        assert sum(e["phases_s"].values()) <= e["iter_s"]
