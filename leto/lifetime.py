"""A job's processes die with their agent, and a job leaves nothing on disk behind.

Every process the agent starts (trainers, shadows, the state manager, the fork server)
asks the kernel for a signal when its parent dies (``PR_SET_PDEATHSIG``), then checks that
its parent is still the agent: if the agent died before the request, the process has
already been re-parented — to init, or to a child subreaper above the agent (systemd, a
container's init, a scheduler's shim), so the test is "is my parent the agent", never
"is my parent 1". The agent's pid comes through the environment (``LETO_AGENT_PID``, set
by ``leto_run.launch`` in its own environment, so every child inherits it).

What a SIGKILLed agent cannot remove: its state manager's socket directory, should the
state manager die without its cleanup (killed with the agent). The next job on the node
sweeps such directories (``sweep_leftovers``): the agent's other files are memfds.

No torch here: the state manager and the fork server import this.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import stat
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_AGENT_PID = "LETO_AGENT_PID"
_PR_SET_PDEATHSIG = 1
_PARENT_AT_IMPORT = os.getppid()
_STATE_MANAGER_DIRS = "leto-sm-*"
_STARTING_S = 60.0
"""A socket directory this young without a socket may belong to a state manager still
starting: left alone."""


def agent_pid() -> int:
    """The agent this process belongs to: ``LETO_AGENT_PID``, else the parent it had when
    leto was first imported."""
    value = os.environ.get(ENV_AGENT_PID, "")
    return int(value) if value.isdigit() else _PARENT_AT_IMPORT


def die_with_agent(sig: signal.Signals = signal.SIGKILL, parent: int | None = None) -> None:
    """Get ``sig`` when the parent dies; exit now if ``parent`` (default: :func:`agent_pid`)
    is no longer among this process's ancestors — it died before the request.

    Ancestors, not the parent alone: a ``--no-python`` entrypoint may be a shell that runs
    the trainer as its child."""
    expected = agent_pid() if parent is None else parent
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if expected not in _ancestors():
        os._exit(1)


def _ancestors(limit: int = 64) -> list[int]:
    """This process's parent, its parent's parent, ... up to init (from /proc)."""
    out = [os.getppid()]
    while out[-1] > 1 and len(out) < limit:
        try:
            with open(f"/proc/{out[-1]}/stat") as f:
                out.append(int(f.read().rsplit(")", 1)[1].split()[1]))
        except (OSError, IndexError, ValueError):
            break
    return out


def sweep_leftovers(tmpdir: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove this user's state-manager socket directories whose server is gone (no one
    listens on their socket); returns what was removed."""
    root = Path(tmpdir or tempfile.gettempdir())
    removed = []
    for d in root.glob(_STATE_MANAGER_DIRS):
        try:
            st = d.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        if _abandoned(d, st.st_mtime):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(str(d))
    if removed:
        logger.info("removed %d socket directories of dead state managers", len(removed))
    return removed


def _abandoned(d: Path, mtime: float) -> bool:
    try:
        sockets = [p for p in d.iterdir() if p.is_socket()]
    except OSError:
        return False
    if not sockets:
        return time.time() - mtime > _STARTING_S
    return all(_refused(p) for p in sockets)


def _refused(path: Path) -> bool:
    """Nobody listens on ``path`` (a live server accepts; a full backlog times out)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(1.0)
    try:
        sock.connect(str(path))
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    finally:
        sock.close()
    return False
