"""A pre-warmed fork server: workers start without paying for ``import torch``.

Started by ``leto-run`` (:class:`ForkServer`, the agent's handle on it) once its arguments
are checked and before it imports torch itself or creates any thread, CUDA context or
process group, the server imports torch (and torch.distributed, torch.nn) and waits on its
end of a socket pair (inherited: nothing on disk). For each worker the agent sends ``argv``, ``env`` and
``cwd`` plus the worker's stdout and stderr descriptors (SCM_RIGHTS); the server
double-forks, so the worker is re-parented to the agent (a child subreaper,
``PR_SET_CHILD_SUBREAPER``) and the agent waits on it like on any child: exit codes,
signals, pidfds and ``killpg`` work as for torchrun's Popen. The server and, once
re-parented, every worker die with the agent (``leto.lifetime``).

Once ready, the server forks a second one, the *compiler server*, which also imports
``torch._dynamo`` (2.4 s of CPU here, ~5 s on a GPU host; torch's ``Optimizer`` imports it
on its first call, so every trainer pays it). A request marked ``compiler`` (a Leto trainer:
a shadow, or a group restart of a job whose trainers joined Leto) is forked from there once
it is ready, and from this server until then. Other workers never are: a served
``DistributedDataParallel`` script on gloo whose process had ``torch._dynamo`` loaded
before it started hangs at exit often enough to matter (its last gloo work, which holds the
backward's stashed Python context, is freed on a gloo thread that waits for the GIL while
the main thread, holding it, joins that thread in ``~ProcessGroupGloo``), and a Leto
trainer never wraps its model in DDP (``ctx.retain`` refuses it).

The worker then runs the script with ``runpy`` as ``__main__``: torchrun's
``python -u script args`` and ``python -u -m module args`` command lines are served;
anything else is started the normal way by the caller.

A worker rewrites the server's command line in its memory with its own (what ``ps`` and
``pgrep -f`` show, as for a worker torchrun starts): the agent starts the server with a
last argument of ``TITLE_ROOM`` spaces to make room for it.

    python -m leto.forkserver SOCKET_FD AGENT_PID [SPACES]
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import logging
import os
import runpy
import select
import socket
import subprocess
import sys
import time
from typing import Any

from leto.errors import ProtocolError
from leto.lifetime import die_with_agent

logger = logging.getLogger(__name__)

MAX_MSG = 1 << 20
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.nn",
    "torch.nn.functional",
    "torch.optim",
    # what a leto trainer imports next (a shadow forked from here starts with them loaded);
    # imports only: no autograd, no CUDA, no threads before the fork
    "leto",
    "leto.trainer.context",
    "leto.trainer.state",
)
_PR_SET_CHILD_SUBREAPER = 36
TITLE_ROOM = 4096
"""Bytes of command line a worker can show (a longer one is cut there)."""
COMPILER_MODULES = ("torch._dynamo", "torch._inductor.config")
"""What the compiler server imports on top of ``WARM_MODULES``."""


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


def show_command_line(argv: list[str]) -> None:
    """Make this process's ``/proc/self/cmdline`` read ``argv`` (cut to the room the
    process's own command line took): its bytes are overwritten in place, where the kernel
    reads them. Python keeps its own copy of its arguments, so nothing else reads these.
    Where ``/proc`` does not say where they are, the command line is left as it was."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5): 48, 49)
    except (OSError, ValueError, IndexError):
        return
    if end <= start:
        return
    title = b"\0".join(a.encode(errors="replace") for a in argv)[: end - start - 1]
    ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)


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
        sys.orig_argv = list(argv)
        show_command_line(argv)
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

        # The interpreter's exit, in its order: threading's exit callbacks (a
        # concurrent.futures pool's, which end its idle workers: Inductor compiles on one),
        # then the join of non-daemon threads, then atexit.
        threading._shutdown()  # type: ignore[attr-defined]
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


class ForkServer:
    """The agent's handle on its fork server process (started before the agent imports torch
    or starts a thread)."""

    def __init__(self) -> None:
        # Workers forked by the server are re-parented to us: we wait on them as on children.
        # Set before the server is forked: the kernel looks for a subreaper above an orphan
        # only if one existed when its ancestors were forked.
        if ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise ProtocolError(
                "prctl(PR_SET_CHILD_SUBREAPER) failed: no fork server here; start workers "
                "cold with --no-warm-restarts"
            )
        # A socket pair, not a path: nothing on disk, and no other process can connect.
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "leto.forkserver",
                    str(theirs.fileno()),
                    str(os.getpid()),
                    " " * TITLE_ROOM,  # where a worker writes its own command line
                ],
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        self._sock: socket.socket | None = ours
        self._ready = False

    def _connect(self) -> socket.socket:
        if self._sock is None:
            raise ProtocolError("the fork server is closed")
        if not self._ready:
            assert self.proc.stdout is not None
            if self.proc.stdout.readline().strip() != b"ready":  # waits for its imports, once
                raise ProtocolError(
                    f"the fork server exited (code {self.proc.wait()}) before it was ready"
                )
            self._ready = True
        return self._sock

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        stdout_fd: int,
        stderr_fd: int,
        compiler: bool = False,
    ) -> int:
        """Fork a worker running ``argv`` (a served Python command line); returns its pid.
        ``compiler``: a Leto trainer, which may come from the compiler server
        (``leto.forkserver``)."""
        sock = self._connect()
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "compiler": compiler}
        request = json.dumps(request).encode()
        socket.send_fds(sock, [request], [stdout_fd, stderr_fd])
        reply = json.loads(sock.recv(1 << 16))
        if "pid" not in reply:
            raise ProtocolError(f"the fork server could not start a worker: {reply.get('error')}")
        return int(reply["pid"])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class CompilerServer:
    """The server's handle on its compiler server: a child forked once the warm modules are
    loaded, importing ``COMPILER_MODULES`` and then answering the requests handed on to it."""

    def __init__(self, agent: int, agent_conn: socket.socket) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                ours.close()
                agent_conn.close()  # the agent's end of the server stays the server's alone
                die_with_agent(parent=server)  # dies with the server (which dies with the agent)
                show_command_line([*sys.orig_argv[:3], "(compiler server)"])
                for name in COMPILER_MODULES:
                    __import__(name)
                theirs.send(b"ready")
                _answer(theirs, agent)
            except BaseException:  # the server serves alone then
                logger.exception("the compiler server failed")
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        self.pid = pid
        self._sock: socket.socket | None = ours
        self._ready = False

    def ready(self) -> bool:
        """Whether it has imported its modules (never waits); False once it has failed."""
        if self._ready or self._sock is None:
            return self._ready
        if select.select([self._sock], [], [], 0)[0]:
            if self._sock.recv(16) == b"ready":
                self._ready = True
            else:  # it exited before it was ready
                self.close()
        return self._ready

    def spawn(self, msg: bytes, fds: list[int]) -> dict[str, Any] | None:
        """Hand a request on; its reply, or None if the compiler server is gone."""
        assert self._sock is not None
        try:
            socket.send_fds(self._sock, [msg], fds)
            reply = self._sock.recv(1 << 16)
        except OSError:
            reply = b""
        if not reply:
            self.close()
            return None
        for fd in fds:
            os.close(fd)
        return json.loads(reply)

    def close(self) -> None:
        self._ready = False
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        with contextlib.suppress(ChildProcessError):  # reaped if it has exited
            os.waitpid(self.pid, os.WNOHANG)


def _answer(conn: socket.socket, agent: int, compiler: CompilerServer | None = None) -> None:
    """Answer spawn requests on ``conn`` until it closes; those marked ``compiler`` go to
    ``compiler`` while it is ready."""
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(conn, MAX_MSG, 2)
        except OSError:
            return
        if not msg:
            return
        reply = None
        try:
            request = json.loads(msg)
            if request.get("compiler") and compiler is not None and compiler.ready():
                reply = compiler.spawn(msg, fds)
            if reply is None:
                reply = {"pid": _spawn(request, fds, agent)}
        except Exception as e:  # noqa: BLE001 - reported to the agent, which falls back to Popen
            reply = {"error": f"{type(e).__name__}: {e}"}
        conn.send(json.dumps(reply).encode())


def serve(conn: socket.socket, agent: int) -> None:
    """Answer the agent's spawn requests on ``conn`` until it closes; ``agent``: its pid."""
    for name in WARM_MODULES:
        __import__(name)
    compiler = CompilerServer(agent, conn)
    print("ready", flush=True)
    _answer(conn, agent, compiler)


if __name__ == "__main__":
    agent_pid = int(sys.argv[2])
    die_with_agent(parent=agent_pid)
    serve(socket.socket(fileno=int(sys.argv[1])), agent_pid)
