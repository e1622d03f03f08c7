"""A job whose promoted trainer's first step is slow (half a second of host time before its
compute), as a large model's is against a replacement shadow's start
(``tests/launcher/test_replacement_start.py``). A promoted trainer's last step waits a few
seconds more, so the job outlives the replacement's start however busy the machine."""

import time

import tiny
import torch

REPLACEMENT_START_S = 5.0
"""Long enough for a replacement forked at the promoted trainer's first step to start."""

args, ctx, model = tiny.start(default_steps=10)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
state = ctx.retain(model, opt)
slowed = False
for step in state.steps(args.steps):
    if ctx.promoted_at is not None and not slowed:
        time.sleep(0.5)
        slowed = True
    loss = state.compute(tiny.compute(model, step, ctx.rank))
    state.step(max_grad_norm=1.0, loss=loss)
    if ctx.promoted_at is not None and step == args.steps - 1:
        time.sleep(REPLACEMENT_START_S)
