"""``RetainedState.compute`` (``leto.trainer.compute.ComputePhase``): an OOM is retried after
a reclaim, except under model parallelism; a lender that cannot be built is skipped.

The state is a real ``RetainedState`` of a small model (``ctx.retain`` on an in-process
``Context`` whose ``OomGuard`` is on a real heartbeat board, tests/trainer/local.py); the
agent's side is a real ``PreinitController`` answering from a thread. The lender test builds
a ``ComputePhase`` from a real ``OomGuard`` and ``GradSync``.

A model-parallel forward runs collectives (Megatron's tensor-parallel all-reduces): the other
ranks do not retry with the OOMing one, so a retry would pair its collectives with theirs
out of order. A narrowed ``Context.grad_sync`` group (what ``megatron_grad_sync`` sets under
TP/PP > 1) therefore turns the retry off: the OOM propagates, the shadows are left alone.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from leto.errors import LetoError
from leto.events import EventLog
from leto.health import Heartbeat, HeartbeatBoard
from leto.preinit import PreinitConfig, ShadowLevel
from leto.preinit.controller import PreinitController, ShadowState
from leto.preinit.guard import OomGuard
from leto.trainer.compute import ComputePhase
from leto.trainer.grad_sync import GradSync
from leto.trainer.state import RetainedState
from tests.trainer.local import local_context


@pytest.fixture
def board():
    b = HeartbeatBoard(1)
    yield b
    b.close()


@pytest.fixture
def ctx(board, monkeypatch):
    with local_context(
        monkeypatch, heartbeat_file=board.path, preinit=PreinitConfig(reclaim_timeout_s=2)
    ) as ctx:
        yield ctx


def _retained(ctx, grad_sync: GradSync) -> RetainedState:
    """A small model retained under ``grad_sync`` (what an integration sets before retain)."""
    ctx.grad_sync = grad_sync
    model = torch.nn.Linear(4, 2)
    return ctx.retain(model, torch.optim.SGD(model.parameters(), lr=0.1))


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


def test_data_parallel_oom_reclaims_the_shadows_and_retries(board, ctx) -> None:
    ctrl = PreinitController(PreinitConfig(), 3, board)
    ctrl.spawned(ShadowLevel.L3, generation=1)
    state, fn, stop = _retained(ctx, GradSync()), _OomOnce(), threading.Event()
    for region in state.grad_regions.values():
        region.fill_(1)  # what the failed attempt's backward wrote: the retry discards it
    agent = threading.Thread(target=_answer_reclaims, args=(ctrl, stop))
    agent.start()
    try:
        loss = state.compute(fn)
    finally:
        stop.set()
        agent.join(5)
    assert float(loss) == 1.5 and fn.calls == 2
    # No gradient landed in the retry (leto.trainer.grad_landing): the step's gradients are
    # the retry's alone, and one that never lands is committed as zero.
    assert all(p.grad is None for p in state.params)
    state.step(loss=loss)
    assert all(bool((g == 0).all()) for g in state.grad_views())
    assert ctrl.reclaims == 1 and ctrl.state is ShadowState.RECLAIMED


def test_model_parallel_oom_propagates_and_leaves_the_shadows(board, ctx) -> None:
    ctrl = PreinitController(PreinitConfig(), 3, board)
    ctrl.spawned(ShadowLevel.L3, generation=1)
    tensor_parallel = GradSync(group=object())  # type: ignore[arg-type]  # a narrowed data-parallel group
    state, fn = _retained(ctx, tensor_parallel), _OomOnce()
    assert ctx.preinit.can_reclaim()  # shadows hold memory: only model parallelism stops the retry
    with pytest.raises(torch.OutOfMemoryError, match="beside this node's shadows") as raised:
        state.compute(fn)
    assert not ctrl.requests() and ctrl.reclaims == 0  # nothing was asked of the agent
    assert fn.calls == 1
    notes = getattr(raised.value, "__notes__", [])
    assert any("model-parallel forward runs collectives" in note for note in notes), notes
    assert ctrl.state is ShadowState.LIVE and ctx.preinit.shadow_level() == 3


@pytest.mark.parametrize("asked", [None, True])
def test_a_lender_that_cannot_be_built_is_skipped_unless_asked_for(
    board, monkeypatch, asked
) -> None:
    """``leto.lend_activation_memory``: left to its default (None), a lender that cannot be
    built (no C compiler, no ``torch.cuda.MemPool``) is skipped with a warning and the step
    runs; asked for (True), the step fails. The phase is given a region to lend although it
    runs on the CPU (where ``lends`` says no): the lender's construction is what fails here.
    The CUDA lending itself: tests/gpu/test_lend_gpu.py."""
    import leto.trainer.compute as compute_module

    def refuse(*_):
        raise LetoError("no C compiler")

    monkeypatch.setattr(compute_module, "ActivationLender", refuse)
    guard = OomGuard(
        Heartbeat(board.path, 0), None, PreinitConfig(reclaim_timeout_s=2), EventLog(None, "t0"), 0
    )
    phase = ComputePhase(
        rank=0,
        device=torch.device("cpu"),
        guard=guard,
        grad_sync=lambda: GradSync(),
        restart=lambda: None,
        lent={"rmu.undo": torch.zeros(64, dtype=torch.uint8)},
        lend_asked=asked,
    )
    if asked:
        with pytest.raises(LetoError, match="no C compiler"):
            phase.run(5, lambda: 1)
    else:
        assert phase.run(5, lambda: 1) == 1
        assert not phase.lending and phase.lender is None
