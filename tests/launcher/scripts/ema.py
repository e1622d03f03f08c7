"""A job that keeps an exponential moving average of its weights, updated after every
``state.step()`` as torch's loop updates it after ``optimizer.step()``
(``tests/launcher/test_stateful_recovery.py``)."""

import tiny
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

args, ctx, model = tiny.start(default_steps=12)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
state = ctx.retain(model, opt, stateful={"ema": ema})
for step in state.steps(args.steps):
    state.compute(tiny.compute(model, step, ctx.rank))
    state.step(max_grad_norm=1.0)
    ema.update_parameters(model)
