"""``torch.compile`` and Leto: which modules are compiled, where Leto's hooks go, a warm compiler.

Leto's module hooks (the heartbeat's progress beats, the fault injector's kill points) go
on leaves outside compiled modules, or at the edge of a model compiled whole
(:func:`hook_sites`), each made opaque to Dynamo
(:func:`opaque_hook`): traced inside a compiled module, a hook that counts would be
guarded on its count, and Dynamo would recompile the module at every step until its
recompile limit, then run it eager for good.

A promoted trainer of a model with compiled modules compiles them afresh at its first
step: Dynamo traces each one, AOTAutograd and Inductor find their code in the on-disk
caches, and the process pays the compiler's first use (Inductor's imports, the cache keys
of torch and Triton, loading compiled code), most of that step's excess. A level-3 shadow
pays the first use before any failure (``model_warmup.warm_compiler``): it compiles and
backpropagates a throwaway function with the model's own compile settings
(:func:`compile_once`), so the same backend and options are the ones warmed.

The forward replay (``leto.preinit.replay``) goes further: it compiles a scratch copy of
the model with the model's own settings (:func:`compile_like`), so Dynamo's caches, kept
per code object and shared by every instance of a module class, hold the model's graphs,
forward and backward, before any failure. Dynamo does not guard on module hooks
(``skip_nnmodule_hook_guards``): a graph traced without a hook is reused without it. So the
replay records the hooks its graphs could have inlined (:class:`TracedHooks`: those of the
modules inside compiled regions, and the global ones), and the promoted trainer compares
them at its first step: where one was added or removed since (the script's, after
``retain()``; Leto's own, on a model compiled whole by ``m.compile()``), Dynamo's caches
are dropped and the model compiles afresh, with its hooks, as it did without the replay.
Settings that capture CUDA graphs are not replayed compiled: their recordings would hold
the scratch's addresses and memory pool.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Compile = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Dynamo's context of one ``torch.compile`` call: applied to a function, compiles it alike."""


def _called_compile(module: torch.nn.Module) -> Compile | None:
    """The Dynamo context ``module.compile()`` applied, or None (a torch whose compiled
    callable no longer holds it where this looks)."""
    fn = module.__dict__.get("_compiled_call_impl")
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or cells is None:
        return None
    from torch._dynamo.eval_frame import _TorchDynamoContext

    for name, cell in zip(code.co_freevars, cells, strict=True):
        if name == "self" and isinstance(cell.cell_contents, _TorchDynamoContext):
            return cell.cell_contents
    return None


def _is_compiled(module: torch.nn.Module) -> bool:
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule) or (
        module.__dict__.get("_compiled_call_impl") is not None
    )


def _settings(module: torch.nn.Module) -> Compile | None:
    """The compile settings of a compiled ``module`` (None where they cannot be read)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return module.dynamo_ctx if isinstance(module, OptimizedModule) else _called_compile(module)


def compiled_modules(model: torch.nn.Module) -> list[tuple[str, Compile | None]]:
    """Each compiled module of ``model`` (``torch.compile(m)`` or ``m.compile()``) by name,
    with its compile settings (None where they cannot be read)."""
    return [(n, _settings(m)) for n, m in model.named_modules() if _is_compiled(m)]


def hook_sites(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules Leto hooks, in order: the leaves no compiled module contains; where every
    leaf is inside one (a model compiled whole), the outermost compiled modules, whose hooks
    run at the compiled region's edge (outside it for ``torch.compile(m)``; a graph break at
    its start or end for ``m.compile()``)."""
    inside: set[int] = set()
    outermost: list[torch.nn.Module] = []
    for module in model.modules():
        if id(module) not in inside and _is_compiled(module):
            outermost.append(module)
            inside.update(id(m) for m in module.modules())
    leaves = [m for m in model.modules() if not list(m.children()) and id(m) not in inside]
    return leaves or outermost


def opaque_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a hook Dynamo does not trace (``torch.compiler.disable``): where it runs
    inside a compiled region after all (a compiled ``forward`` :func:`hook_sites` cannot
    see), the graph breaks around it instead of recompiling at every call."""
    return torch.compiler.disable(fn, recursive=True)


def _throwaway(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (torch.nn.functional.silu(x * w) + x.cos()).sum()


def compile_once(settings: Compile, device: torch.device) -> None:
    """Compile and run a throwaway function, forward and backward, with ``settings``."""
    x = torch.randn(64, 64, device=device)
    w = torch.randn(64, 64, device=device, requires_grad=True)
    settings(_throwaway)(x, w).backward()


def graphs_compiled() -> int:
    """Graphs Dynamo has compiled in this process (0 where Dynamo is not loaded)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


def uses_cudagraphs(settings: Compile) -> bool:
    """Whether ``settings`` capture CUDA graphs (``mode="reduce-overhead"``, the
    ``cudagraphs`` backend, Inductor's global switch), as far as they can be read."""
    import torch._inductor.config as inductor_config

    if inductor_config.triton.cudagraphs:
        return True
    backend: Any = getattr(settings, "callback", None)
    for _ in range(8):  # Dynamo's wrappers, each holding the one it wraps
        if backend is None:
            break
        config = getattr(backend, "config", None)
        if isinstance(config, dict) and config.get("triton.cudagraphs"):
            return True
        if "cudagraph" in getattr(backend, "__name__", ""):
            return True
        backend = getattr(backend, "_torchdynamo_orig_backend", None)
    return False


def compile_like(model: torch.nn.Module, copy: torch.nn.Module) -> int:
    """Compile ``copy`` (a ``copy.deepcopy`` of ``model``) where ``model`` is compiled, with
    the same settings; returns how many modules are compiled. ``torch.compile(m)`` survives
    the deep copy; ``m.compile()`` does not, and is applied again. Raises ``ValueError``
    where settings cannot be read or capture CUDA graphs."""
    found = compiled_modules(model)
    for name, settings in found:
        if settings is None:
            raise ValueError(f"the compile settings of {name or 'the model'} are unreadable")
        if uses_cudagraphs(settings):
            raise ValueError(f"{name or 'the model'} is compiled to capture CUDA graphs")
        target = copy.get_submodule(name)
        if not _is_compiled(target):
            target._compiled_call_impl = settings(target._call_impl)  # what m.compile() sets
    return len(found)


MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
"""A module's hook dicts that run around its call (forward, and backward through autograd)."""
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def _compiled_regions(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules whose calls run inside compiled code, by name: a module compiled by
    ``m.compile()`` and all below it (its own hooks run in its compiled call); for
    ``torch.compile(m)``, ``m`` and all below it, not the wrapper (whose hooks run outside)."""
    from torch._dynamo.eval_frame import OptimizedModule

    regions: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if not _is_compiled(module):
            continue
        root, prefix = module, name
        if isinstance(module, OptimizedModule):
            root, prefix = module._orig_mod, f"{name}._orig_mod" if name else "_orig_mod"
        for sub, m in root.named_modules(prefix=prefix, remove_duplicate=False):
            regions[sub] = m
    return regions


def _hook_ids(hooks: dict[int, Any]) -> tuple[tuple[int, int], ...]:
    return tuple((key, id(fn)) for key, fn in hooks.items())


@dataclass(frozen=True, slots=True)
class TracedHooks:
    """The module hooks a model's compiled graphs may have inlined when they were traced:
    each hook, by handle and identity, of every module inside a compiled region, and the
    global module hooks. Equal at a later call: the graphs run the hooks the module has."""

    key: tuple[Any, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> TracedHooks:
        import torch.nn.modules.module as nn_module

        local = tuple(
            (name, attr, _hook_ids(getattr(m, attr)))
            for name, m in _compiled_regions(model).items()
            for attr in MODULE_HOOKS
        )
        return cls(
            key=(local, tuple(_hook_ids(getattr(nn_module, attr)) for attr in _GLOBAL_HOOKS))
        )

    def keep_or_drop(self, model: torch.nn.Module) -> bool:
        """Keep the graphs traced under these hooks if ``model`` has the same now; else drop
        Dynamo's caches (``torch._dynamo.reset()``), so the model compiles afresh with its
        hooks. Returns whether the graphs were kept."""
        if TracedHooks.of(model) == self:
            return True
        torch._dynamo.reset()
        return False
