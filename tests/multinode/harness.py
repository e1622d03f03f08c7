"""Two leto-run agents on one machine acting as two nodes (2 ranks each), real processes."""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from leto.config import FaultSpec
from leto.events import read_events
from tests.launcher.harness import GPT, GPT_ARGS, LETO_RUN, _env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    rank: int
    proc: subprocess.Popen[str]
    events: Path


def start_nodes(
    tmp: Path,
    *,
    backend: str,
    steps: int,
    faults: list[FaultSpec] = (),
    extra: list[str] = (),
    script: str = GPT,
    script_args: list[str] = (),
) -> list[Node]:
    """Start the two agents of a 2 x 2 job; ``backend`` is c10d or static."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    if backend == "c10d":
        rdzv = [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            run_id,
        ]
    else:
        rdzv = [
            "--rdzv-backend",
            "static",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
        ]
    nodes = []
    for node_rank in (0, 1):
        events = tmp / f"events-node{node_rank}.jsonl"
        cmd = [
            *LETO_RUN,
            "--nnodes",
            "2",
            "--node-rank",
            str(node_rank),
            "--nproc-per-node",
            "2",
            *rdzv,
            "--no-dashboard",
            "--digest",
            "--events",
            str(events),
            *extra,
        ]
        for f in faults:
            cmd += ["--inject-fault", f"rank={f.rank},step={f.step},phase={f.phase},kind={f.kind}"]
        cmd += [script, "--steps", str(steps), *GPT_ARGS, *script_args]
        log = open(tmp / f"node{node_rank}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            cmd, cwd=tmp, env=_env(), stdout=log, stderr=subprocess.STDOUT, text=True
        )
        nodes.append(Node(node_rank, proc, events))
        if node_rank == 0 and backend == "c10d":
            _wait_listening(port, proc)  # node 0 first: it hosts the c10d store
    return nodes


def _wait_listening(port: int, proc: subprocess.Popen[str], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"node 0 never listened on {port} (exit {proc.poll()})")


def wait_nodes(nodes: list[Node], timeout_s: float) -> list[int]:
    """Exit codes of both agents; kills both and raises if they outlive ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for node in nodes:
        try:
            codes.append(node.proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for n in nodes:
                n.proc.kill()
            raise
    return codes


def all_events(nodes: list[Node]) -> list[dict]:
    return sorted((e for n in nodes for e in read_events(n.events)), key=lambda e: e["t"])


def log_tail(tmp: Path, chars: int = 3000) -> str:
    return "\n".join(f"--- node{i}\n" + (tmp / f"node{i}.log").read_text()[-chars:] for i in (0, 1))
