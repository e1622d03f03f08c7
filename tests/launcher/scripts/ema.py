"""A job that keeps an exponential moving average of its weights, updated after every
``state.step()`` as torch's loop updates it after ``optimizer.step()``
(``tests/launcher/test_stateful_recovery.py``)."""

import argparse

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import leto

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
args, _ = p.parse_known_args()
torch.set_num_threads(1)
ctx = leto.init()
with ctx.init_device(ctx.device):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
state = ctx.retain(model, opt, stateful={"ema": ema})
for step in state.steps(args.steps):
    g = torch.Generator().manual_seed(step * 7 + ctx.rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    def compute(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    state.compute(compute)
    state.step(max_grad_norm=1.0)
    ema.update_parameters(model)
