"""``RetainedState.compute``: an OOM is retried after a reclaim, except under model parallelism.

The decision is local to ``compute`` (the rest of ``RetainedState`` is not involved), so the
state is a minimal stand-in holding what ``compute`` reads: the marker's step, the context
(rank, gradient seam, the trainer's real ``OomGuard`` on a real heartbeat board) and the
restart hook. The agent's side is a real ``PreinitController`` answering from a thread.

A model-parallel forward runs collectives (Megatron's tensor-parallel all-reduces): the other
ranks do not retry with the OOMing one, so a retry would pair its collectives with theirs
out of order. A narrowed ``Context.grad_sync`` group (what ``megatron_grad_sync`` sets under
TP/PP > 1) therefore turns the retry off: the OOM propagates, the shadows are left alone.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from leto.errors import LetoError
from leto.events import EventLog
from leto.health import Heartbeat, HeartbeatBoard
from leto.preinit import PreinitConfig, ShadowLevel
from leto.preinit.controller import PreinitController, ShadowState
from leto.preinit.guard import OomGuard
from leto.trainer.grad_sync import GradSync
from leto.trainer.state import RetainedState

STEP = 5


@pytest.fixture
def board():
    b = HeartbeatBoard(1)
    yield b
    b.close()


def _state(board: HeartbeatBoard, grad_sync: GradSync) -> SimpleNamespace:
    guard = OomGuard(
        Heartbeat(board.path, 0), None, PreinitConfig(reclaim_timeout_s=2), EventLog(None, "t0"), 0
    )
    state = SimpleNamespace(
        marker=SimpleNamespace(step=STEP),
        device=torch.device("cpu"),
        restarts=0,
        ctx=SimpleNamespace(rank=0, preinit=guard, grad_sync=grad_sync),
        _lend=False,
        _lender=None,
        _lent={},  # nothing lent on CPU (leto.pool.lend)
    )
    state._restart_compute = lambda: setattr(state, "restarts", state.restarts + 1)
    return state


class _OomOnce:
    """The compute phase: out of memory on its first call, then a loss."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            raise torch.OutOfMemoryError("an allocation does not fit beside this node's shadows")
        return torch.tensor(1.5)


def _answer_reclaims(ctrl: PreinitController, stop: threading.Event) -> None:
    """The agent: kill the shadows on a request and answer with the level reclaimed."""
    while not stop.is_set():
        if ctrl.requests():
            level = int(ctrl.level)
            ctrl.reclaimed()
            ctrl.answer([0], level)
        time.sleep(0.001)


def test_data_parallel_oom_reclaims_the_shadows_and_retries(board) -> None:
    ctrl = PreinitController(PreinitConfig(), 3, board)
    ctrl.spawned(ShadowLevel.L3)
    state, fn, stop = _state(board, GradSync()), _OomOnce(), threading.Event()
    agent = threading.Thread(target=_answer_reclaims, args=(ctrl, stop))
    agent.start()
    try:
        loss = RetainedState.compute(state, fn)  # type: ignore[arg-type]
    finally:
        stop.set()
        agent.join(5)
    assert float(loss) == 1.5 and fn.calls == 2 and state.restarts == 1
    assert ctrl.reclaims == 1 and ctrl.state is ShadowState.RECLAIMED


def test_model_parallel_oom_propagates_and_leaves_the_shadows(board) -> None:
    ctrl = PreinitController(PreinitConfig(), 3, board)
    ctrl.spawned(ShadowLevel.L3)
    tensor_parallel = GradSync(group=object())  # type: ignore[arg-type]  # a narrowed data-parallel group
    state, fn = _state(board, tensor_parallel), _OomOnce()
    assert (
        state.ctx.preinit.can_reclaim()
    )  # shadows hold memory: only model parallelism stops the retry
    with pytest.raises(torch.OutOfMemoryError, match="beside this node's shadows") as raised:
        RetainedState.compute(state, fn)  # type: ignore[arg-type]
    assert not ctrl.requests() and ctrl.reclaims == 0  # nothing was asked of the agent
    assert fn.calls == 1 and state.restarts == 0
    notes = getattr(raised.value, "__notes__", [])
    assert any("model-parallel forward runs collectives" in note for note in notes), notes
    assert ctrl.state is ShadowState.LIVE and state.ctx.preinit.shadow_level() == 3


@pytest.mark.parametrize("asked", [None, True])
def test_a_lender_that_cannot_be_built_is_skipped_unless_asked_for(
    board, monkeypatch, asked
) -> None:
    """``leto.lend_activation_memory``: left to its default (None), a lender that cannot be
    built (no C compiler, no ``torch.cuda.MemPool``) is skipped with a warning and the step
    runs; asked for (True), the step fails. The CUDA lending itself: tests/gpu/test_lend_gpu.py."""
    import leto.trainer.state as state_module

    def refuse(*_):
        raise LetoError("no C compiler")

    monkeypatch.setattr(state_module, "ActivationLender", refuse)
    state = _state(board, GradSync())
    state._lend = True
    state.ctx.env = SimpleNamespace(lend_activations=asked)
    if asked:
        with pytest.raises(LetoError, match="no C compiler"):
            RetainedState.compute(state, lambda: 1)  # type: ignore[arg-type]
    else:
        assert RetainedState.compute(state, lambda: 1) == 1  # type: ignore[arg-type]
        assert state._lend is False and state._lender is None
