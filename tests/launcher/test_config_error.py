"""Settings a trainer finds it cannot run with (a ``ConfigError`` raised inside the script,
here ``leto.rmu_fused: true`` on a machine without CUDA, found when ``retain()`` plans the
update) end the job as bad input does: one line on stderr naming the key, exit code 2, no
traceback, and no group restart even with restarts left (every attempt would stop the same
way)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leto.events import Kind
from tests.launcher.harness import run_leto


@pytest.mark.skipif(torch.cuda.is_available(), reason="rmu_fused runs where there is CUDA")
def test_a_setting_refused_in_the_trainer_ends_the_job_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the updater tests' conftest sets it for the suite: the interpreter would run the kernel
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    proc, events = run_leto(
        tmp_path,
        steps=3,
        leto={"rmu_fused": True},
        extra=["--max-restarts", "2"],
        digest=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        "leto-run: error: leto.rmu_fused: true needs a CUDA device (or TRITON_INTERPRET=1 for "
        "tests); set rmu_fused: false or leave it unset"
    )
    assert Kind.GROUP_RESTART not in [e["kind"] for e in events]
    finished = [e for e in events if e["kind"] == Kind.JOB_FINISHED]
    assert [(e["ok"], e.get("error")) for e in finished] == [(False, "ConfigError")]


LEFTOVER = """
import torch
import leto

ctx = leto.init()
torch.manual_seed(0)
with ctx.init_device(ctx.device):
    model = torch.nn.Linear(4, 4)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
state = ctx.retain(model, opt)
for step in state.steps(3):
    loss = state.compute(lambda: (l := model(torch.ones(2, 4)).square().mean(), l.backward(), l)[2])
    {leftover}  # left over from the torchrun loop
    state.step(loss=loss)
"""


@pytest.mark.parametrize(
    ("leftover", "error"),
    [
        ("opt.step()", "the script calls AdamW.step() itself"),
        (
            "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)",
            "a gradient was written between backward and state.step()",
        ),
        ("opt.zero_grad()", "a gradient no longer lives in retained memory"),
        ("if step == 1: continue", "step 1 ended without state.step() being called"),
    ],
    ids=["optimizer-step", "clip-grad-norm", "zero-grad", "no-state-step"],
)
def test_a_torchrun_loops_leftover_ends_the_job_in_one_line(
    tmp_path: Path, leftover: str, error: str
) -> None:
    """A torchrun loop ported with its ``opt.step()`` left in would update twice per step
    (``leto.trainer.step_guard``); with its ``clip_grad_norm_`` left before ``state.step()``
    it would clip one rank's gradients, not their mean (``leto.trainer.grad_landing``); its
    ``zero_grad()`` there would leave the update no gradient; a ``continue`` past
    ``state.step()`` leaves a step uncommitted. Each is the script's (``ScriptError``), the
    same on every run: one line, exit 2, no restart."""
    script = tmp_path / "leftover.py"
    script.write_text(LEFTOVER.format(leftover=leftover))
    proc, events = run_leto(
        tmp_path,
        steps=3,
        nproc=1,
        script=str(script),
        steps_flag="",
        model_args=[],
        extra=["--max-restarts", "2"],
        digest=False,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith(f"leto-run: error: {error}"), last
    assert Kind.GROUP_RESTART not in [e["kind"] for e in events]
