"""The tiny job drawing its batches from a plain ``DataLoader`` that Leto does not retain
(no ``stateful=``): after a recovery its iterator starts again from the first batch
(``tests/launcher/test_loader_warning.py``)."""

import tiny
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

args, ctx, model = tiny.start(default_steps=8)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
state = ctx.retain(model, opt)
g = torch.Generator().manual_seed(ctx.rank)
data = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
batches = iter(DataLoader(data, batch_size=8))
for step in state.steps(args.steps):
    x, y = next(batches)
    state.compute(lambda x=x, y=y: nn.functional.cross_entropy(model(x), y).backward())
    state.step()
