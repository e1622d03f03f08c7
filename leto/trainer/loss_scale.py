"""fp16 training's dynamic loss scale (``torch.amp.GradScaler``) inside Leto's step.

A torch loop calls ``scaler.scale(loss).backward()``, then ``scaler.step(optimizer)`` (which
unscales the gradients and skips the optimizer's step when one of them is inf or NaN) and
``scaler.update()`` (which backs the scale off after such a step, or grows it). With Leto
the script keeps the first call, inside ``state.compute``, and hands the scaler to
``ctx.retain(..., scaler=scaler)``; ``state.step()`` does the rest at the points where a
crash-consistent step needs them:

* unscale after the gradients' all-reduce, so every rank finds the same inf (a rank's own
  gradients before it could differ) and clipping sees unscaled gradients;
* on inf or NaN, skip the update of every parameter (``leto.retained.presence``: the
  retained presence words all 0, so a finishing update skips it too): no parameter,
  moment or step count changes, as ``scaler.step`` skips ``optimizer.step()``;
* update the scale before the commit: the scaler is retained with the step's records
  (``leto.trainer.extras``), so a trainer resumed after the commit finds the scale the
  update left, one resumed before it the scale the step began with.

Reading whether a gradient was inf waits for the device once per step, as torch's own
``scaler.step`` does for an optimizer without a fused kernel.
"""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState

from leto.errors import ConfigError


class LossScale:
    """The retained optimizer's ``GradScaler``, driven by ``RetainedState.step``."""

    NAME = "grad_scaler"
    """Its name among the step's retained objects (``ctx.retain(stateful=...)``)."""

    def __init__(self, scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(scaler, torch.amp.GradScaler):
            raise ConfigError(
                f"ctx.retain(scaler=...) takes a torch.amp.GradScaler, got {type(scaler).__name__}"
            )
        self.scaler, self.optimizer = scaler, optimizer

    def unscale(self) -> bool:
        """Unscale the (all-reduced) gradients in place; whether one was inf or NaN."""
        if not self.scaler.is_enabled():
            return False
        opt_state = self.scaler._per_optimizer_states[id(self.optimizer)]
        if opt_state["stage"] is not OptState.READY:
            raise ConfigError(
                "the script called scaler.unscale_() itself; state.step() unscales the "
                "gradients after their all-reduce: remove the call, and clip with "
                "state.step(max_grad_norm=...)"
            )
        self.scaler.unscale_(self.optimizer)
        return any(bool(v.item()) for v in opt_state["found_inf_per_device"].values())

    def update(self) -> None:
        """The scale for the next step (backed off after an inf, grown after enough steps)."""
        if self.scaler.is_enabled():
            self.scaler.update()
