"""What ``RetainedState`` uses of the ``Context`` that builds it.

``leto.trainer.context.Context`` is the one implementation. Typing the state's back
reference by this protocol keeps the state module from importing the context module
that imports it, and names the whole surface between the two in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

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


class TrainerHandle(Protocol):
    """A trainer's facts and services, and the hooks its retained state calls."""

    env: TrainerEnv
    store: dist.Store
    events: EventLog
    pool: PoolClient
    injector: FaultInjector
    preinit: OomGuard
    """This trainer's side of the pre-initialisation controller (reports, reclaims)."""
    grad_sync: GradSync
    """Set by an integration, or by the state itself for FSDP2's shards."""
    device: torch.device
    collective_device: torch.device

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def shadow_site(self) -> ShadowSite:
        """The facts a shadow's warm-ups read (``leto.preinit.site``)."""
        ...

    def ready_to_map_ahead(self, timeout_s: float = 60.0) -> bool:
        """Whether a shadow may map the retained regions before its promotion."""
        ...

    def committed(self, state: Any) -> None:
        """After each committed step (``state``: the ``RetainedState``)."""
        ...

    def finished(self) -> None:
        """After the last step."""
        ...
