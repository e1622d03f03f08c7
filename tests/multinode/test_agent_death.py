"""Killing one node's agent fails the job as torchrun's would: non-zero exit, a message
naming the failure, and no process left behind (its trainers die with it)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from leto.events import Kind, read_events
from tests.launcher.test_torchrun_compat import _alive, _descendants
from tests.multinode.harness import log_tail, start_nodes, wait_nodes


def _steady(tmp_path) -> list:
    nodes = start_nodes(tmp_path, backend="c10d", steps=100_000)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # steady state on both nodes: training, shadows ready
        kinds = [[e["kind"] for e in read_events(n.events)] for n in nodes]
        if all(k.count(Kind.SHADOW_READY) == 2 and Kind.STEP_DONE in k for k in kinds):
            return nodes
        time.sleep(0.2)
    for n in nodes:
        n.proc.kill()
    pytest.fail("job never reached steady state\n" + log_tail(tmp_path))


@pytest.mark.timeout(180)
def test_killed_agent_fails_the_job_without_hanging(tmp_path) -> None:
    nodes = _steady(tmp_path)
    family = _descendants(nodes[1].proc.pid)
    assert len(family) >= 5, family  # 2 actives, 2 shadows, a state manager
    os.kill(nodes[1].proc.pid, signal.SIGKILL)
    codes = wait_nodes(nodes, timeout_s=90)
    assert codes[1] == -signal.SIGKILL
    assert codes[0] != 0, log_tail(tmp_path)
    log0 = (tmp_path / "node0.log").read_text()
    assert "train_gpt.py FAILED" in log0, log_tail(tmp_path)
    time.sleep(0.5)
    assert [p for p in family if _alive(p)] == [], "the dead agent's trainers outlived it"


@pytest.mark.timeout(180)
def test_killed_store_host_fails_the_other_node_in_one_line(tmp_path) -> None:
    """Node 0 hosts the c10d store: when its agent dies, node 1 says so in one line, no traceback."""
    nodes = _steady(tmp_path)
    family = _descendants(nodes[1].proc.pid)
    os.kill(nodes[0].proc.pid, signal.SIGKILL)
    codes = wait_nodes(nodes, timeout_s=90)
    assert codes[0] == -signal.SIGKILL
    assert codes[1] == 1, log_tail(tmp_path)
    log1 = (tmp_path / "node1.log").read_text()
    # whichever noticed first (the epoch board or torch's rendezvous) says it, as the last line
    last = log1.rstrip().splitlines()[-1]
    assert last.startswith("leto-run: error: lost the job's store at "), log_tail(tmp_path)
    agent_lines = [
        line for line in log1.splitlines() if not line.startswith("[rank")
    ]  # trainers' own
    assert not [line for line in agent_lines if "Traceback" in line], log_tail(tmp_path)
    time.sleep(0.5)
    assert [p for p in family if _alive(p)] == [], "node 1's trainers outlived its agent"
