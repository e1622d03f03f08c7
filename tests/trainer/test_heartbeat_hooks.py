"""Heartbeats inside a step come from a few hooks spread over the model, not one per module
and gradient (each is host time a host-bound step pays): a deep model's forward and backward
beat ``BEATS_PER_PASS`` times each, and still beat through both passes (a real trainer
``Context`` on a real heartbeat board, tests/trainer/local.py)."""

from __future__ import annotations

import pytest
import torch

from leto.health import HeartbeatBoard
from leto.trainer.context import BEATS_PER_PASS, spread
from tests.dynamo_backend import CountingBackend
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


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = torch.nn.Linear(4, 4), torch.nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.fc(x))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _compiled_steps(
    monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module, backend: CountingBackend
) -> tuple[list[int], list[int]]:
    """Train ``model`` 5 steps under Leto, heartbeat on: each step's forward beats, and the
    graphs compiled by the end of each step."""
    board = HeartbeatBoard(1)
    try:
        with local_context(monkeypatch, heartbeat_file=board.path) as ctx:
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            state = ctx.retain(model, opt)
            beats, graphs = [], []
            for step in state.steps(5):
                before = board.read(0)[0]
                out = model(torch.full((2, 4), float(step))).sum()
                beats.append(board.read(0)[0] - before)
                out.backward()
                state.step(loss=out)
                graphs.append(backend.graphs)
            return beats, graphs
    finally:
        board.close()


@pytest.fixture
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.usefixtures("_fresh_dynamo")
def test_compiled_blocks_get_no_beats_and_compile_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A beat traced into a compiled block is guarded on its count: the block recompiled at
    every step (and ran eager once past Dynamo's recompile limit). The beats go on the
    leaves outside the compiled blocks."""
    backend = CountingBackend()
    model = _Net()
    for block in model.blocks:
        block.compile(backend=backend)
    beats, graphs = _compiled_steps(monkeypatch, model, backend)
    assert graphs[0] >= 1 and graphs == graphs[:1] * 5, "compiled at the first step only"
    assert beats == [2] * 5, "the two uncompiled linears beat"
    hooked = [m for m in model.modules() if m._forward_pre_hooks]
    assert hooked == [model.inp, model.out]


@pytest.mark.usefixtures("_fresh_dynamo")
def test_a_beat_inside_a_compiled_forward_breaks_the_graph_instead_of_recompiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A compiled ``forward`` attribute is not a compiled module: its leaves get beats,
    which run (Dynamo breaks the graph around them) without a recompile per step."""
    backend = CountingBackend()
    model = _Net()
    model.forward = torch.compile(model.forward, backend=backend)
    beats, graphs = _compiled_steps(monkeypatch, model, backend)
    assert beats == [BEATS_PER_PASS] * 5
    assert graphs[0] >= 1 and graphs == graphs[:1] * 5, "compiled at the first step only"


@pytest.mark.usefixtures("_fresh_dynamo")
def test_a_model_compiled_whole_beats_at_its_edge(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile(model)``: every leaf is compiled; the beat goes on the compiled
    wrapper, outside the graph (the fault injector's kill points likewise)."""
    backend = CountingBackend()
    model = torch.compile(_Net(), backend=backend)
    beats, graphs = _compiled_steps(monkeypatch, model, backend)
    assert beats == [1] * 5
    assert graphs[0] >= 1 and graphs == graphs[:1] * 5
    assert [m for m in model.modules() if m._forward_pre_hooks] == [model]
