"""Data loaders a recovery would restart: live ``DataLoader`` iterators Leto does not retain.

A promoted trainer runs the script from its start. A ``DataLoader`` iterator it builds
begins at the loader's first batch, so unless the position is retained (a torchdata
``StatefulDataLoader``, a sampler or dataset with a ``state_dict()``, named in
``ctx.retain(..., stateful=...)``, or the data drawn by step) the recovered trainer trains
on other batches than the failed one would have, and nothing else tells the user. Refusing
the recovery would not help (a restart from a checkpoint restarts such a loader too): the
trainer names the loader in a warning, before any failure and again after a recovery.

An iterator is retained where a named object holds it within ``DEPTH`` attribute steps (a
named ``StatefulDataLoader`` holds its ``_iterator``; a named wrapper holds the loader), or
holds its sampler or dataset and that has a ``state_dict()`` (a resumable sampler). The
scan reads the collector's heap (``gc.get_objects``), whose objects built before a shadow's
``gc.freeze`` it does not see: a promoted trainer scans only what its script built after
``retain()`` returned.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator

from torch.utils.data.dataloader import _BaseDataLoaderIter

DEPTH = 3
"""Attribute steps from a named object that still count as holding what they reach."""

_CONTAINERS = (list, tuple, set, frozenset)
LARGEST_CONTAINER = 256
"""A larger list or dict (a dataset's samples) is not walked: a loader is not in one."""


def _children(obj: object) -> Iterator[object]:
    if isinstance(obj, (dict, *_CONTAINERS)) and len(obj) > LARGEST_CONTAINER:
        return
    if isinstance(obj, dict):
        yield from obj.values()
    elif isinstance(obj, _CONTAINERS):
        yield from obj
    else:
        yield from getattr(obj, "__dict__", {}).values()


def _held(named: Iterable[object]) -> set[int]:
    """Ids of the objects reachable from ``named`` within ``DEPTH`` steps."""
    seen: set[int] = set()
    level = [o for o in named if o is not None]
    for _ in range(DEPTH + 1):
        following = []
        for obj in level:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            following += [c for c in _children(obj) if c is not None]
        level = following
    return seen


def _iterator_types() -> frozenset[type]:
    seen: set[type] = set()
    todo: list[type] = [_BaseDataLoaderIter]
    while todo:
        t = todo.pop()
        if t not in seen:
            seen.add(t)
            todo += t.__subclasses__()
    return frozenset(seen)


def _live_iterators() -> list[_BaseDataLoaderIter]:
    # type(), not isinstance(): a module's deprecated alias warns when its __class__ is read.
    # The types first (a loop in C): most heaps hold no iterator, and a large one takes tens
    # of milliseconds to walk in Python.
    objects, kinds = gc.get_objects(), _iterator_types()
    if kinds.isdisjoint(map(type, objects)):
        return []
    return [o for o in objects if type(o) in kinds]


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` follows torch's ``Stateful`` protocol (what ``stateful=`` retains)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def unretained_loader_iterators(named: Iterable[object]) -> list[_BaseDataLoaderIter]:
    """Live ``DataLoader`` iterators that ``named`` does not retain (module docstring)."""
    live = _live_iterators()
    if live:  # one left in a reference cycle is not live: collect before naming it
        del live
        gc.collect()
        live = _live_iterators()
    if not live:
        return []
    held = _held(named)

    def retained(it: _BaseDataLoaderIter) -> bool:
        if id(it) in held:
            return True
        index = getattr(it, "_index_sampler", None)
        parts = (index, getattr(index, "sampler", None), getattr(it, "_dataset", None))
        return any(p is not None and id(p) in held and is_stateful(p) for p in parts)

    return [it for it in live if not retained(it)]


def describe(it: _BaseDataLoaderIter) -> str:
    """The iterator's loader, as a warning names it: its dataset's and sampler's types."""
    index = getattr(it, "_index_sampler", None)
    sampler = getattr(index, "sampler", index)
    return (
        f"a DataLoader over {type(getattr(it, '_dataset', None)).__name__} "
        f"({type(sampler).__name__})"
    )
