"""A pre-warmed fork server: group restarts start workers without paying for ``import torch``.

Started by the agent before it creates any thread, CUDA context or process group, the
server imports torch (and torch.distributed, torch.nn) and waits on its end of a socket
pair (inherited: nothing on disk). For each worker the agent sends ``argv``, ``env`` and
``cwd`` plus the worker's stdout and stderr descriptors (SCM_RIGHTS); the server
double-forks, so the worker is re-parented to the agent (a child subreaper,
``PR_SET_CHILD_SUBREAPER``) and the agent waits on it like on any child: exit codes,
signals, pidfds and ``killpg`` work as for torchrun's Popen. The server and, once
re-parented, every worker die with the agent (``leto.lifetime``).

The worker then runs the script with ``runpy`` as ``__main__``: torchrun's
``python -u script args`` and ``python -u -m module args`` command lines are served;
anything else is started the normal way by the caller.

    python -m leto.forkserver SOCKET_FD AGENT_PID
"""

from __future__ import annotations

import io
import json
import logging
import os
import runpy
import socket
import sys
import time
from typing import Any

from leto.lifetime import die_with_agent

logger = logging.getLogger(__name__)

MAX_MSG = 1 << 20
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.nn",
    "torch.nn.functional",
    "torch.optim",
    # Not torch._dynamo: with it loaded, a served DDP script on gloo deadlocks at exit often
    # enough to matter (the last gloo work, holding the backward's stashed Python context, is
    # freed on a gloo thread that needs the GIL while the main thread joins it in
    # ~ProcessGroupGloo). A script that compiles, or sets deterministic algorithms, pays for
    # that import itself.
    # what a leto trainer imports next (a shadow forked from here starts with them loaded);
    # imports only: no autograd, no CUDA, no threads before the fork
    "leto",
    "leto.trainer.context",
    "leto.trainer.state",
)


def served_argv(argv: list[str]) -> bool:
    """Whether ``argv`` is a Python command line the server can run (``[-u] script|-m mod ...``)."""
    rest = argv[1:]
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    if not rest:
        return False
    if rest[0] == "-m":
        return len(rest) >= 2
    return not rest[0].startswith("-")


def _run_worker(argv: list[str], env: dict[str, str], cwd: str, out_fd: int, err_fd: int) -> None:
    """In the forked worker: become the script. Never returns."""
    code = 1
    try:
        os.setsid()  # a session of its own, as Popen(start_new_session=True): killpg works
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the server's socket, pipes, the fds sent
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)  # noqa: SIM115
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True)  # noqa: SIM115
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        rest = argv[1:]
        if rest[:1] == ["-u"]:
            rest = rest[1:]
        try:
            if rest[0] == "-m":
                sys.argv = [rest[1], *rest[2:]]
                sys.path[0] = cwd
                runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = list(rest)
                sys.path[0] = os.path.dirname(os.path.abspath(rest[0]))
                runpy.run_path(rest[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - as the interpreter does: sys.excepthook, exit 1
            sys.excepthook(*sys.exc_info())  # the script's hooks see it (leto's fatal report)
            code = 1
        import atexit
        import threading

        for thread in threading.enumerate():  # the interpreter joins non-daemon threads at exit
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _spawn(request: dict[str, Any], fds: list[int], agent: int) -> int:
    """Double-fork a worker; returns its pid once it has been re-parented to the agent."""
    read_end, write_end = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        os.close(read_end)
        intermediate = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(write_end)
            while os.getppid() == intermediate:  # until re-parented (it exits at once)
                time.sleep(0.0005)
            die_with_agent(parent=agent)  # the death signal of its parent from now on
            _run_worker(request["argv"], request["env"], request["cwd"], fds[0], fds[1])
        os.write(write_end, str(pid).encode())
        os._exit(0)
    os.close(write_end)
    for fd in fds:
        os.close(fd)
    with os.fdopen(read_end, "rb") as f:
        pid = int(f.read() or b"-1")
    os.waitpid(intermediate, 0)  # after this the worker's parent is the agent
    return pid


def serve(conn: socket.socket, agent: int) -> None:
    """Answer the agent's spawn requests on ``conn`` until it closes; ``agent``: its pid."""
    for name in WARM_MODULES:
        __import__(name)
    print("ready", flush=True)
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(conn, MAX_MSG, 2)
        except OSError:
            return
        if not msg:
            return
        try:
            reply = {"pid": _spawn(json.loads(msg), fds, agent)}
        except Exception as e:  # noqa: BLE001 - reported to the agent, which falls back to Popen
            reply = {"error": f"{type(e).__name__}: {e}"}
        conn.send(json.dumps(reply).encode())


if __name__ == "__main__":
    agent_pid = int(sys.argv[2])
    die_with_agent(parent=agent_pid)
    serve(socket.socket(fileno=int(sys.argv[1])), agent_pid)
