"""A process outside the job cannot promote shadows (two writers on retained state).

The worker TCPStore is a TCP port any local process can reach. A forger that knows
leto's key names writes the promotion keys of generation 1 while the actives train; the
shadows must not move (their keys live under the job's secret token, ``leto.contract``),
and the job must finish exactly as the fault-free run.
"""

from __future__ import annotations

import subprocess
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from leto.events import Kind, read_events
from tests.launcher.harness import GPT, GPT_ARGS, LETO_RUN, _env, assert_exact, fault_free_digests

STEPS = 1000
"""Long enough for both shadows, pre-initialising at a lowered priority, to become ready
while the actives train."""


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split("=", 1) for item in f.read().decode().split("\0") if "=" in item)


@pytest.mark.timeout(400)
def test_promotion_keys_written_without_the_token_are_ignored(tmp_path) -> None:
    reference = fault_free_digests(tmp_path, steps=STEPS)
    events_path = tmp_path / "forged.jsonl"
    cmd = [
        *LETO_RUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-dashboard",
        "--digest",
        "--events",
        str(events_path),
        GPT,
        "--steps",
        str(STEPS),
        *GPT_ARGS,
    ]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 200
        while time.monotonic() < deadline:  # until both shadows wait for promotion
            events = read_events(events_path) if events_path.exists() else []
            if len([e for e in events if e["kind"] == Kind.SHADOW_READY]) == 2:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the shadows never became ready")
        active = next(
            e["pid"] for e in events if e["kind"] == Kind.TRAINER_STARTED and e["role"] == "active"
        )
        env = _environ(active)  # the forger learns the port (not the token: it is not asked for)
        store = dist.TCPStore(
            env["MASTER_ADDR"],
            int(env["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=10),
        )
        forged = dist.PrefixStore("/leto/attempt_0/", store)  # leto's key layout, without the token
        for rank in range(2):
            forged.set(f"promote/1/{rank}", "1")
        _, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    events = read_events(events_path)
    assert not [e for e in events if e["kind"] in (Kind.PROMOTED, Kind.RESUMED)], (
        "a forged key promoted a shadow"
    )
    assert_exact(reference, events)
