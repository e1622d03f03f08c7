"""What a shadow's warm-ups read of their trainer, as one value.

The warm-ups (``warmup.warm_shadow``, ``model_warmup.warm_model`` / ``warm_forward``, the
replay's ``skip_reason`` / ``wait_for_spec``) run inside a trainer but need only a few of
its facts; ``leto.Context.shadow_site()`` hands them over, so this package never depends
on the trainer and a test builds a site without one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from leto.contract import GenerationEnv
    from leto.events import EventLog
    from leto.health import Heartbeat


@dataclass(frozen=True, slots=True, kw_only=True)
class ShadowSite:
    """One trainer's facts for its warm-ups, read when the warm-up starts."""

    rank: int
    device: torch.device
    env: GenerationEnv
    """The generation's settings: its number, shadow level, ``preinit`` and update settings."""
    store: dist.Store
    """The generation's store: the promotion key, the active's published forward shapes."""
    events: EventLog
    heartbeat: Heartbeat | None
    """The rank's heartbeat board slot (the active's memory report); None outside leto-run."""
    is_shadow: bool = True
    """False in an active trainer (or a promoted shadow): the warm-ups do nothing there."""
    forward_collectives: bool = False
    """An integration's gradient sync is set, so the model's forward may run collectives: a
    shadow must not replay it alone."""
