"""The optimizer's own ``step()`` as the RMU's chunk update, for optimizers Leto has no AdamW for.

A chunk of the ``torch`` rule holds whole parameters (``plan.plan_chunks``). Its update runs
the optimizer's class ``step`` (without the hook wrapper) on a view of the optimizer whose
parameter groups hold only the chunk's parameters, with the learning rates the marker
recorded: torch's update of a parameter reads only that parameter, its gradient and its
state (the retain-time probe checked that stepping parameters separately gives the same
bytes), so the chunks together give exactly ``optimizer.step()``.

The parameters stepped are views of the retained state region with their retained
gradients, keyed in a state mapping of the updater's own: the update reads and writes
retained memory only, whatever the trainer's tensors are. State torch creates lazily in a
parameter's first step is moved into its slots before the chunk's parity update (the undo
copy taken before the step holds the slots and the ``PRESENT`` byte as they were), and the
live optimizer's ``state`` is pointed at the same slots.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from leto.retained.layout import Layout
from leto.retained.optim_state import StateSlots, subgroups, unhooked_step, view_of


class TorchStep:
    """Runs ``optimizer``'s step over a subset of its parameters, in retained memory."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        layout: Layout,
        state: torch.Tensor,
        grads: Mapping[str, torch.Tensor],
    ) -> None:
        self.optimizer = optimizer
        self.live = [p for g in optimizer.param_groups for p in g["params"]]
        self.params: list[torch.nn.Parameter] = []
        for live, pslot, gslot, name in zip(
            self.live, layout.params, layout.grads, layout.grad_region, strict=True
        ):
            p = torch.nn.Parameter(pslot.view(state), requires_grad=live.requires_grad)
            p.grad = gslot.view(grads[name])
            self.params.append(p)
        self.state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        self.slots = StateSlots(self.state, self.params, layout.optim, state)
        self.group_of = [gi for gi, g in enumerate(optimizer.param_groups) for _ in g["params"]]
        self._step = unhooked_step(optimizer)

    def begin(self) -> list[int]:
        """Before a step's first chunk (and after any restore): read the PRESENT bytes."""
        return self.slots.read_flags()

    def apply(
        self, indices: Sequence[int], lrs: Sequence[float], skipped: frozenset[int] = frozenset()
    ) -> None:
        """The optimizer's step over parameters ``indices``, at the recorded ``lrs``; the
        ``skipped`` ones are left out, as torch leaves out a parameter whose ``.grad`` is None."""
        indices = [i for i in indices if i not in skipped]
        if not indices:
            return
        self.slots.bind(indices)
        members: dict[int, list[torch.Tensor]] = {}
        for i in indices:
            members.setdefault(self.group_of[i], []).append(self.params[i])
        self._step(view_of(self.optimizer, subgroups(self.optimizer, members, lrs), self.state))
        for i in self.slots.adopt(indices):  # the live optimizer shows the retained state too
            self.optimizer.state[self.live[i]] = dict(self.slots.views[i])
