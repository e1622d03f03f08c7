"""Several optimizers over one model, retained as one: Muon for the hidden matrices and
AdamW for the rest, as Muon itself requires (``torch.optim.Muon`` takes 2-D parameters only).

``ctx.retain`` takes one optimizer. :class:`ChainedOptimizer` is one: a
``torch.optim.Optimizer`` whose parameter groups are its parts' (the same group dicts, so
what a part's group holds and what the chained one's holds never differ), whose state is one
dict every part shares, and whose ``step()`` runs each part's own step over that part's
groups. Leto plans it as any optimizer it does not know (``leto.retained.optim_state``: the
probe finds each part's state, the update runs the parts' steps chunk by chunk). Build LR
schedulers on the chained optimizer, not on a part: a scheduler holds one optimizer, and
Leto retains the schedulers of the one it retains (``LambdaLR`` takes one function per group
when the parts want different schedules).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from leto.errors import ConfigError
from leto.retained.optim_state import unhooked_step, view_of

PART = "leto_part"
"""The key in each parameter group that names its part (an index into ``parts``)."""


class ChainedOptimizer(torch.optim.Optimizer):
    """``parts``' parameter groups as one optimizer; ``step()`` steps every part."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer]) -> None:
        parts = list(parts)
        if not parts:
            raise ConfigError("ChainedOptimizer needs at least one optimizer")
        for i, part in enumerate(parts):
            if isinstance(part, ChainedOptimizer):
                raise ConfigError(f"ChainedOptimizer part {i} is a ChainedOptimizer: flatten them")
            for group in part.param_groups:
                group[PART] = i
        groups = [g for part in parts for g in part.param_groups]
        super().__init__(groups, {})  # the same group dicts; refuses a parameter in two parts
        for part in parts:
            self.state.update(part.state)  # state a part holds already (Adagrad's)
        for part in parts:
            part.state = self.state
        self.parts = parts

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Each part's own step over its groups of this optimizer (the groups a chunk of
        Leto's update holds, in a view of it), with this optimizer's state."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, part in enumerate(self.parts):
            groups = [g for g in self.param_groups if g[PART] == i]
            if groups:
                unhooked_step(part)(view_of(part, groups, self.state))
        return loss
