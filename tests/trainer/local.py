"""A real trainer ``Context`` in this process, on a world of one: a real state manager, an
in-memory store, no agent. For tests that drive ``RetainedState`` through its public API
without spawning trainers, and for benches that time it beside a plain loop
(``bench/steady_gpu.py``: no pytest needed)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch.distributed as dist

from leto.contract import ENV_CHECKPOINT
from leto.events import ENV_EVENTS_FILE
from leto.faults import ENV_FAULTS, ENV_FAULTS_FIRED
from leto.health import ENV_HEARTBEAT
from leto.pool.process import StateManagerProcess
from leto.trainer.context import Context
from leto.trainer.env import TrainerEnv

if TYPE_CHECKING:
    import pytest

INHERITED_ENV = (ENV_EVENTS_FILE, ENV_FAULTS, ENV_FAULTS_FIRED, ENV_CHECKPOINT)
"""What a launched job's environment may hold that a world of one must not read."""


@contextlib.contextmanager
def local_context(
    monkeypatch: pytest.MonkeyPatch, heartbeat_file: str = "", **env: object
) -> Iterator[Context]:
    """A rank-0 active's ``Context`` (``env`` overrides ``TrainerEnv`` fields); with
    ``heartbeat_file`` its heartbeat and OOM guard are on that board."""
    for name in INHERITED_ENV:
        monkeypatch.delenv(name, raising=False)
    if heartbeat_file:
        monkeypatch.setenv(ENV_HEARTBEAT, heartbeat_file)
    else:
        monkeypatch.delenv(ENV_HEARTBEAT, raising=False)
    with world_of_one(**env) as ctx:
        yield ctx


@contextlib.contextmanager
def world_of_one(**env: object) -> Iterator[Context]:
    """A rank-0 active's ``Context`` with its own state manager, in the environment as it
    is (``local_context`` clears what a launched job leaves there)."""
    sm = StateManagerProcess.start()
    try:
        store = dist.HashStore()
        ctx = Context(trainer_env(pool_socket=sm.socket_path, **env), store, store)
        try:
            yield ctx
        finally:
            ctx.pool.close()
    finally:
        sm.stop()


def trainer_env(**env: object) -> TrainerEnv:
    """A rank-0 active's ``TrainerEnv`` in a world of one; ``env`` overrides fields."""
    base = TrainerEnv(
        role="active",
        generation=0,
        pool_socket="",
        job_token="test",
        rank=0,
        local_rank=0,
        world_size=1,
        restart_count=0,
        master_addr="127.0.0.1",
        master_port=0,
    )
    return dataclasses.replace(base, **env)
