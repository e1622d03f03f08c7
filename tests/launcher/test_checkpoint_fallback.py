"""The fatal-failure checkpoint end to end: a job's last checkpoint is complete, a relaunch
loads it, and a checkpoint directory that cannot be written never stops training.
Real leto-run jobs, 2 CPU ranks, the demo GPT; digests equal the fault-free run's."""

from __future__ import annotations

from pathlib import Path

import pytest

from leto.checkpoint import COMPLETE, complete_steps
from leto.events import Kind
from tests.launcher.harness import assert_exact, digests, fault_free_digests, run_leto

STEPS = 12
# A warm-up longer than the job: the learning rate does not depend on --steps, so a job of
# 8 steps relaunched to 12 follows the same schedule as one run of 12.
ARGS = ["--warmup", "1000"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], set[str]]:
    return fault_free_digests(tmp_path_factory.mktemp("ref"), steps=STEPS, script_args=ARGS)


def _kinds(events: list[dict], kind: Kind) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


@pytest.mark.timeout(300)
def test_the_last_checkpoint_is_complete_and_a_relaunch_resumes_from_it(
    tmp_path: Path, reference
) -> None:
    ckpt = tmp_path / "ckpt"
    section = {"checkpoint": {"dir": str(ckpt), "interval_steps": 4}}
    proc, events = run_leto(tmp_path, steps=8, leto=section, script_args=ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ckpt / "step_000000008" / COMPLETE).is_file(), sorted(p.name for p in ckpt.rglob("*"))
    assert complete_steps(ckpt) == [4, 8]
    assert [e["step"] for e in _kinds(events, Kind.CHECKPOINT_SAVED)] == [4, 8]
    assert not _kinds(events, Kind.CHECKPOINT_FAILED)
    assert_exact({k: v for k, v in reference.items() if k[1] <= 8}, events)

    # A new job on the same directory: no retained state, so it loads the newest checkpoint.
    proc, events = run_leto(tmp_path, steps=STEPS, leto=section, script_args=ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = _kinds(events, Kind.CHECKPOINT_LOADED)
    assert sorted((e["rank"], e["step"]) for e in loaded) == [(0, 8), (1, 8)]
    got = digests(events)
    assert min(step for _, step in got) == 8  # the loaded state's digest, then steps 9..12
    assert_exact({k: v for k, v in reference.items() if k[1] >= 8}, events)


@pytest.mark.timeout(300)
def test_an_unwritable_checkpoint_directory_never_stops_training(tmp_path: Path, reference) -> None:
    """The directory's parent is a file (ENOTDIR, also as root): every save fails on every
    rank, each is an event and a warning, and the job finishes exactly."""
    blocker = tmp_path / "mnt"
    blocker.write_text("")
    section = {"checkpoint": {"dir": str(blocker / "ckpt"), "interval_steps": 3}}
    proc, events = run_leto(tmp_path, steps=7, leto=section, script_args=ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed = _kinds(events, Kind.CHECKPOINT_FAILED)
    assert sorted((e["rank"], e["step"]) for e in failed) == [(0, 3), (0, 6), (1, 3), (1, 6)], (
        failed
    )
    assert all("NotADirectoryError" in e["error"] for e in failed), failed
    assert proc.stderr.count("checkpoint of step 3") == 2, proc.stderr[-3000:]  # one line per rank
    assert not _kinds(events, Kind.CHECKPOINT_SAVED) and not _kinds(events, Kind.GROUP_RESTART)
    assert_exact({k: v for k, v in reference.items() if k[1] <= 7}, events)
