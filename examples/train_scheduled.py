"""A BatchNorm MLP with an LR scheduler and a stateful data position, trained the ordinary way.

    leto-run --nproc-per-node 2 examples/train_scheduled.py --steps 12 --scheduler onecycle

The scheduler is built after ``ctx.retain()`` and stepped after ``state.step()``, as torch's
documentation has it; it is not named to Leto, which finds it on the optimizer. The data
position (``SampleCursor``, a user object with ``state_dict()`` / ``load_state_dict()``) is
named; so is the torchdata ``StatefulDataLoader`` of ``--loader``. BatchNorm updates its
running statistics in every forward. ``--augment`` draws each batch's augmentation from
Python's ``random`` and NumPy's global generator in the loop, as a script's own code does
(seeded once at the start: Leto retains both with torch's RNG). ``--plain`` runs the same
loop with torch alone (one process, no Leto): the reference a one-rank leto-run job equals
bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler

FEATURES, CLASSES = 16, 4
SCHEDULERS = ("lambda", "onecycle", "cosine_restarts")


class SampleCursor:
    """Where the data stream stands: the samples handed out so far (a user ``Stateful``)."""

    def __init__(self) -> None:
        self.position = 0

    def take(self, n: int) -> int:
        start, self.position = self.position, self.position + n
        return start

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def make_model(args: argparse.Namespace) -> nn.Module:
    h = args.hidden
    return nn.Sequential(
        nn.Linear(FEATURES, h),
        nn.BatchNorm1d(h),
        nn.ReLU(),
        nn.Dropout(args.dropout),
        nn.Linear(h, h),
        nn.BatchNorm1d(h),
        nn.ReLU(),
        nn.Linear(h, CLASSES),
    )


def make_scheduler(
    name: str, opt: torch.optim.Optimizer, args: argparse.Namespace
) -> lr_scheduler.LRScheduler:
    if name == "lambda":  # warm-up, then halving every 4 steps
        return lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 ** (s // 4)
        )
    if name == "onecycle":  # cycles AdamW's beta1 too
        return lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps)
    return lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3, T_mult=2, eta_min=args.lr / 20)


def samples(
    position: int, n: int, rank: int, args: argparse.Namespace
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic samples ``position .. position + n`` of this rank's stream."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + position * 1009 + rank)
    x = torch.randn(n, FEATURES, generator=g)
    return x, x[:, :CLASSES].argmax(dim=1)


class LoaderBatches:
    """Batches of a torchdata ``StatefulDataLoader`` over this rank's shard (a
    ``DistributedSampler``, reshuffled per epoch by ``set_epoch``, the epoch taken from the
    cursor). The iterator is made at the first batch, after ``state.steps()`` restored the
    loader; a restored iterator that had finished its epoch gives way to the next one.

    (torchdata 0.11's own shuffling, ``shuffle=True``, does not come back exactly: the epoch
    after a restore draws another permutation.)"""

    def __init__(self, rank: int, world_size: int, args: argparse.Namespace) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        data = torch.utils.data.TensorDataset(*samples(0, 16 * args.batch, 0, args))
        self.sampler = torch.utils.data.DistributedSampler(
            data, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed, drop_last=True
        )
        # its own generator: each iterator draws a base seed, and a resumed trainer makes one
        # more iterator than the failed one did (the global RNG is the model's: Leto retains it)
        self.loader = StatefulDataLoader(
            data,
            batch_size=args.batch,
            sampler=self.sampler,
            drop_last=True,
            generator=torch.Generator().manual_seed(args.seed),
        )
        self.epoch_samples = len(self.loader) * args.batch
        self._it: Any = None
        self._epoch = -1

    def next(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch at ``position`` samples into this rank's stream."""
        epoch = position // self.epoch_samples
        if self._it is None or epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._epoch, self._it = epoch, iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)


def augment(x: torch.Tensor) -> torch.Tensor:
    """Scale by a factor from Python's ``random`` and add noise from NumPy's global generator
    (an odd count of Gaussians, so its cache is left holding one)."""
    scale = random.uniform(0.5, 1.5)
    noise = torch.from_numpy(np.random.randn(x.numel() + 1)[: x.numel()].astype(np.float32))
    return x * scale + 0.1 * noise.view_as(x)


def seed_host(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)


def hyperparameters(opt: torch.optim.Optimizer) -> dict[str, Any]:
    group = opt.param_groups[0]
    return {"lr": group["lr"], "betas": list(group["betas"])}


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def final_state(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: lr_scheduler.LRScheduler,
    cursor: SampleCursor,
) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "cursor": cursor.state_dict(),
    }


def train_plain(args: argparse.Namespace) -> None:
    """The same loop with torch alone: one process, rank 0's data."""
    torch.manual_seed(args.seed)
    seed_host(args.seed)
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=True)
    cursor = SampleCursor()
    loader = LoaderBatches(0, 1, args) if args.loader else None
    sched = make_scheduler(args.scheduler, opt, args)
    for step in range(args.steps):
        start = cursor.take(args.batch)
        x, y = loader.next(start) if loader is not None else samples(start, args.batch, 0, args)
        x = augment(x) if args.augment else x
        opt.zero_grad()
        forward_backward(model, x, y)
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        log(args, 0, step, opt, cursor, x)
        opt.step()
        sched.step()
    if args.final:
        torch.save(final_state(model, opt, sched, cursor), args.final)


def log(
    args: argparse.Namespace,
    rank: int,
    step: int,
    opt: torch.optim.Optimizer,
    cursor: SampleCursor,
    x: torch.Tensor,
) -> None:
    """The hyperparameters step ``step``'s update uses and its batch's digest (a re-run step
    appends again)."""
    if args.trace:
        entry = {"step": step, **hyperparameters(opt), "position": cursor.position}
        entry["batch"] = hashlib.blake2b(x.numpy().tobytes(), digest_size=8).hexdigest()
        with Path(f"{args.trace}.rank{rank}").open("a") as f:
            f.write(json.dumps(entry) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--scheduler", choices=SCHEDULERS, default="lambda")
    p.add_argument(
        "--loader",
        action="store_true",
        help="data from a torchdata StatefulDataLoader (named to leto)",
    )
    p.add_argument(
        "--augment",
        action="store_true",
        help="augment each batch with draws from Python's random and NumPy's global generator",
    )
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--trace", help="append each step's hyperparameters to TRACE.rank<r> (JSON lines)"
    )
    p.add_argument(
        "--final", help="rank 0 saves the final model, optimizer, scheduler and cursor here"
    )
    p.add_argument("--plain", action="store_true", help="torch alone, one process (the reference)")
    args = p.parse_args()
    for flag, value, least in (("--steps", args.steps, 1), ("--warmup", args.warmup, 1)):
        if value < least:  # one line, as leto-run's errors (argparse's error adds the usage)
            p.exit(2, f"{p.prog}: error: {flag} must be >= {least}, got {value}\n")
    torch.set_num_threads(1)
    if args.plain:
        train_plain(args)
        return

    import leto

    ctx = leto.init()  # a shadow pre-initialises here; it waits for promotion in retain()
    torch.manual_seed(args.seed)
    seed_host(args.seed + ctx.rank)
    with ctx.init_device(ctx.device):
        model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, foreach=True)
    cursor = SampleCursor()
    loader = LoaderBatches(ctx.rank, ctx.world_size, args) if args.loader else None
    stateful: dict[str, Any] = {"cursor": cursor} | (
        {"loader": loader.loader} if loader is not None else {}
    )
    state = ctx.retain(model, opt, stateful=stateful)
    sched = make_scheduler(args.scheduler, opt, args)  # not named: leto finds it on the optimizer
    for step in state.steps(args.steps):
        start = cursor.take(args.batch)
        x, y = (
            loader.next(start) if loader is not None else samples(start, args.batch, ctx.rank, args)
        )
        x = augment(x) if args.augment else x
        x_dev, y_dev = x.to(ctx.device), y.to(ctx.device)
        loss = state.compute(lambda x=x_dev, y=y_dev: forward_backward(model, x, y))
        log(args, ctx.rank, step, opt, cursor, x)
        state.step(max_grad_norm=1.0, loss=loss)
        sched.step()
    if args.final and ctx.rank == 0:
        torch.save(final_state(model, opt, sched, cursor), args.final)


if __name__ == "__main__":
    main()
