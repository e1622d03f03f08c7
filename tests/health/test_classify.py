"""The agent's failure classification (``leto_run.failures.classify``) with its collaborators
stubbed: the state manager, the epoch board, the GPU health probe, the event log."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from leto.events import Kind
from leto.health import FailureClass
from leto_run.failures import classify


class _Events:
    def __init__(self) -> None:
        self.emitted: list[tuple[Kind, dict]] = []

    def emit(self, kind: Kind, **fields: object) -> None:
        self.emitted.append((kind, fields))


def _classify(problems: list[str], events: _Events, fatal: bool = False) -> FailureClass:
    return classify(
        _killed(),
        state_manager=SimpleNamespace(alive=lambda: True),  # type: ignore[arg-type]
        epochs=SimpleNamespace(check=lambda keys: fatal),  # type: ignore[arg-type]
        device_health=SimpleNamespace(check=lambda: problems),  # type: ignore[arg-type]
        events=events,  # type: ignore[arg-type]
        killed_seen=False,
    )


def _killed() -> RunResult:
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-int(signal.SIGKILL), error_file="")
    return RunResult(state=WorkerState.FAILED, failures={0: failure})


def test_a_kill_on_a_healthy_device_is_a_hof() -> None:
    events = _Events()
    assert _classify([], events) is FailureClass.HOF
    assert events.emitted == []


def test_a_kill_on_an_unhealthy_gpu_is_an_ff_and_says_why() -> None:
    events = _Events()
    assert _classify(["GPU 0: 2 new uncorrected ECC errors"], events) is FailureClass.FF
    assert events.emitted == [
        (Kind.DEVICE_UNHEALTHY, {"problems": ["GPU 0: 2 new uncorrected ECC errors"]})
    ]


def test_a_reported_fatal_failure_is_an_ff_before_any_probe() -> None:
    events = _Events()
    assert _classify(["never read"], events, fatal=True) is FailureClass.FF
    assert events.emitted == []
