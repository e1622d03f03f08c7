"""The retained optimizer steps only inside Leto's update.

``RetainedState.step()`` applies the optimizer's update crash-consistently; a call of the
script's own (``optimizer.step()`` left over from a torchrun loop, ``scaler.step(optimizer)``
of a ``GradScaler``, a framework's) would update the retained state a second time, outside
any transaction: the run diverges from the same script under torchrun, and a kill inside
that call tears the state with nothing to finish it from. Every such call is refused.

The test is the marker's phase, not a flag: Leto's own calls of the optimizer's hooked step
(``consistency: snapshot``, a finishing recovery) run while the marker records the update
(``UPDATE_PHASES``); a script's run before ``state.step()`` or after it returned, when the
marker is ``IDLE`` or ``GRADS_READY``. The guard is a step pre-hook, which torch runs for
every ``torch.optim.Optimizer``, the user's own classes included; Leto's per-chunk calls of
the unhooked step (``leto.retained.optim_state.unhooked_step``) do not reach it.
"""

from __future__ import annotations

from typing import Any

import torch

from leto.errors import ScriptError
from leto.retained.marker import UPDATE_PHASES, Marker


class OptimizerStepGuard:
    """Refuses ``step()`` of the retained optimizer (and of each part of a
    ``leto.ChainedOptimizer``) outside the update the marker records."""

    def __init__(self, optimizer: torch.optim.Optimizer, marker: Marker) -> None:
        self.marker = marker
        for opt in (optimizer, *getattr(optimizer, "parts", ())):
            opt.register_step_pre_hook(self._check)

    def _check(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.marker.phase in UPDATE_PHASES:
            return
        raise ScriptError(
            f"the script calls {type(optimizer).__name__}.step() itself (directly, or through "
            "GradScaler.step() or a framework); RetainedState.step() runs the optimizer's "
            "update: remove the script's call (a GradScaler goes to ctx.retain(..., "
            "scaler=scaler), and the script keeps only scaler.scale(loss).backward())"
        )
