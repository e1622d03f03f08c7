"""A one-parameter leto job that records its CPU priority: each process's role and nice
value when ``leto.init()`` returns (a shadow is pre-initialising then) and at each step
(every thread's), one JSON line per record in ``--trace``. ``--shadow-sleep S``: a shadow
sleeps S seconds after its first record, then records again ("slept"), still before it
waits for promotion; ``--await-shadow-at K``: the active, at step K, waits until a shadow
has made its first record (so a kill at K finds a shadow still pre-initialising)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import leto
from leto.priority import own_autogroup_nice, thread_nices


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--trace", required=True)
    p.add_argument("--shadow-sleep", type=float, default=0.0)
    p.add_argument("--await-shadow-at", type=int, default=-1)
    args = p.parse_args()
    ctx = leto.init()

    def record(**fields: object) -> None:
        with open(args.trace, "a") as f:
            f.write(
                json.dumps(
                    {
                        "pid": os.getpid(),
                        "shadow": ctx.is_shadow,
                        "autogroup": own_autogroup_nice(),
                        **fields,
                    }
                )
                + "\n"
            )

    record(at="init", nices=thread_nices())
    if ctx.is_shadow and args.shadow_sleep:
        time.sleep(args.shadow_sleep)
        record(at="slept", nices=thread_nices())
    torch.manual_seed(0)
    with ctx.init_device(ctx.device):
        model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ctx.retain(model, opt)
    x = torch.ones(2, 4)
    for step in state.steps(args.steps):
        record(at="step", step=step, nices=thread_nices())
        while step == args.await_shadow_at and '"shadow": true' not in Path(args.trace).read_text():
            time.sleep(0.01)

        def fb() -> torch.Tensor:
            loss = model(x).square().mean()
            loss.backward()
            return loss

        loss = state.compute(fb)
        state.step(loss=loss)


if __name__ == "__main__":
    main()
