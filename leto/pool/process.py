"""Start and stop the state manager as a child process of the agent."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

from leto.errors import PoolError
from leto.pool.client import PoolClient


class StateManagerProcess:
    """The node's state manager: a torch-free child process serving a 0700 socket dir."""

    def __init__(self, proc: subprocess.Popen[str], socket_dir: str) -> None:
        self.proc = proc
        self.socket_dir = socket_dir
        self.socket_path = os.path.join(socket_dir, "state-manager.sock")

    @classmethod
    def start(cls, timeout_s: float = 10.0) -> StateManagerProcess:
        socket_dir = tempfile.mkdtemp(prefix="leto-sm-")  # mode 0700
        path = os.path.join(socket_dir, "state-manager.sock")
        proc = subprocess.Popen(
            [sys.executable, "-m", "leto.pool.server", path],
            stdout=subprocess.PIPE, text=True, close_fds=True,
        )
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline().strip() if ready else ""
        if line != "ready":
            proc.kill()
            proc.wait()
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise PoolError(f"the state manager did not start within {timeout_s} s (got {line!r})")
        return cls(proc, socket_dir)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def client(self) -> PoolClient:
        return PoolClient(self.socket_path)

    def reset(self) -> int:
        """Drop every retained region (before a group restart)."""
        client = self.client()
        try:
            return client.reset()
        finally:
            client.close()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.alive():
            self.proc.terminate()
            deadline = time.monotonic() + timeout_s
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            if self.alive():
                self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
