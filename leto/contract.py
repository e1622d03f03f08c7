"""The agent↔trainer contract in the job's store: one place for every key.

The agent (``leto_run``) and its trainers (``leto.trainer``) meet in the per-attempt worker
TCPStore. Every key lives under :func:`store_prefix`, which carries the job's secret
token: the store is a TCP port any local user can reach, so a process outside the job
that does not know the token cannot forge a promotion (two writers on retained state) or
a recovery record. The token travels only in the environment of the job's processes
(``/proc/<pid>/environ`` is readable by their owner alone).

Single node: each agent makes its own token. Multi-node: every node's agent must use the
same one; set ``LETO_JOB_SECRET`` to the same value on every node (e.g. from the
scheduler's job id plus a random part), otherwise the leader agent publishes one through
the rendezvous store, which keeps out anyone who does not know leto's key names only.
"""

from __future__ import annotations

import os
import secrets

ENV_JOB_TOKEN = "LETO_JOB_TOKEN"
"""The job's token, as the agent hands it to its trainers."""
ENV_JOB_SECRET = "LETO_JOB_SECRET"
"""A token the user sets on every node (multi-node jobs); wins over a generated one."""
RDZV_TOKEN_KEY = "leto/job_token"
"""Where the leader agent publishes a generated token for a multi-node job."""


def new_token() -> str:
    """The user's ``LETO_JOB_SECRET`` if set, else 128 random bits."""
    return os.environ.get(ENV_JOB_SECRET) or secrets.token_hex(16)


def store_prefix(restart_count: int, token: str) -> str:
    """The key space the agent and its trainers share for one group attempt."""
    return f"/leto/{token}/attempt_{restart_count}/"


def promote(generation: int, rank: int) -> str:
    """Set by the rank's agent once the previous generation is stopped: the shadow goes."""
    return f"promote/{generation}/{rank}"


def registered(generation: int, rank: int) -> str:
    """Set by an active trainer from ``leto.init()`` (the job uses leto: shadows follow)."""
    return f"registered/{generation}/{rank}"


def stepped(generation: int, rank: int) -> str:
    """Set by a trainer after its generation's first committed step."""
    return f"stepped/{generation}/{rank}"


def shadows(generation: int, node: int) -> str:
    """Set by a node's agent while it has a live shadow generation ``generation``."""
    return f"shadows/{generation}/{node}"


def fatal(rank: int) -> str:
    """Set by a trainer whose hardware or retained state is unusable (a fatal failure)."""
    return f"fatal/{rank}"


def fault_claim(fault: int) -> str:
    """Claimed (``add``) by the trainer that fires injected fault ``fault``, job-wide."""
    return f"/leto/faults/{fault}"


def device_fault(rank: int) -> str:
    """Test hook: rank's device was broken by an injected ``kind: device`` fault."""
    return f"/leto/device_fault/{rank}"
