"""A job whose ``ReduceLROnPlateau`` is stepped with each step's loss after
``state.step(loss=loss)``, as torch scripts step it after ``optimizer.step()``; its rate is
cut several times over the job (``tests/launcher/test_stateful_recovery.py``)."""

import tiny
import torch

args, ctx, model = tiny.start(default_steps=12)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
state = ctx.retain(model, opt)
sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1, threshold=0.5)
for step in state.steps(args.steps):
    loss = state.compute(tiny.compute(model, step, ctx.rank))
    state.step(max_grad_norm=1.0, loss=loss)
    sched.step(float(loss))
