"""A step's loss for ``step_done`` (``leto.trainer.loss``): on CPU its own, at once; deferred
(CUDA's mode, forced here on CPU tensors) one step late as ``prev_loss``, the last step its
own. Either way ``leto.summary.losses`` finds every step's loss exactly once."""

from __future__ import annotations

import torch

from leto import summary
from leto.trainer.loss import LossReport

CPU = torch.device("cpu")


def _run(report: LossReport, values: list[float | None]) -> list[dict]:
    events = []
    for step, v in enumerate(values):
        report.stage(None if v is None else torch.tensor(v, requires_grad=True) * 1.0)
        fields = report.fields(last=step == len(values) - 1)
        events.append({"kind": "step_done", "rank": 0, "step": step, **fields})
    return events


def test_on_cpu_a_step_reports_its_own_loss() -> None:
    events = _run(LossReport(CPU), [3.0, 2.5, 2.0])
    assert [e["loss"] for e in events] == [3.0, 2.5, 2.0]
    assert all("prev_loss" not in e for e in events)


def test_deferred_a_step_reports_the_previous_loss_and_the_last_its_own() -> None:
    events = _run(LossReport(CPU, defer=True), [3.0, 2.5, 2.0, 1.5])
    assert [e["loss"] for e in events] == [None, None, None, 1.5]
    assert [e.get("prev_loss") for e in events] == [None, 3.0, 2.5, 2.0]
    assert summary.losses(events) == {0: 3.0, 1: 2.5, 2: 2.0, 3: 1.5}


def test_deferred_the_staged_value_is_the_step_s_not_a_later_write() -> None:
    """The staged loss is a copy: the script's tensor changing afterwards changes nothing."""
    report = LossReport(CPU, defer=True)
    loss = torch.tensor(4.0)
    report.stage(loss)
    report.fields(last=False)
    loss.fill_(9.0)
    report.stage(torch.tensor(1.0))
    assert report.fields(last=True) == {"loss": 1.0, "prev_loss": 4.0}


def test_deferred_a_step_without_a_loss_leaves_no_gap_reported_as_a_value() -> None:
    events = _run(LossReport(CPU, defer=True), [3.0, None, 2.0, 1.0])
    assert summary.losses(events) == {0: 3.0, 2: 2.0, 3: 1.0}


def test_latest_loss_prefers_the_step_s_own() -> None:
    assert summary.latest_loss({"loss": 1.0, "prev_loss": 2.0}) == 1.0
    assert summary.latest_loss({"loss": None, "prev_loss": 2.0}) == 2.0
    assert summary.latest_loss({"loss": None}) is None


def test_a_number_passed_as_the_loss_is_reported() -> None:
    for report in (LossReport(CPU), LossReport(CPU, defer=True)):
        report.stage(2.5)
        assert report.fields(last=True)["loss"] == 2.5
