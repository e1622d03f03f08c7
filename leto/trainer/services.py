"""What a trainer's retained state uses of the job, passed in as one value.

``Context.retain`` builds a ``TrainerServices`` from itself and hands it to
``RetainedState``: the state reaches the job only through these fields, so it holds no
reference to its context, does not import ``context.py`` (which imports it), and a test can
build one from real parts without a context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from leto.events import EventLog
    from leto.faults import FaultInjector
    from leto.pool.client import PoolClient
    from leto.preinit.guard import OomGuard
    from leto.preinit.site import ShadowSite
    from leto.trainer.env import TrainerEnv
    from leto.trainer.grad_sync import GradSync


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerServices:
    """A trainer's facts and services, and the hooks its retained state calls."""

    rank: int
    world_size: int
    env: TrainerEnv
    device: torch.device
    """Where this rank computes (a model built on ``meta`` is placed here)."""
    collective_device: torch.device
    """Where collective inputs must live (the GPU under NCCL)."""
    store: dist.Store
    events: EventLog
    pool: PoolClient
    injector: FaultInjector
    preinit: OomGuard
    """This trainer's side of the pre-initialisation controller (reports, reclaims)."""
    grad_sync: Callable[[], GradSync]
    """The context's gradient sync as it is now: an integration sets it after ``retain``
    too (Megatron's DDP and distributed optimizer), so it is read at each use."""
    shadow_site: Callable[[], ShadowSite]
    """The facts a shadow's warm-ups read (``leto.preinit.site``)."""
    ready_to_map_ahead: Callable[[], bool]
    """Whether a shadow may map the retained regions before its promotion."""
    committed: Callable[[Any], None]
    """After each committed step (its argument: the ``RetainedState``)."""
    finished: Callable[[], None]
    """After the last step."""
