"""The agent's failure classification (``FailurePolicy._classify``) with its collaborators
stubbed: the state manager, the epoch board, the GPU health probe, the event log."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from leto.events import Kind
from leto.health import FailureClass
from leto_run.failures import FailurePolicy


def _agent(problems: list[str], fatal: bool = False) -> SimpleNamespace:
    emitted: list[tuple[Kind, dict]] = []
    return SimpleNamespace(
        _sm=SimpleNamespace(alive=lambda: True),
        _epochs=SimpleNamespace(check=lambda keys: fatal),
        _device_health=SimpleNamespace(check=lambda: problems),
        _events=SimpleNamespace(emit=lambda kind, **fields: emitted.append((kind, fields))),
        _detected_t=None,
        emitted=emitted,
    )


def _killed() -> RunResult:
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-int(signal.SIGKILL), error_file="")
    return RunResult(state=WorkerState.FAILED, failures={0: failure})


def test_a_kill_on_a_healthy_device_is_a_hof() -> None:
    agent = _agent([])
    assert FailurePolicy._classify(agent, _killed()) is FailureClass.HOF
    assert agent.emitted == []


def test_a_kill_on_an_unhealthy_gpu_is_an_ff_and_says_why() -> None:
    agent = _agent(["GPU 0: 2 new uncorrected ECC errors"])
    assert FailurePolicy._classify(agent, _killed()) is FailureClass.FF
    assert agent.emitted == [
        (Kind.DEVICE_UNHEALTHY, {"problems": ["GPU 0: 2 new uncorrected ECC errors"]})
    ]


def test_a_reported_fatal_failure_is_an_ff_before_any_probe() -> None:
    agent = _agent(["never read"], fatal=True)
    assert FailurePolicy._classify(agent, _killed()) is FailureClass.FF
    assert agent.emitted == []
