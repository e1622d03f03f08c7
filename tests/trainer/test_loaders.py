"""A DataLoader a recovery would restart is named in a warning, before any failure and again
after a recovery; one whose position Leto retains is not (``leto.trainer.loaders``)."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from leto.trainer.extras import RecordStore, RetainedExtras
from leto.trainer.loaders import unretained_loader_iterators
from tests.trainer.test_extras import _region

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")

DATA = TensorDataset(torch.arange(32.0))


class Position:
    """A resumable sampler: a user's Stateful that the loader draws its indices from."""

    def __init__(self) -> None:
        self.next = 0

    def __iter__(self) -> Any:
        while self.next < len(DATA):
            self.next += 1
            yield self.next - 1

    def __len__(self) -> int:
        return len(DATA)

    def state_dict(self) -> dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next = state["next"]


def test_an_iterator_is_unretained_unless_a_named_object_holds_it_its_sampler_or_dataset() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    plain = iter(DataLoader(DATA, batch_size=4))
    assert unretained_loader_iterators([]) == [plain]
    stateful = StatefulDataLoader(DATA, batch_size=4)
    held = iter(stateful)  # the loader keeps its iterator, to answer state_dict()

    class Wrapper:  # a script's own object around its loader (examples/train_scheduled.py)
        def __init__(self) -> None:
            self.loader = stateful

    assert unretained_loader_iterators([stateful]) == [plain]
    assert unretained_loader_iterators([Wrapper()]) == [plain]
    position = Position()
    by_sampler = iter(DataLoader(DATA, batch_size=4, sampler=position))
    assert set(map(id, unretained_loader_iterators([stateful]))) == {id(plain), id(by_sampler)}
    assert unretained_loader_iterators([stateful, position]) == [plain]
    del plain
    assert unretained_loader_iterators([stateful, position]) == []
    assert held is not None


def _run(named: dict[str, Any], caplog: pytest.LogCaptureFixture) -> list[str]:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
    loader = DataLoader(DATA, batch_size=4, sampler=named.get("position"))
    it = iter(loader)
    extras = RetainedExtras(RecordStore(_region()), opt, named, 0)
    with caplog.at_level(logging.WARNING, logger="leto.trainer.extras"):
        for t in range(3):
            extras.begin(t)
            next(it)
            extras.before_commit(t)
        fresh = RetainedExtras(RecordStore(extras.store.region.clone()), opt, named, 0)
        assert fresh.resume(3) == "pre"
        fresh.begin(3)
    return [r.getMessage() for r in caplog.records if "DataLoader" in r.getMessage()]


def test_a_trainer_names_a_loader_a_recovery_would_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    first, after = _run({}, caplog)
    assert "DataLoader over TensorDataset (SequentialSampler) is not retained" in first
    assert "after a recovery the promoted trainer's loader starts again" in first
    assert "resumed at step 3" in after


def test_a_loader_over_a_named_position_is_not_named(caplog: pytest.LogCaptureFixture) -> None:
    assert _run({"position": Position()}, caplog) == []


def test_an_iterator_in_garbage_is_not_named() -> None:
    class Cycle:
        def __init__(self) -> None:
            self.me = self
            self.it = iter(DataLoader(DATA, batch_size=4))

    gc.disable()  # the collector runs only when the scan asks
    try:
        Cycle()  # unreachable, but alive until the collector runs
        assert unretained_loader_iterators([]) == []
    finally:
        gc.enable()
