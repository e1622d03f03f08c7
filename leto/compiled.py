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

The model's own graphs are not compiled ahead: Dynamo keeps compiled code per code object
and, by default (``skip_nnmodule_hook_guards``), does not guard on module hooks, so a graph
compiled in the shadow before the trainer's hooks exist (Leto's heartbeat, any the script
registers after ``retain()``) would be reused without them. The forward replay runs
compiled modules eager for the same reason (``leto.preinit.replay``).
"""

from __future__ import annotations

from collections.abc import Callable
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
