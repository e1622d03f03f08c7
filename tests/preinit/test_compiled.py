"""A shadow's warm-ups of a ``torch.compile``'d model, in process: the forward replay
compiles the model's graphs for the promoted trainer, which drops them where its hooks
changed since; the compiler warm-up compiles with the model's settings (``leto.compiled``). A counting Dynamo backend (tests/dynamo_backend.py) stands for Inductor.
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


def _compiled_meta_net(how: str, backend: CountingBackend) -> torch.nn.Module:
    with torch.device("meta"):
        model = _Net()
    if how == "module.compile":
        for block in model.blocks:
            block.compile(backend=backend)
        return model
    return torch.compile(model, backend=backend)


def _inner(net: torch.nn.Module) -> torch.nn.Module:
    return getattr(net, "_orig_mod", net)


@pytest.mark.parametrize("how", ["module.compile", "torch.compile"])
def test_the_replay_compiles_the_models_graphs_for_the_trainers_first_call(how):
    backend = CountingBackend()
    model = _compiled_meta_net(how, backend)
    result = replay(model, _spec(), torch.device("cpu"))
    assert result.traced is not None and result.eager is None
    traced = backend.graphs
    assert traced >= 1, "the copy ran compiled"
    net = _materialise(model)
    outside = net.head if how == "module.compile" else net  # where Leto's hooks go
    outside.register_forward_hook(lambda *_: None)
    assert result.traced.keep_or_drop(net)
    net(torch.randn(3, 8)).sum().backward()
    assert backend.graphs == traced, "the trainer's first call reused the replay's graphs"


@pytest.mark.parametrize("how", ["module.compile", "torch.compile"])
@pytest.mark.parametrize("where", ["leaf", "block", "global", "removed"])
def test_a_hook_changed_after_the_replay_drops_its_graphs(how, where):
    """Dynamo does not guard on module hooks: reused, a graph the replay traced would skip
    a hook registered after it, or run one removed since."""
    backend = CountingBackend()
    model = _compiled_meta_net(how, backend)
    calls: list[int] = []
    early = _inner(model).blocks[0].fc.register_forward_pre_hook(lambda *_: calls.append(0))
    result = replay(model, _spec(), torch.device("cpu"))
    assert result.traced is not None
    calls.clear()
    traced = backend.graphs
    net = _materialise(model)
    block = _inner(net).blocks[0]
    handle = None
    if where == "leaf":
        block.fc.register_forward_pre_hook(lambda *_: calls.append(1))
    elif where == "block" and how == "module.compile":
        block.register_forward_hook(lambda *_: calls.append(1))  # inside its compiled call
    elif where == "block":
        block.norm.register_forward_hook(lambda *_: calls.append(1))
    elif where == "global":
        handle = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, _: calls.append(1) if m is block.fc else None
        )
    else:
        early.remove()
    try:
        assert not result.traced.keep_or_drop(net)
        net(torch.randn(3, 8)).sum().backward()
    finally:
        if handle is not None:
            handle.remove()
    assert backend.graphs > traced, "compiled afresh"
    expected = [] if where == "removed" else [0, 1]
    assert sorted(calls) == expected, "the model's hooks ran, as they are now"


def test_settings_that_capture_cuda_graphs_replay_eager():
    with torch.device("meta"):
        model = _Net()
    model.blocks[0].compile(mode="reduce-overhead")
    result = replay(model, _spec(), torch.device("cpu"))
    assert result.traced is None and "CUDA graphs" in (result.eager or "")


class _Raises(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("after the compiled blocks")


def test_a_replay_that_raises_leaves_no_graph():
    backend = CountingBackend()
    model = _compiled_meta_net("module.compile", backend)
    with torch.device("meta"):
        model.head = torch.nn.Sequential(torch.nn.Linear(8, 4), _Raises())
    with pytest.raises(RuntimeError, match="after the compiled blocks"):
        replay(model, _spec(), torch.device("cpu"))
    assert backend.graphs >= 1
    traced = backend.graphs
    net = _materialise(model)
    calls: list[int] = []
    net.blocks[0].fc.register_forward_pre_hook(lambda *_: calls.append(1))
    net.head = torch.nn.Linear(8, 4)
    net(torch.randn(3, 8)).sum().backward()
    assert backend.graphs > traced and calls == [1], "nothing of the failed replay was reused"


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
