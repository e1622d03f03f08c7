"""Leto: in-place recovery of distributed training from retained, protected state.

The trainer API is small::

    ctx = leto.init()                      # a shadow blocks here until promoted
    with ctx.init_device():                # meta device when reattaching: no init cost
        model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    state = ctx.retain(model, opt)         # params, grads, optimizer state in the pool
    for step in state.steps(total):        # resumes at the right step, RNG restored
        loss = model(*batch(step))
        loss.backward()
        state.step(max_grad_norm=1.0)      # all-reduce, clip, crash-consistent update
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ChainedOptimizer", "Context", "RetainedState", "init"]

_LAZY = {
    "ChainedOptimizer": "leto.optim",
    "Context": "leto.trainer.context",
    "init": "leto.trainer.context",
    "RetainedState": "leto.trainer.state",
}
"""Each export's module, imported at first access: the state manager imports leto.pool.*
and must never pull in torch, and every module below the trainer imports this package."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'leto' has no attribute {name!r}")
