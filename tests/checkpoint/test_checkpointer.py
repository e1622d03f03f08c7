"""The checkpointer on its own: one rank, a gloo group in this process, a real DCP save.

Pruning, incomplete directories, ``newest_complete``, restore, and checkpoints that cannot
be written (a path under a file, a full disk in the background write, a failed staging):
each is an event and training goes on; a later interval saves again.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from leto.checkpoint import COMPLETE, Checkpointer, complete_steps, newest_complete
from leto.config import CheckpointConfig
from leto.events import EventLog, Kind, read_events


@pytest.fixture(scope="module")
def group() -> dist.ProcessGroup:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.new_group(backend="gloo")
    dist.destroy_process_group()


class Run:
    """A checkpointer over two tensors whose values are the step they were last set at."""

    def __init__(
        self,
        tmp: Path,
        group: dist.ProcessGroup,
        root: Path,
        restart_count: int = 0,
        keep: int = 2,
        interval: int = 2,
    ) -> None:
        self.events_path = tmp / "events.jsonl"
        self.views = {"model.w": torch.zeros(8), "rng.rank0": torch.zeros(4, dtype=torch.uint8)}
        self.loaded: list[int] = []
        self.ckpt = Checkpointer(
            CheckpointConfig(dir=str(root), interval_steps=interval, keep=keep),
            self.views,
            rank=0,
            group=group,
            events=EventLog(self.events_path, "trainer0"),
            restart_count=restart_count,
            on_loaded=self.loaded.append,
        )

    def train(self, steps: range) -> None:
        for step in steps:
            self.views["model.w"].fill_(float(step))
            self.views["rng.rank0"].fill_(step)
            self.ckpt.committed(step)

    def events(self, kind: Kind) -> list[dict]:
        return [e for e in read_events(self.events_path) if e["kind"] == kind]


def test_saves_at_the_interval_marks_complete_and_keeps_the_newest(tmp_path, group) -> None:
    run = Run(tmp_path, group, tmp_path / "ckpt", keep=2, interval=2)
    run.train(range(1, 8))
    run.ckpt.close()
    assert [e["step"] for e in run.events(Kind.CHECKPOINT_SAVED)] == [2, 4, 6]
    assert complete_steps(tmp_path / "ckpt") == [4, 6]  # step 2 pruned
    assert sorted(d.name for d in (tmp_path / "ckpt").iterdir()) == [
        "step_000000004",
        "step_000000006",
    ]
    assert not run.events(Kind.CHECKPOINT_FAILED)


def test_newest_complete_skips_incomplete_directories_and_strays(tmp_path, group) -> None:
    root = tmp_path / "ckpt"
    assert newest_complete(root) is None  # no directory at all
    run = Run(tmp_path, group, root, keep=3, interval=2)
    run.train(range(1, 5))
    run.ckpt.close()
    (root / "step_000000010").mkdir()  # a save that never finished
    (root / "step_000000012").mkdir()
    (root / "step_000000012" / "__0_0.distcp").write_bytes(b"torn")
    (root / "step_000000014").write_text("")  # a file, not a checkpoint
    (root / "step_x").mkdir()
    assert newest_complete(root) == 4
    assert complete_steps(root) == [2, 4]
    # The next complete save prunes what is older than the kept ones, incomplete or not.
    run = Run(tmp_path, group, root, keep=1, interval=2)
    run.train(range(15, 17))
    run.ckpt.close()
    assert complete_steps(root) == [16]
    assert not (root / "step_000000010").exists() and not (root / "step_000000012").exists()
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("")
    assert newest_complete(not_a_dir) is None


def test_restore_loads_the_newest_complete_checkpoint_into_the_views(tmp_path, group) -> None:
    root = tmp_path / "ckpt"
    run = Run(tmp_path, group, root, interval=3)
    run.train(range(1, 8))  # saves 3 and 6
    run.ckpt.close()
    run.views["model.w"].fill_(-1.0)
    assert run.ckpt.restore() == 6
    assert run.loaded == [6]
    assert torch.equal(run.views["model.w"], torch.full((8,), 6.0))
    assert torch.equal(run.views["rng.rank0"], torch.full((4,), 6, dtype=torch.uint8))
    (loaded,) = run.events(Kind.CHECKPOINT_LOADED)
    assert (loaded["rank"], loaded["step"]) == (0, 6)


def test_a_group_restart_without_checkpoint_says_it_starts_from_step_0(
    tmp_path, group, caplog
) -> None:
    run = Run(tmp_path, group, tmp_path / "empty", restart_count=1)
    with caplog.at_level(logging.WARNING, logger="leto.checkpoint"):
        assert run.ckpt.restore() is None
    assert [r.getMessage() for r in caplog.records] == [
        f"no checkpoint found in {tmp_path / 'empty'}: starting from step 0"
    ]
    caplog.clear()
    first = Run(tmp_path, group, tmp_path / "empty", restart_count=0)
    with caplog.at_level(logging.WARNING, logger="leto.checkpoint"):
        assert first.ckpt.restore() is None  # a first attempt has nothing to load: no warning
    assert not caplog.records


def test_an_unwritable_directory_is_an_event_and_a_later_interval_saves(
    tmp_path, group, caplog
) -> None:
    """The checkpoint directory cannot be created (a file is in its path: ENOTDIR also as
    root, where permission bits do not stop a write). Training goes on; once the path is
    usable again the next interval saves a complete checkpoint."""
    blocker = tmp_path / "mnt"
    blocker.write_text("")
    root = blocker / "ckpt"
    run = Run(tmp_path, group, root, interval=2)
    with caplog.at_level(logging.WARNING, logger="leto.checkpoint"):
        run.train(range(1, 4))  # the save of step 2 fails
        run.ckpt.close()
    (failed,) = run.events(Kind.CHECKPOINT_FAILED)
    assert (failed["rank"], failed["step"]) == (0, 2) and failed["error"], failed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "checkpoint of step 2" in warnings[0], warnings
    assert "\n" not in warnings[0]
    blocker.unlink()
    run.train(range(4, 5))
    run.ckpt.close()
    assert complete_steps(root) == [4]
    assert [e["step"] for e in run.events(Kind.CHECKPOINT_SAVED)] == [4]


def test_a_full_disk_in_the_background_write_is_an_event(tmp_path, group, monkeypatch) -> None:
    """ENOSPC from the storage writer, in DCP's background thread. A re-save of a step that
    was complete before must not leave it marked complete."""
    root = tmp_path / "ckpt"
    run = Run(tmp_path, group, root, keep=5, interval=2)
    run.train(range(1, 5))
    run.ckpt.close()
    assert complete_steps(root) == [2, 4]

    def full(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    run.train(range(3, 7))  # re-saves step 4, then saves 6: both fail
    run.ckpt.close()
    failed = run.events(Kind.CHECKPOINT_FAILED)
    assert [e["step"] for e in failed] == [4, 6]
    assert all("No space left" in e["error"] for e in failed), failed
    assert newest_complete(root) == 2
    assert not (root / "step_000000006").exists()  # what it wrote is removed
    monkeypatch.undo()
    run.train(range(7, 9))
    run.ckpt.close()
    assert newest_complete(root) == 8


class _Unstageable(torch.Tensor):
    """A view whose copy fails (as a clone out of memory would)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.clone:
            raise torch.OutOfMemoryError("staging: out of memory")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_failed_staging_skips_the_interval(tmp_path, group) -> None:
    root = tmp_path / "ckpt"
    run = Run(tmp_path, group, root, interval=2)
    good = run.views["model.w"]
    run.views["model.w"] = torch.zeros(8).as_subclass(_Unstageable)
    run.train(range(1, 3))
    run.ckpt.close()
    (failed,) = run.events(Kind.CHECKPOINT_FAILED)
    assert failed["step"] == 2 and "OutOfMemoryError" in failed["error"]
    assert newest_complete(root) is None
    run.views["model.w"] = good
    run.train(range(3, 5))
    run.ckpt.close()
    assert complete_steps(root) == [4]
    assert (root / "step_000000004" / COMPLETE).is_file()


def _fake_checkpoint(root: Path, name: str, *, complete: bool) -> Path:
    """A checkpoint directory as a save leaves it: data, and the marker once it finished."""
    d = root / name
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"data")
    if complete:
        (d / COMPLETE).write_text("{}")
    return d


def test_complete_steps_are_ordered_by_step_and_need_the_marker_as_a_file(tmp_path) -> None:
    root = tmp_path / "ckpt"
    _fake_checkpoint(root, "step_10", complete=True)  # not zero-padded: 10 sorts before 9 by name
    _fake_checkpoint(root, "step_9", complete=True)
    _fake_checkpoint(root, "step_000000011", complete=False)  # newer, never finished
    (_fake_checkpoint(root, "step_000000012", complete=False) / COMPLETE).mkdir()  # not a file
    (root / "step_").mkdir()  # no step number
    (root / "other_000000013").mkdir()
    (root / "other_000000013" / COMPLETE).write_text("{}")  # complete, but not a checkpoint
    assert complete_steps(root) == [9, 10]
    assert newest_complete(root) == 10


def test_pruning_leaves_newer_incomplete_saves_and_what_is_not_a_checkpoint(
    tmp_path, group
) -> None:
    """Once a save completes, checkpoints older than the ``keep`` newest complete ones go,
    complete or not; a newer incomplete directory (a save that may still be written) and
    entries that are not checkpoint directories stay."""
    root = tmp_path / "ckpt"
    _fake_checkpoint(root, "step_000000000", complete=False)
    _fake_checkpoint(root, "step_000000001", complete=True)
    _fake_checkpoint(root, "step_000000003", complete=False)
    _fake_checkpoint(root, "step_000000050", complete=False)
    (root / "step_000000005").write_text("")  # a file
    (root / "step_x").mkdir()
    (root / "notes.txt").write_text("")
    run = Run(tmp_path, group, root, keep=2, interval=2)
    run.train(range(9, 11))  # saves 10: the two kept are 1 and 10
    run.ckpt.close()
    assert complete_steps(root) == [1, 10]
    assert not (root / "step_000000000").exists()  # older than the oldest kept
    assert (root / "step_000000003").is_dir()  # newer than it
    run.train(range(11, 13))  # saves 12: keeps 10 and 12
    run.ckpt.close()
    assert complete_steps(root) == [10, 12]
    assert sorted(p.name for p in root.iterdir()) == [
        "notes.txt",
        "step_000000005",
        "step_000000010",
        "step_000000012",
        "step_000000050",
        "step_x",
    ]
    assert newest_complete(root) == 12


def test_restore_skips_a_newer_incomplete_checkpoint(tmp_path, group) -> None:
    root = tmp_path / "ckpt"
    run = Run(tmp_path, group, root, interval=3)
    run.train(range(1, 7))  # saves 3 and 6
    run.ckpt.close()
    _fake_checkpoint(root, "step_000000009", complete=False)  # torn: the group died in it
    run.views["model.w"].fill_(-1.0)
    assert run.ckpt.restore() == 6
    assert torch.equal(run.views["model.w"], torch.full((8,), 6.0))
