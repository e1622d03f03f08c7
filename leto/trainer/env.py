"""What a trainer is told through its environment (``leto-run`` sets it for every trainer)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from leto import contract
from leto.contract import ROLE_SHADOW
from leto.errors import LetoError, ProtocolError
from leto.trainer.timing import (
    phase_times_enabled,
    profile_after,
    profile_dir,
    sync_debug_enabled,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerEnv(contract.GenerationEnv):
    """What a trainer is told through its environment: its agent's
    :class:`~leto.contract.GenerationEnv` plus torch's own variables."""

    rank: int
    local_rank: int
    world_size: int
    restart_count: int
    master_addr: str
    master_port: int
    phase_times: bool = False
    """``LETO_PHASE_TIMES=1`` (or ``host``): each step's phases in ``step_done``
    (``leto.trainer.timing``)."""
    profile_dir: str | None = None
    """``LETO_PROFILE_DIR=dir``: the process's first step and a steady one profiled, their
    tables written there (``leto.trainer.timing.StepProfiler``)."""
    profile_after: int = 3
    """``LETO_PROFILE_AFTER=n``: the steady step profiled is the ``n``-th after the first."""
    sync_debug: bool = False
    """``LETO_SYNC_DEBUG=1``: warn at every wait for the device, from the second step to the
    one before the last (``leto.trainer.timing.ENV_SYNC_DEBUG``)."""

    @property
    def holds_device(self) -> bool:
        """False for an L1 shadow: it must not create a CUDA context before promotion."""
        return self.role != ROLE_SHADOW or self.shadow_level >= 2

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> TrainerEnv:
        env = os.environ if env is None else env
        if contract.ENV_POOL_SOCKET not in env:
            raise LetoError(
                f"leto.init() must run under leto-run ({contract.ENV_POOL_SOCKET} is not set)"
            )
        try:
            torch_env = {
                "rank": int(env["RANK"]),
                "local_rank": int(env["LOCAL_RANK"]),
                "world_size": int(env["WORLD_SIZE"]),
                "restart_count": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                "master_addr": env["MASTER_ADDR"],
                "master_port": int(env["MASTER_PORT"]),
            }
        except KeyError as e:
            raise ProtocolError(f"leto-run did not set {e.args[0]} for this trainer") from None
        return cls(
            **contract.GenerationEnv.fields_from_environ(env),
            **torch_env,  # type: ignore[arg-type]
            phase_times=phase_times_enabled(),
            profile_dir=profile_dir(),
            profile_after=profile_after(),
            sync_debug=sync_debug_enabled(),
        )
