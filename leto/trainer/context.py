"""``leto.init()``: join the job as an active trainer, or wait pre-initialised as a shadow.

Under ``leto-run`` every local rank has an active trainer and a shadow trainer running the
same script. Both call ``leto.init()``. The active builds its process group and returns at
once. The shadow pre-initialises to its level (L1: imports done; L3: the process group
among the shadows of all ranks is built) and blocks until the agent promotes its whole
generation; it then returns into the script exactly as an active would, and ``retain``
reattaches to the retained state instead of initialising it.

Each generation gets its own ``PrefixStore`` on the agent's store, so a rebuilt process
group never meets the stale keys of the one it replaces.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from leto.errors import LetoError, ProtocolError
from leto.events import EventLog, Kind
from leto.faults import FaultInjector
from leto.pool.client import PoolClient

if TYPE_CHECKING:
    from leto.trainer.state import RetainedState

logger = logging.getLogger(__name__)

ROLE_ACTIVE, ROLE_SHADOW = "active", "shadow"
_WAIT_SLICE = timedelta(seconds=60)


@dataclass(frozen=True, slots=True)
class TrainerEnv:
    """What the agent tells a trainer through its environment."""

    role: Literal["active", "shadow"]
    generation: int
    rank: int
    local_rank: int
    world_size: int
    restart_count: int
    master_addr: str
    master_port: int
    pool_socket: str
    shadow_level: int
    consistency: str
    digest: bool

    @classmethod
    def from_environ(cls) -> TrainerEnv:
        env = os.environ
        if "LETO_POOL_SOCKET" not in env:
            raise LetoError("leto.init() must run under leto-run (LETO_POOL_SOCKET is not set)")
        try:
            return cls(
                role=env["LETO_ROLE"],  # type: ignore[arg-type]
                generation=int(env["LETO_GENERATION"]),
                rank=int(env["RANK"]),
                local_rank=int(env["LOCAL_RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
                pool_socket=env["LETO_POOL_SOCKET"],
                shadow_level=int(env.get("LETO_SHADOW_LEVEL", "3")),
                consistency=env.get("LETO_CONSISTENCY", "snapshot"),
                digest=env.get("LETO_DIGEST", "0") == "1",
            )
        except KeyError as e:
            raise ProtocolError(f"leto-run did not set {e.args[0]} for this trainer") from None


def store_prefix(restart_count: int) -> str:
    """The agent and its trainers share this key space for one group attempt."""
    return f"/leto/attempt_{restart_count}/"


class Context:
    """A trainer's handle on the job: rank, store, pool, events, fault injector."""

    def __init__(self, env: TrainerEnv, store: dist.Store, raw_store: dist.Store) -> None:
        self.env = env
        self.store = store
        self.events = EventLog.from_env(f"trainer{env.rank}")
        self.pool = PoolClient(env.pool_socket)
        self.injector = FaultInjector.from_env(
            env.rank, self.events, claim=lambda i: raw_store.add(f"/leto/faults/{i}", 1) == 1
        )
        self.promoted_at: float | None = None

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def resuming(self) -> bool:
        """True when valid retained state exists for this rank (a promoted trainer)."""
        from leto.trainer.marker import Marker

        region = self.pool.lookup(self.rank, "marker")
        if region is None:
            return False
        try:
            return Marker(torch.frombuffer(region.buffer, dtype=torch.uint8)).is_valid()
        finally:
            del region

    @contextlib.contextmanager
    def init_device(self, device: str | torch.device = "cpu") -> Iterator[torch.device]:
        """Build the model inside this: on ``meta`` (no init cost) when reattaching."""
        target = torch.device("meta") if self.resuming else torch.device(device)
        with target:
            yield target

    def retain(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> RetainedState:
        """Back parameters, gradients and optimizer state by retained pool memory."""
        from leto.trainer.state import RetainedState

        return RetainedState(self, model, optimizer)


def init(backend: str = "gloo", timeout_s: float = 300.0) -> Context:
    """Join the job. In a shadow this blocks until promotion; see the module docstring."""
    env = TrainerEnv.from_environ()
    started = time.time()
    raw = dist.TCPStore(
        env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    base = dist.PrefixStore(store_prefix(env.restart_count), raw)
    ctx = Context(env, base, raw)
    ctx.events.emit(Kind.TRAINER_STARTED, rank=env.rank, gen=env.generation, role=env.role, pid=os.getpid())
    pg_store = dist.PrefixStore(f"gen{env.generation}/pg/", base)

    def build_group() -> None:
        dist.init_process_group(
            backend, store=pg_store, rank=env.rank, world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
        )

    if env.role == ROLE_ACTIVE:
        build_group()
        base.set(f"registered/{env.generation}/{env.rank}", str(os.getpid()))
        return ctx
    if env.role != ROLE_SHADOW:
        raise ProtocolError(f"unknown LETO_ROLE {env.role!r}")
    if env.shadow_level >= 3:
        build_group()
    ctx.events.emit(
        Kind.SHADOW_READY, rank=env.rank, gen=env.generation, level=env.shadow_level,
        init_s=time.time() - started,
    )
    _wait_for_promotion(base, env.generation)
    ctx.promoted_at = time.time()
    if env.shadow_level < 3:
        build_group()
    ctx.events.emit(Kind.PROMOTED, rank=env.rank, gen=env.generation, level=env.shadow_level)
    return ctx


def _wait_for_promotion(store: dist.Store, generation: int) -> None:
    key = f"promote/{generation}"
    while True:
        try:
            store.wait([key], _WAIT_SLICE)
            return
        except dist.DistStoreError as e:
            if "timeout" not in str(e).lower():
                raise ProtocolError(f"lost the agent's store while waiting as a shadow: {e}") from None
