"""Settings a trainer finds it cannot run with (a ``ConfigError`` raised inside the script,
here ``leto.rmu_fused: true`` on a machine without CUDA, found when ``retain()`` plans the
update) end the job as bad input does: one line on stderr naming the key, exit code 2, no
traceback, and no group restart even with restarts left (every attempt would stop the same
way)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from leto.events import Kind, read_events
from tests.launcher.harness import GPT, GPT_ARGS, LETO_RUN, _env


@pytest.mark.skipif(torch.cuda.is_available(), reason="rmu_fused runs where there is CUDA")
def test_a_setting_refused_in_the_trainer_ends_the_job_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "job.yaml").write_text("leto:\n  rmu_fused: true\n")
    events = tmp_path / "events.jsonl"
    cmd = [
        *LETO_RUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-dashboard",
        "--max-restarts",
        "2",
        "--events",
        str(events),
        "--config",
        "job.yaml",
        GPT,
        "--steps",
        "3",
        *GPT_ARGS,
    ]
    env = _env()
    env.pop("TRITON_INTERPRET", None)  # the interpreter would run the kernel on CPU tensors
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env, check=False
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        "leto-run: error: leto.rmu_fused: true needs a CUDA device (or TRITON_INTERPRET=1 for "
        "tests); set rmu_fused: false or leave it unset"
    )
    kinds = [e["kind"] for e in read_events(events)]
    assert Kind.GROUP_RESTART not in kinds
    finished = [e for e in read_events(events) if e["kind"] == Kind.JOB_FINISHED]
    assert [(e["ok"], e.get("error")) for e in finished] == [(False, "ConfigError")]
