"""A shadow that mapped the marker ahead resumes from the marker as it finally landed.

On a GPU the marker is written in stream order into a mapped host page, and the trainer
reads a host copy taken when it mapped the page (``leto.retained.marker.Marker``). A shadow
maps its regions while its predecessor still trains, so its copy is stale by the time it is
promoted: ``RetainedState`` must ``reload()`` it, or the shadow resumes from the step it
saw when it mapped, over state that is several steps further on.

On CPU the marker has no separate copy (the words are the memory), so the staleness
cannot arise by itself. ``LETO_MAPPED_MARKER=1`` (``leto.trainer.memory``) gives the marker
the GPU's write path over a second view of the same memory; the host copy and the reload
are then the GPU's, in real leto-run jobs with real SIGKILLs. Each kill waits for its
rank's shadow a few steps earlier (``FaultSpec.shadow_ready_steps_before``), so that shadow
maps the marker and its predecessor then commits further steps. Every digest must equal
the fault-free run's (without the reload the killed rank resumes several steps back, over
newer state), and the killed rank's shadow must have mapped ahead where it was told to.
"""

from __future__ import annotations

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from leto.trainer.memory import ENV_MAPPED_MARKER
from tests.launcher.harness import assert_exact, fault_free_digests, run_leto

STEPS = 20


@pytest.mark.timeout(600)
def test_promoted_shadows_read_the_marker_that_landed(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_MAPPED_MARKER, "1")
    reference = fault_free_digests(tmp_path, steps=STEPS)
    # Each kill waits for its rank's shadow 4 steps earlier: the shadow maps the marker, then
    # its predecessor commits 4 more steps (on CPU shadows start slower than steps run).
    faults = [
        FaultSpec(rank=1, step=8, phase="update", shadow_ready_steps_before=4),
        FaultSpec(rank=0, step=16, phase="backward", shadow_ready_steps_before=4),
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    assert len([e for e in events if e["kind"] == Kind.SHADOWS_PROMOTED]) == len(faults)
    resumed = [e for e in events if e["kind"] == Kind.RESUMED]
    assert sorted((e["gen"], e["rank"]) for e in resumed) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for fault in faults:  # the killed rank's shadow mapped the marker >= 4 steps before the kill
        (e,) = [
            e for e in resumed if e["rank"] == fault.rank and e["gen"] == faults.index(fault) + 1
        ]
        assert e["mapped_ahead_step"] is not None, e
        assert e["mapped_ahead_step"] <= fault.step - fault.shadow_ready_steps_before, e


def test_the_injector_waits_for_the_shadow_n_steps_before_the_kill() -> None:
    from leto.errors import ConfigError
    from leto.events import EventLog
    from leto.faults import FaultInjector

    fault = FaultSpec(rank=0, step=8, phase="update", shadow_ready_steps_before=4)
    inj = FaultInjector(0, [fault], EventLog(None, "t"), claim=lambda i: True)
    waits: list[tuple[int, str]] = []
    inj.wait_for_shadow = lambda: waits.append((inj.step, phase))
    for inj.step in range(8):
        for phase in ("forward", "backward", "sync", "update"):
            inj.point(phase)
    assert waits == [(4, "forward")] and inj.injected == 0
    with pytest.raises(ConfigError, match="shadow_ready_steps_before"):
        FaultSpec(rank=0, step=3, shadow_ready_steps_before=4)
