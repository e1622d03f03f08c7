"""A shadow pre-initialises at the lowest CPU priority, and is raised back when promoted.

A shadow's pre-initialisation (building the model, its process group, the warm-ups) runs
beside the trainers it stands in for. Where CPU cores are scarce (a CPU job, a node with
fewer free cores than processes), that work slows every step of the live trainers, and it
recurs after each recovery, when replacement shadows start. At nice 19 it takes only what
the trainers leave idle. Promotion gives every thread of the process its old priority
back (the shadow itself when its wait ends, and the agent at once, for a shadow promoted
before it was ready): the promoted trainer must not run slower than the one it replaces.

Lowering is easy; raising back needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows
the old value. A shadow that could not be raised back is never lowered.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

LOWEST = 19
CAP_SYS_NICE = 23


def _capable_sys_nice() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False


def can_raise_to(nice: int) -> bool:
    """Whether this process may set its threads' nice value back down to ``nice``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or 20 - nice <= soft:
        return True
    try:
        return _capable_sys_nice()
    except OSError:
        return False


class ShadowPriority:
    """The calling process's CPU priority while it is a shadow."""

    def __init__(self) -> None:
        self.original: int | None = None
        """The nice value before ``lower``; None while not lowered."""

    def lower(self) -> bool:
        """Every thread of the process (and so every thread started later) to nice 19, if
        it can be raised back."""
        original = os.getpriority(os.PRIO_PROCESS, 0)
        if original >= LOWEST or not can_raise_to(original):
            return False
        _set_every_thread(LOWEST)
        self.original = original
        return True

    def restore(self) -> None:
        """Every thread of the process back to the nice value it had before ``lower``."""
        if self.original is not None:
            _set_every_thread(self.original)
            self.original = None


def _set_every_thread(nice: int, pid: int | str = "self") -> None:
    """Linux keeps a nice value per thread: set each one's."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(task), nice)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def raise_promoted(pid: int) -> None:
    """Every thread of the promoted trainer ``pid`` to the caller's own nice value: the
    agent's, at promotion, for a shadow promoted while still pre-initialising (it raises
    itself only once it reaches its wait). Best effort: a process that is gone, or one the
    caller may not raise (then it was never lowered), is left as it is."""
    try:
        _set_every_thread(os.getpriority(os.PRIO_PROCESS, 0), pid)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return


def thread_nices() -> list[int]:
    """The nice value of every thread of this process."""
    return [os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")]
