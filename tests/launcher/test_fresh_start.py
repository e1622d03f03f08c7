"""A trainer killed after ``leto.init()`` but before every rank retained its state (while
the script builds or loads its model) leaves nothing to recover in place: the job starts
afresh, which ``--max-restarts`` (0 here, torchrun's default) does not count, and trains
exactly as a run without the kill (``leto_run.policy.Action.FRESH_START``). The new
attempt is a leto job like the first: a later kill is recovered in place."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import assert_exact, fault_free_digests, run_leto

SCRIPT = """
import argparse, os, time
from pathlib import Path
import torch
import leto

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int)
p.add_argument("--pause-before-retain", action="store_true")
args = p.parse_args()
ctx = leto.init()
pid_file = Path("rank1.pid")
if args.pause_before_retain and ctx.rank == 1 and not pid_file.exists():
    pid_file.write_text(str(os.getpid()))
    time.sleep(60)  # building the model: the test kills this trainer here
torch.manual_seed(0)
with ctx.init_device(ctx.device):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
state = ctx.retain(model, opt)
for step in state.steps(args.steps):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + ctx.rank))
    loss = state.compute(lambda: (l := model(x).square().mean(), l.backward(), l)[2])
    state.step(loss=loss)
"""
STEPS = 6
LATER = FaultSpec(rank=0, step=4, phase="backward")


@pytest.mark.timeout(300)
def test_a_kill_before_the_state_is_retained_starts_the_job_afresh(tmp_path: Path) -> None:
    script = tmp_path / "early.py"
    script.write_text(SCRIPT)
    (tmp_path / "ref").mkdir()
    ref = fault_free_digests(
        tmp_path / "ref", steps=STEPS, script=str(script), model_args=[], nproc=2
    )
    run = tmp_path / "run"
    run.mkdir()
    done = threading.Event()

    def kill_rank1() -> None:
        pid_file = run / "rank1.pid"
        while not done.is_set() and not pid_file.exists():
            time.sleep(0.05)
        if not done.is_set():
            time.sleep(0.2)  # the pid is written before the pause
            os.kill(int(pid_file.read_text()), signal.SIGKILL)

    killer = threading.Thread(target=kill_rank1)
    killer.start()
    try:
        proc, events = run_leto(
            run,
            steps=STEPS,
            script=str(script),
            model_args=[],
            script_args=["--pause-before-retain"],
            nproc=2,
            faults=[LATER],
        )
    finally:
        done.set()
        killer.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = [e for e in events if e["kind"] == Kind.EPOCH]
    assert [(e["action"], "before every rank retained" in e["reason"]) for e in epochs] == [
        ("restart", True),
        ("in_place", False),
    ]
    resumed = [(e["rank"], e["step"]) for e in events if e["kind"] == Kind.RESUMED]
    assert sorted(resumed) == [(0, LATER.step), (1, LATER.step)]
    assert [e["ok"] for e in events if e["kind"] == Kind.JOB_FINISHED] == [True]
    assert_exact(ref, events)


def test_the_state_counts_as_retained_only_once_its_checkpoint_has_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fresh trainer loads the newest checkpoint into its retained views after
    ``RetainedState`` initialised them at step 0: a kill mid-load must start the attempt
    afresh, never promote shadows onto a half-loaded state, so ``retained/{rank}`` is set
    after the load (a trainer ``Context`` in this process, a gloo world of one)."""
    import torch
    import torch.distributed as dist

    from leto import contract
    from leto.checkpoint import Checkpointer
    from leto.config import CheckpointConfig
    from tests.trainer.local import local_context

    seen_during_load = []

    def restore(self: Checkpointer) -> None:
        seen_during_load.append(ctx.store.check([contract.retained(0)]))

    monkeypatch.setattr(Checkpointer, "restore", restore)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with local_context(monkeypatch) as ctx:
            model = torch.nn.Linear(4, 4)
            opt = torch.optim.AdamW(model.parameters())
            ctx.retain(model, opt, checkpoint=CheckpointConfig(dir=str(tmp_path), interval_steps=5))
            assert seen_during_load == [False]
            assert ctx.store.check([contract.retained(0)])
    finally:
        dist.destroy_process_group()
