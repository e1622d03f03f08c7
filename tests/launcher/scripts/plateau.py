"""A job whose ``ReduceLROnPlateau`` is stepped with each step's loss after
``state.step(loss=loss)``, as torch scripts step it after ``optimizer.step()``; its rate is
cut several times over the job (``tests/launcher/test_stateful_recovery.py``)."""

import argparse

import torch
from torch import nn

import leto

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
args, _ = p.parse_known_args()
torch.set_num_threads(1)
ctx = leto.init()
with ctx.init_device(ctx.device):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
state = ctx.retain(model, opt)
sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=1, threshold=0.5)
for step in state.steps(args.steps):
    g = torch.Generator().manual_seed(step * 7 + ctx.rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    def compute(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    loss = state.compute(compute)
    state.step(max_grad_norm=1.0, loss=loss)
    sched.step(float(loss))
