"""Warm starts: torch's worker processes, started from Leto's pre-warmed fork server.

torch's ``SubprocessContext`` starts each worker through ``get_subprocess_handler``; while
``warm_spawns(server)`` is active that factory returns a handler whose "Popen" is a worker
forked by :mod:`leto.forkserver` (torch already imported) and re-parented to this agent.
Everything else — environment, log files, tee, exit codes, ``killpg`` on close — is
torch's own code, so a plain torchrun script starts and restarts exactly as under
torchrun, only without paying for interpreter start-up and ``import torch`` in every
worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from leto.forkserver import ForkServer, served_argv

logger = logging.getLogger(__name__)


class WarmPopen:
    """The part of ``subprocess.Popen`` torch uses, for a re-parented child of this agent."""

    def __init__(self, pid: int, args: tuple[str, ...]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not (or no longer) our child: report it as gone
                logger.warning(
                    "worker %d is not a child of this agent; reporting it as killed", self.pid
                )
                self.returncode = -int(signal.SIGKILL)
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(list(self.args), timeout or 0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _handler_class(server: ForkServer, compiler: bool) -> type[SubprocessHandler]:
    class WarmHandler(SubprocessHandler):
        def _popen(self, args: tuple[str, ...], env: dict[str, str]) -> Any:
            if args[0] != sys.executable or not served_argv(list(args)):
                return super()._popen(args, env)
            out = self._stdout.fileno() if self._stdout else sys.stdout.fileno()
            err = self._stderr.fileno() if self._stderr else sys.stderr.fileno()
            pid = server.spawn([str(a) for a in args], env, out, err, compiler)
            return WarmPopen(pid, args)

    return WarmHandler


def started_warm(pcontext: Any) -> bool:
    """Whether every worker of ``pcontext`` (torch's process context) came from the fork
    server (a command line it cannot serve starts cold)."""
    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    return bool(handlers) and all(isinstance(h.proc, WarmPopen) for h in handlers.values())


@contextlib.contextmanager
def warm_spawns(server: ForkServer | None, compiler: bool = False) -> Iterator[None]:
    """Within this block torch starts binary workers from ``server`` (None: as usual);
    ``compiler``: they are Leto trainers (``ForkServer.spawn``)."""
    if server is None:
        yield
        return
    handler = _handler_class(server, compiler)
    original = mp_api.get_subprocess_handler

    def get_handler(**kwargs: Any) -> SubprocessHandler:
        return handler(**kwargs)

    mp_api.get_subprocess_handler = get_handler  # type: ignore[assignment]
    try:
        yield
    finally:
        mp_api.get_subprocess_handler = original  # type: ignore[assignment]
