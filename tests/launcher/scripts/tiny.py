"""The small MLP job the scripts here share: its start (``leto.init``, the model), each
step's batch (addressed by step and rank) and its compute phase."""

import argparse
from collections.abc import Callable

import torch
from torch import nn

import leto


def start(default_steps: int) -> tuple[argparse.Namespace, leto.Context, nn.Module]:
    """``--steps`` (the rest of the command line is the harness's), the trainer's context
    and the model, built on its device."""
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=default_steps)
    args, _ = p.parse_known_args()
    torch.set_num_threads(1)
    ctx = leto.init()
    with ctx.init_device(ctx.device):
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    return args, ctx, model


def compute(model: nn.Module, step: int, rank: int) -> Callable[[], torch.Tensor]:
    """Step ``step``'s forward and backward on this rank's batch, for ``state.compute``."""
    g = torch.Generator().manual_seed(step * 7 + rank)
    x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)

    def run() -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    return run
