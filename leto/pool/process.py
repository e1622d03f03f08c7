"""Start and stop the state manager as a child process of the agent, and tell how it ended.

The agent's monitor loop polls :meth:`StateManagerProcess.alive` (one ``waitpid(WNOHANG)``)
and, once it is False, reads :meth:`StateManagerProcess.exit_status` for the cause.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from leto.errors import PoolError
from leto.pool.client import PoolClient


@dataclass(frozen=True, slots=True)
class ExitStatus:
    """How the state manager ended: an exit code, or the signal that killed it."""

    code: int | None
    """The exit code (0: a ``shutdown`` request or SIGTERM, i.e. stopped on purpose)."""
    signal: signal.Signals | None
    """The signal that killed it (SIGKILL: e.g. the OOM killer)."""

    @classmethod
    def from_returncode(cls, returncode: int) -> ExitStatus:
        if returncode < 0:
            return cls(code=None, signal=signal.Signals(-returncode))
        return cls(code=returncode, signal=None)

    @property
    def stopped(self) -> bool:
        """True when it ended on purpose (asked to), not by a crash or a kill."""
        return self.code == 0

    def __str__(self) -> str:
        return (
            f"killed by {self.signal.name}"
            if self.signal is not None
            else f"exited with code {self.code}"
        )


class StateManagerProcess:
    """The node's state manager: a torch-free child process serving a 0700 socket dir."""

    def __init__(
        self,
        proc: subprocess.Popen[str],
        socket_dir: str,
        max_connections_per_peer: int | None = None,
    ) -> None:
        self.proc = proc
        self.socket_dir = socket_dir
        self.socket_path = os.path.join(socket_dir, "state-manager.sock")
        self.max_connections_per_peer = max_connections_per_peer

    @classmethod
    def start(
        cls,
        timeout_s: float = 10.0,
        max_connections_per_peer: int | None = None,
        socket_dir: str | None = None,
    ) -> StateManagerProcess:
        """``socket_dir``: serve there (made now, 0700; it must not exist) instead of a
        fresh temporary directory."""
        if socket_dir is None:
            socket_dir = tempfile.mkdtemp(prefix="leto-sm-")  # mode 0700
        else:
            os.mkdir(socket_dir, 0o700)  # never one someone else made
        path = os.path.join(socket_dir, "state-manager.sock")
        options = (
            ()
            if max_connections_per_peer is None
            else ("--max-connections-per-peer", str(max_connections_per_peer))
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "leto.pool.server", path, *options],
            stdout=subprocess.PIPE,
            text=True,
            close_fds=True,
        )
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline().strip() if ready else ""
        if line != "ready":
            proc.kill()
            proc.wait()
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise PoolError(f"the state manager did not start within {timeout_s} s (got {line!r})")
        return cls(proc, socket_dir, max_connections_per_peer)

    def restart(self, timeout_s: float = 10.0) -> StateManagerProcess:
        """A fresh state manager at the same socket path (so ``LETO_POOL_SOCKET`` stays
        right for trainers started later), holding nothing: stops (or reaps) this one first.
        Use only the returned object from then on (this one's ``stop`` would remove the
        directory they share)."""
        self.stop()
        return self.start(timeout_s, self.max_connections_per_peer, socket_dir=self.socket_dir)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        """False once the process has ended (cheap: one non-blocking ``waitpid``)."""
        return self.proc.poll() is None

    def exit_status(self) -> ExitStatus | None:
        """How it ended; None while it runs. Every region it held is gone with it."""
        code = self.proc.poll()
        return None if code is None else ExitStatus.from_returncode(code)

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
