"""A process outside the job cannot promote shadows (two writers on retained state).

The worker TCPStore is a TCP port any local process can reach. A forger that knows
leto's key names writes the promotion keys of generation 1 while the actives train; the
shadows must not move (their keys live under the job's secret token, ``leto.contract``),
and the job must finish exactly as the fault-free run.
"""

from __future__ import annotations

import contextlib
import os
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


def _listening_ports(pid: int) -> list[int]:
    """The TCP ports ``pid`` listens on (its sockets' inodes in ``/proc/net/tcp*``)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


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
        # The forger finds the agent's ports (the worker store among them) and writes leto's
        # promotion keys without the token to each.
        ports = _listening_ports(proc.pid)
        assert ports, "the agent listens on no port"
        for port in ports:
            with contextlib.suppress(Exception):  # a port that is not a TCPStore
                store = dist.TCPStore(
                    "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5)
                )
                forged = dist.PrefixStore("/leto/attempt_0/", store)  # leto's key layout
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
