"""A mixture-of-experts job whose experts get no tokens on some steps, on some ranks or on
every rank (``examples/train_moe.py``, Hugging Face Mixtral's loop over experts): leto-run
trains it exactly as the same loop under torchrun with DDP and torch's AdamW, which leave an
expert no rank reached without a gradient and skip it (``leto.retained.presence``); and
kills in forward, backward and the update recover in place to the fault-free run's state,
the finishing update skipping the experts the interrupted one skipped. The replicas stay
equal at every step: every rank skips the same experts. The same under float16 autocast with
its ``GradScaler`` (``--fp16``; ``leto.trainer.loss_scale``) against torch's ``scaler.step``
and ``scaler.update``: the scale grows every 4 steps and the step after each growth
overflows (steps 4 and 9, skipped whole), and the kills in the update land on both."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leto.config import FaultSpec
from leto.events import Kind
from tests.launcher.harness import REPO, assert_recovered, digests, run_leto, run_plain

SCRIPT = str(REPO / "examples/train_moe.py")
STEPS = 12
ARGS = ["--layers", "1"]
DIGEST = re.compile(r"rank (\d) parameters \|sum\| ([0-9.]+\d)")


def _final(output: str) -> dict[str, str]:
    return dict(DIGEST.findall(output))


FP16 = ["--fp16", "--growth-interval", "4"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32", "fp16"])
def test_experts_without_tokens_train_and_recover_as_torch(tmp_path: Path, fp16: bool) -> None:
    args = [*ARGS, *(FP16 if fp16 else [])]
    (tmp_path / "ref").mkdir()
    proc, events = run_leto(tmp_path / "ref", steps=STEPS, script=SCRIPT, model_args=args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = digests(events)
    for step in range(1, STEPS + 1):  # the replicas agree on what they skipped
        assert reference[(0, step)] == reference[(1, step)], f"step {step}"

    leto_final = _final(proc.stdout)
    torch_final = _final(run_plain(tmp_path, SCRIPT, STEPS, args))
    assert leto_final and leto_final == torch_final

    faults = [
        FaultSpec(rank=1, step=4, phase="update"),
        FaultSpec(rank=0, step=6, phase="backward"),
        FaultSpec(rank=0, step=9, phase="update"),
    ]
    proc, events = run_leto(tmp_path, steps=STEPS, faults=faults, script=SCRIPT, model_args=args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(reference, events, faults, nproc=2, resumed_at=[5, 6, 10])
    assert not [e for e in events if e["kind"] == Kind.GROUP_RESTART]
    assert _final(proc.stdout) == leto_final
