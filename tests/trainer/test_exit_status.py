"""A process that hosts a ``Context`` without ``leto.init()`` (a test runner) keeps its own exit
status after a training loop finished: only a trainer that ``leto.init()`` started leaves by
``os._exit(0)`` (``leto.trainer.context._CleanExit``). Else a test session whose in-process
loops finish would report success whatever failed."""

from __future__ import annotations

import subprocess
import sys

from tests.launcher.harness import REPO

SCRIPT = """
import sys
import pytest, torch
from tests.trainer.local import local_context

with local_context(pytest.MonkeyPatch()) as ctx:
    model = torch.nn.Linear(2, 1)
    state = ctx.retain(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in state.steps(2):
        loss = model(torch.ones(1, 2)).sum()
        loss.backward()
        state.step(loss=loss)
sys.exit(3)
"""


def test_a_finished_loop_in_a_host_process_keeps_its_exit_status() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 3, proc.stderr[-2000:]
