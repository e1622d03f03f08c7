"""A leto job whose script keeps one large activation past the compute phase at --keep-step
(a tensor living in the undo memory lent to activations): the step must be refused."""

from __future__ import annotations

import argparse

import torch

import leto


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--keep-step", type=int, default=3)
    args = p.parse_args()
    ctx = leto.init()
    torch.manual_seed(0)
    with ctx.init_device(ctx.device):
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = ctx.retain(model, opt)
    kept = []
    for step in state.steps(args.steps):
        x = torch.randn(1024, 1024, device=ctx.device)

        def fb(step: int = step, x: torch.Tensor = x) -> torch.Tensor:
            h = model[0](x)  # 16 MiB: lent memory
            if step == args.keep_step:
                kept.append(h)
            loss = model[1](h).square().mean()
            loss.backward()
            return loss

        loss = state.compute(fb)
        state.step(loss=loss)


if __name__ == "__main__":
    main()
