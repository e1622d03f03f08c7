"""A shadow pre-initialises at the lowest CPU priority, and is raised back when promoted.

A shadow's pre-initialisation (building the model, its process group, the warm-ups) runs
beside the trainers it stands in for. Where CPU cores are scarce (a CPU job, a node with
fewer free cores than processes), that work slows every step of the live trainers, and it
recurs after each recovery, when replacement shadows start. At nice 19 it takes only what
the trainers leave idle. Promotion gives every thread of the process its old priority
back (the shadow itself when its wait ends, and the agent at once, for a shadow promoted
before it was ready): the promoted trainer must not run slower than the one it replaces.

Where the kernel schedules by autogroups (``kernel.sched_autogroup_enabled``, the default of
many distributions), a thread's nice value only ranks it within its session's autogroup,
and every worker leads a session of its own (``setsid``, as torchrun's workers do): between
the trainers' and the shadow's sessions the autogroups' own nice values decide, so the
shadow's autogroup is lowered too (``/proc/self/autogroup``, to ``SHADOW_AUTOGROUP_NICE``),
and raised with the threads.

Lowering is easy; raising back needs ``CAP_SYS_NICE`` or an ``RLIMIT_NICE`` that allows
the old value. A shadow that could not be raised back is never lowered.
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

LOWEST = 19
CAP_SYS_NICE = 23
AUTOGROUPS = Path("/proc/sys/kernel/sched_autogroup_enabled")
DEFAULT_AUTOGROUP_NICE = 0
"""The nice value of the autogroup that ``setsid`` creates."""
SHADOW_AUTOGROUP_NICE = 10
"""A shadow's autogroup: weight 110 against a trainer's 1024, about a tenth of a core the
trainers want. Not 19 (weight 15): a CPU job's trainers keep the cores nearly busy, and at
1.5 % of a core its shadows were not ready after minutes; at 10 they are ready a few times
later than unlowered ones, and the trainers lose a tenth of a core meanwhile, not half."""


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
        self.original_autogroup: int | None = None
        """Its session's autogroup nice value before ``lower``; None where it was not lowered."""

    def lower(self) -> bool:
        """Every thread of the process (and so every thread started later) to nice 19, and
        the autogroup of the session it leads, if it can be raised back."""
        original = os.getpriority(os.PRIO_PROCESS, 0)
        if original >= LOWEST or not can_raise_to(original):
            return False
        _set_every_thread(LOWEST)
        self.original = original
        group = own_autogroup_nice()
        if group is not None and group < SHADOW_AUTOGROUP_NICE and can_raise_to(group):
            _set_autogroup(SHADOW_AUTOGROUP_NICE)
            self.original_autogroup = group
        return True

    def restore(self) -> None:
        """Every thread of the process back to the nice value it had before ``lower``, and
        its autogroup."""
        if self.original_autogroup is not None:
            _set_autogroup(self.original_autogroup)
            self.original_autogroup = None
        if self.original is not None:
            _set_every_thread(self.original)
            self.original = None


def own_autogroup_nice(pid: int | str = "self") -> int | None:
    """The nice value of the autogroup of the session that process ``pid`` leads; None where
    the kernel does not schedule by autogroups or ``pid`` shares its session's group with
    others (it does not lead it: lowering the group would lower them too)."""
    try:
        if AUTOGROUPS.read_text().strip() != "1":
            return None
        number = os.getpid() if pid == "self" else int(pid)
        if os.getsid(number) != number:
            return None
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _set_autogroup(nice: int, pid: int | str = "self") -> None:
    Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def _set_every_thread(nice: int, pid: int | str = "self") -> None:
    """Linux keeps a nice value per thread: set each one's."""
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(task), nice)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue


def raise_promoted(pid: int) -> None:
    """Every thread of the promoted trainer ``pid`` to the caller's own nice value, and the
    autogroup of the session it leads to a new session's default: the agent's call, at
    promotion, for a shadow promoted while still pre-initialising (it raises itself only
    once it reaches its wait). Best effort: a process that is gone, or one the
    caller may not raise (then it was never lowered), is left as it is."""
    try:
        _set_every_thread(os.getpriority(os.PRIO_PROCESS, 0), pid)
        group = own_autogroup_nice(pid)
        if group is not None:  # to the default of a new session's group
            _set_autogroup(min(group, DEFAULT_AUTOGROUP_NICE), pid)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return


def thread_nices() -> list[int]:
    """The nice value of every thread of this process."""
    return [os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")]
