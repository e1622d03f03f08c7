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

from leto.trainer.context import Context, init
from leto.trainer.state import RetainedState

__all__ = ["Context", "RetainedState", "init"]
