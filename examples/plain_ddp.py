"""A plain torchrun DDP script: no leto API. Under leto-run it gets torchrun's behaviour.

    leto-run --nproc-per-node 2 --max-restarts 1 examples/plain_ddp.py --steps 20

With ``--kill-at-step N`` rank 1 SIGKILLs itself at step N of the first attempt, so a test
can watch leto-run restart the whole group as torchrun would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.steps < 1:  # one line, as leto-run's errors (argparse's error adds the usage)
        p.exit(2, f"{p.prog}: error: --steps must be >= 1, got {args.steps}\n")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step * 2 + rank)
        loss = model(torch.randn(8, 16, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 1 and attempt == 0 and step == args.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            json.dump({"attempt": attempt, "weight_sum": float(model.module.weight.sum())}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13's gloo can abort in C++ static teardown after a clean run ("terminate called
    # without an active exception", also under plain torchrun on a loaded machine): skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
