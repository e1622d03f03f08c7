"""The import graph of ``leto/``, ``leto_run/`` and ``triton_kernels/`` has no circles
(imports inside functions and under ``TYPE_CHECKING`` count), and the packages of
``docs/ARCHITECTURE.md``'s Layers section import downwards only: the order is read from
that section, so the picture and the code cannot drift apart."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("leto", "leto_run", "triton_kernels")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for f in (REPO / pkg).rglob("*.py"):
            parts = list(f.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = f
    return mods


def _graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a ``from pkg import name`` names the
    submodule when there is one, else the package)."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package[: len(package) - node.level + 1]
                    base = ".".join([*parent, *([base] if base else [])])
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            for name in names:
                target = resolve(name)
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root, targets in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(targets)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _layers() -> list[str]:
    """The Layers section's packages, top first, as module prefixes."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("## Layers", 1)[1].split("```", 2)[1]
    paths = re.findall(r"^(\S+)\s", block, flags=re.MULTILINE)
    return [p.removesuffix("/").removesuffix(".py").replace("/", ".") for p in paths]


def _layer(mod: str, layers: list[str]) -> int | None:
    for i, prefix in enumerate(layers):
        if mod == prefix or mod.startswith(prefix + "."):
            return i
    return None


def test_the_import_graph_has_no_circles() -> None:
    assert _circles(_graph()) == []


def test_the_architecture_layers_import_downwards_only() -> None:
    layers = _layers()
    assert "leto.trainer" in layers and "leto.retained" in layers, layers
    upward = []
    for mod, targets in _graph().items():
        mine = _layer(mod, layers)
        for target in targets:
            theirs = _layer(target, layers)
            if mine is not None and theirs is not None and theirs < mine:
                upward.append((mod, target))
    assert sorted(upward) == []


def test_the_checks_see_a_circle_and_an_upward_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    layers = ["leto.trainer", "leto.retained"]
    assert _layer("leto.retained.marker", layers) == 1
    assert _layer("leto.trainer.state", layers) == 0
