"""The agent↔trainer contract: the environment of a generation and every store key.

:class:`GenerationEnv` is what an agent tells one generation of trainers through their
environment, beyond torch's own variables: the agent writes it with ``to_environ`` and
each trainer reads it back with ``from_environ``, so a variable is spelled once.

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

import dataclasses
import json
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from leto.erasure.config import ErasureConfig
from leto.errors import ProtocolError
from leto.preinit.config import PreinitConfig

Role = Literal["active", "shadow"]
ROLE_ACTIVE: Role = "active"
"""A trainer that trains (generation g)."""
ROLE_SHADOW: Role = "shadow"
"""A trainer that pre-initialises and waits to be promoted (generation g+1)."""

ENV_POOL_SOCKET = "LETO_POOL_SOCKET"
"""The node's state manager socket (set by the agent for every trainer)."""
ENV_CHECKPOINT = "LETO_CHECKPOINT"
"""JSON of ``leto.config.CheckpointConfig``, or empty (no checkpoint configured)."""
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


def worker_store_port(restart_count: int) -> str:
    """In the rendezvous store: the port of group attempt ``restart_count``'s worker store,
    published by the leader agent that hosts it."""
    return f"leto/worker_store/{restart_count}"


def epoch(generation: int) -> str:
    """The one recovery record of the move out of generation ``generation - 1``
    (``leto.epoch``)."""
    return f"epoch/{generation}"


def pg_prefix(generation: int, launch: int) -> str:
    """Where one launch of a generation builds its process group: a relaunched shadow
    generation (after a reclaim) must not meet the keys of the launch it replaces."""
    return f"gen{generation}{f'.{launch}' if launch else ''}/pg/"


def promote(generation: int, rank: int) -> str:
    """Set by the rank's agent once the previous generation is stopped: the shadow goes."""
    return f"promote/{generation}/{rank}"


def registered(generation: int, rank: int) -> str:
    """Set by an active trainer from ``leto.init()`` (the job uses leto: shadows follow)."""
    return f"registered/{generation}/{rank}"


def retained(rank: int) -> str:
    """Set by a trainer once its rank's state is retained (initialised or reattached) in this
    attempt: before every rank has it, a killed trainer leaves nothing to recover in place."""
    return f"retained/{rank}"


def stepped(generation: int, rank: int) -> str:
    """Set by a trainer after its generation's first committed step."""
    return f"stepped/{generation}/{rank}"


def shadows(generation: int, node: int) -> str:
    """Set by a node's agent while it has a live shadow generation ``generation``."""
    return f"shadows/{generation}/{node}"


def forward_spec(rank: int) -> str:
    """Set by an active trainer at its first forward: the shapes its shadow replays
    (``leto.preinit.replay``)."""
    return f"forward_spec/{rank}"


def fatal(rank: int) -> str:
    """Set by a trainer whose hardware or retained state is unusable (a fatal failure)."""
    return f"fatal/{rank}"


def config_error(rank: int) -> str:
    """Set by a trainer that stopped on a ``ConfigError`` (the job's settings cannot run):
    the message, which the agent prints as the job's one-line error instead of restarting."""
    return f"config_error/{rank}"


def fault_claim(fault: int) -> str:
    """Claimed (``add``) by the trainer that fires injected fault ``fault``, job-wide."""
    return f"/leto/faults/{fault}"


def device_fault(rank: int) -> str:
    """Test hook: rank's device was broken by an injected ``kind: device`` fault."""
    return f"/leto/device_fault/{rank}"


_TRISTATE = {None: "auto", True: "1", False: "0"}
ENV_DETERMINISTIC = "LETO_DETERMINISTIC"
"""``1`` under ``leto-run --deterministic`` (``leto.kernels``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationEnv:
    """The settings an agent hands one generation of trainers (``LETO_*`` variables)."""

    role: Role
    generation: int
    pool_socket: str
    """The node's state manager."""
    shadow_level: int = 3
    shadow_launch: int = 0
    """How many times this shadow generation was launched before (relaunches after a reclaim)."""
    consistency: str = "rmu"
    rmu_chunk_bytes: int = 0
    """0 until the trainer's context resolves it for its device (``leto.config.default_rmu_chunk_bytes``)."""
    rmu_fused: bool | None = None
    lend_activations: bool | None = None
    """``leto.lend_activation_memory`` (None: on with rmu on a CUDA device)."""
    digest: bool = False
    deterministic: bool = False
    """``leto-run --deterministic``: deterministic kernels in every trainer (``leto.kernels``)."""
    erasure: ErasureConfig | None = None
    preinit: PreinitConfig = dataclasses.field(default_factory=PreinitConfig)
    job_token: str = ""
    """The job's secret: every store key lives under it (:func:`store_prefix`)."""

    def to_environ(self) -> dict[str, str]:
        return {
            "LETO_ROLE": self.role,
            "LETO_GENERATION": str(self.generation),
            ENV_POOL_SOCKET: self.pool_socket,
            "LETO_SHADOW_LEVEL": str(self.shadow_level),
            "LETO_SHADOW_LAUNCH": str(self.shadow_launch),
            "LETO_CONSISTENCY": self.consistency,
            "LETO_RMU_CHUNK_BYTES": str(self.rmu_chunk_bytes),
            "LETO_RMU_FUSED": _TRISTATE[self.rmu_fused],
            "LETO_LEND_ACTIVATIONS": _TRISTATE[self.lend_activations],
            "LETO_DIGEST": "1" if self.digest else "0",
            ENV_DETERMINISTIC: "1" if self.deterministic else "0",
            "LETO_ERASURE": json.dumps(dataclasses.asdict(self.erasure)) if self.erasure else "",
            "LETO_PREINIT": json.dumps(dataclasses.asdict(self.preinit)),
            ENV_JOB_TOKEN: self.job_token,
        }

    @staticmethod
    def fields_from_environ(env: Mapping[str, str]) -> dict[str, object]:
        """The fields as keyword arguments (a subclass adds its own); raises
        ``ProtocolError`` naming a variable the agent should have set."""
        tristate = {v: k for k, v in _TRISTATE.items()}
        try:
            return {
                "role": env["LETO_ROLE"],
                "generation": int(env["LETO_GENERATION"]),
                "pool_socket": env[ENV_POOL_SOCKET],
                "shadow_level": int(env.get("LETO_SHADOW_LEVEL", "3")),
                "shadow_launch": int(env.get("LETO_SHADOW_LAUNCH", "0")),
                "consistency": env.get("LETO_CONSISTENCY", "rmu"),
                "rmu_chunk_bytes": int(env.get("LETO_RMU_CHUNK_BYTES", "0")),
                "rmu_fused": tristate[env.get("LETO_RMU_FUSED", "auto")],
                "lend_activations": tristate[env.get("LETO_LEND_ACTIVATIONS", "auto")],
                "digest": env.get("LETO_DIGEST", "0") == "1",
                "deterministic": env.get(ENV_DETERMINISTIC, "0") == "1",
                "erasure": ErasureConfig(**json.loads(env["LETO_ERASURE"]))
                if env.get("LETO_ERASURE")
                else None,
                "preinit": PreinitConfig(**json.loads(env["LETO_PREINIT"]))
                if env.get("LETO_PREINIT")
                else PreinitConfig(),
                "job_token": env[ENV_JOB_TOKEN],
            }
        except KeyError as e:
            raise ProtocolError(f"leto-run did not set {e.args[0]} for this trainer") from None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> GenerationEnv:
        return cls(**cls.fields_from_environ(env))  # type: ignore[arg-type]
