"""A stateful object's record is overwritten only once the marker has passed what a resume
from it needs. On a GPU the marker moves when the device gets there and the host may be
steps ahead: a kill then leaves a marker behind the host, and its resume must still find
that step's record (``leto.trainer.extras`` keeps ``SLOTS // 2`` of each kind). A real
trainer ``Context`` in this process (tests/trainer/local.py) records every wait and every
write in order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leto.retained.marker import Phase
from leto.trainer.extras import SLOTS, Capture
from tests.trainer.local import local_context

STEPS = SLOTS // 2 + 3


def test_each_record_waits_for_the_marker_to_pass_the_one_it_replaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[tuple[str, object, int]] = []
    with local_context(monkeypatch) as ctx:
        torch.manual_seed(0)
        net = nn.Linear(4, 4)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
        state = ctx.retain(net, opt, stateful={"sched": sched})
        wait, write = state.marker.wait_landed, state.extras.store.write

        def waited(phase: Phase, step: int) -> None:
            log.append(("wait", phase, step))
            wait(phase, step)

        def wrote(step: int, kind: Capture, payload: bytes) -> None:
            write(step, kind, payload)
            log.append(("write", kind, step))  # after the write's own waits

        monkeypatch.setattr(state.marker, "wait_landed", waited)
        monkeypatch.setattr(state.extras.store, "write", wrote)
        for step in state.steps(STEPS):
            state.compute(lambda: net(torch.ones(2, 4)).sum().backward())
            state.step()
            sched.step()
    writes = [(i, kind, step) for i, (what, kind, step) in enumerate(log) if what == "write"]
    assert [(kind, step) for _, kind, step in writes] == [
        (kind, s) for s in range(STEPS) for kind in (Capture.BEGIN, Capture.PRE)
    ]
    kept = SLOTS // 2
    for i, kind, step in writes:
        if step < kept:  # a free slot
            assert i == 0 or log[i - 1][0] != "wait", log[: i + 1]
            continue
        # BEGIN(t) replaces BEGIN(t-k), which a re-run of t-k needs until its gradients are
        # final; PRE(t) replaces PRE(t-k), which finishing t-k's update needs until it commits.
        u = step - kept
        needed = (Phase.GRADS_READY, u) if kind == Capture.BEGIN else (Phase.IDLE, u + 1)
        assert log[i - 1] == ("wait", *needed), f"{kind.name}({step}) written without {needed}"
