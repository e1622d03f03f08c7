"""A shadow's warm-ups of a ``torch.compile``'d model, in process: the forward replay runs
its compiled modules eager, the compiler warm-up compiles with the model's settings
(``leto.compiled``). A counting Dynamo backend (tests/dynamo_backend.py) stands for Inductor.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from leto import compiled
from leto.events import Kind, read_events
from leto.preinit.model_warmup import COMPILER, warm_compiler
from leto.preinit.replay import ForwardSpec, replay
from tests.dynamo_backend import CountingBackend
from tests.preinit.test_model_warmup import _report, _shadow


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.gelu(self.fc(self.norm(x)))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # Dynamo's caches live on code objects shared by every test
    yield
    torch._dynamo.reset()


def _materialise(model: torch.nn.Module) -> torch.nn.Module:
    """What binding does to the shadow's meta model: real storage, other values."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1.0, 1.0)
    return model


def _spec() -> ForwardSpec:
    return ForwardSpec.of((torch.zeros(3, 8),), {})


@pytest.mark.parametrize("how", ["module.compile", "torch.compile"])
def test_the_replay_leaves_no_graph_that_would_skip_the_trainers_hooks(how):
    """Dynamo does not guard on module hooks: a graph the replay compiled would be reused
    by the trainer's first call, without a hook registered after the replay."""
    backend = CountingBackend()
    with torch.device("meta"):
        model = _Net()
    if how == "module.compile":
        for block in model.blocks:
            block.compile(backend=backend)
    else:
        model = torch.compile(model, backend=backend)
    replay(model, _spec(), torch.device("cpu"))
    assert backend.graphs == 0, "the copy ran eager"
    net = _materialise(model)
    calls = []
    inner = net._orig_mod if how == "torch.compile" else net
    inner.blocks[0].fc.register_forward_pre_hook(lambda *_: calls.append(1))
    net(torch.randn(3, 8)).sum().backward()
    assert backend.graphs >= 1 and calls == [1], "the first call compiled, with the hook"


def test_compiled_modules_are_found_with_their_settings():
    backend = CountingBackend()
    net = _Net()
    assert compiled.compiled_modules(net) == []
    net.blocks[1].compile(backend=backend)
    ((name, settings),) = compiled.compiled_modules(net)
    assert name == "blocks.1" and settings is not None
    settings(lambda x: x * 2)(torch.ones(2))
    assert backend.graphs == 1, "the settings found compile with the module's backend"
    outer = torch.compile(net, backend=backend)
    assert [n for n, _ in compiled.compiled_modules(outer)] == ["", "_orig_mod.blocks.1"]


def test_a_compiled_call_whose_settings_cannot_be_read_is_found_without_them(tmp_path):
    net = _Net()
    net.blocks[0]._compiled_call_impl = lambda *a, **k: net.blocks[0]._call_impl(*a, **k)
    assert compiled.compiled_modules(net) == [("blocks.0", None)]
    site, hb_board = _shadow(tmp_path, 3)
    _report(hb_board, total=0, free=0, reserved=0, peak=0)
    result = warm_compiler(site, net)
    assert not result.ran and "unreadable" in result.reason


def test_compile_once_compiles_forward_and_backward_with_the_settings():
    backend = CountingBackend()
    compiled.compile_once(torch.compile(backend=backend), torch.device("cpu"))
    assert backend.graphs == 1


def test_a_shadow_of_a_compiled_model_warms_its_compiler(tmp_path):
    backend = CountingBackend()
    site, hb_board = _shadow(tmp_path, 3)
    _report(hb_board, total=0, free=0, reserved=0, peak=0)
    with torch.device("meta"):
        model = _Net()
    model.blocks[0].compile(backend=backend)
    result = warm_compiler(site, model)
    assert result is not None and result.ran and result.reason == "ok", result
    assert backend.graphs == 1, "the throwaway function went through the model's backend"
    (event,) = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == Kind.MODEL_WARMED]
    assert event["name"] == COMPILER and event["ran"]


def test_no_compiler_warm_up_without_compiled_modules_or_when_turned_off(tmp_path):
    site, hb_board = _shadow(tmp_path, 3)
    _report(hb_board, total=0, free=0, reserved=0, peak=0)
    with torch.device("meta"):
        model = _Net()
    assert warm_compiler(site, model) is None
    backend = CountingBackend()
    model.compile(backend=backend)
    off = dataclasses.replace(
        site,
        env=dataclasses.replace(
            site.env, preinit=dataclasses.replace(site.env.preinit, warm_kernels=False)
        ),
    )
    assert warm_compiler(off, model) is None
    assert warm_compiler(dataclasses.replace(site, is_shadow=False), model) is None
    assert backend.graphs == 0
