"""Heartbeats inside a step come from a few hooks spread over the model, not one per module
and gradient (each is host time a host-bound step pays): a deep model's forward and backward
beat ``BEATS_PER_PASS`` times each, and still beat through both passes (a real trainer
``Context`` on a real heartbeat board, tests/trainer/local.py)."""

from __future__ import annotations

import pytest
import torch

from leto.health import HeartbeatBoard
from leto.trainer.context import BEATS_PER_PASS, spread
from tests.trainer.local import local_context


def test_spread_takes_evenly_spaced_items() -> None:
    assert spread(list(range(100)), 8) == [0, 12, 25, 37, 50, 62, 75, 87]
    assert spread([1, 2, 3], 8) == [1, 2, 3]


def test_a_deep_model_beats_a_few_times_per_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    board = HeartbeatBoard(1)
    try:
        with local_context(monkeypatch, heartbeat_file=board.path) as ctx:
            model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(40)))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            state = ctx.retain(model, opt)
            x = torch.ones(2, 4)
            for _ in state.steps(2):
                before = board.read(0)[0]
                out = model(x).sum()
                forward = board.read(0)[0] - before
                out.backward()
                backward = board.read(0)[0] - before - forward
                assert (forward, backward) == (BEATS_PER_PASS, BEATS_PER_PASS)
                state.step(loss=out)
    finally:
        board.close()
