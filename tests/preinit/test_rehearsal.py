"""The shadow's update rehearsal (``leto.preinit.rehearsal``) dispatches every torch op, per
dtype, that a trainer's updates dispatch, so a promoted trainer's first update loads no
kernel of its own; it touches nothing outside its scratch memory."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

os.environ.setdefault("TRITON_INTERPRET", "1")  # the fused path's kernel, on CPU

from leto.preinit import warmup
from leto.preinit.rehearsal import UpdateRehearsal
from tests.updater.rig import Rig, model, no_faults
from tests.updater.test_rmu import CHUNK, LRS


class Ops(TorchDispatchMode):
    """Records ``(op, dtypes of its tensor arguments)`` of everything dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, tuple[str, ...]]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        dtypes = tuple(sorted({str(t.dtype) for t in leaves if isinstance(t, torch.Tensor)}))
        self.seen.add((str(func), dtypes))
        return func(*args, **kwargs)


def _groups(net: torch.nn.Module) -> list[dict]:
    mats = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    return [{"params": mats, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


OPTIMIZERS = {
    "adamw-fused-kernel": (lambda n: torch.optim.AdamW(_groups(n), fused=True), True),
    "adamw-foreach": (lambda n: torch.optim.AdamW(_groups(n), foreach=True), False),
    "sgd-momentum": (lambda n: torch.optim.SGD(_groups(n), lr=0.1, momentum=0.9), False),
    "muon": (lambda n: torch.optim.Muon(n.parameters(), lr=2e-2), False),  # matrices only
}


def _net(name: str) -> torch.nn.Module:
    if name != "muon":
        return model()
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(24, 72, bias=False), torch.nn.Linear(72, 24, bias=False)
    )


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_rehearsal_dispatches_every_op_of_the_trainers_updates(name: str) -> None:
    factory, fused = OPTIMIZERS[name]
    rig = Rig.build(_net(name), erasure=None, chunk_bytes=CHUNK, fused=fused, optimizer=factory)
    real = Ops()
    for step in range(3):
        rig.set_grads(seed=step)
        rig.grads_ready(LRS[step])
        updater = rig.updater(no_faults())
        with real:
            updater.run(step)
    rehearsed = Ops()
    rng = torch.get_rng_state()
    with rehearsed:
        assert UpdateRehearsal.of(rig.opt, fused).run(torch.device("cpu")) == 2
    assert torch.equal(rng, torch.get_rng_state()), "the rehearsal drew from the global RNG"
    missing = real.seen - rehearsed.seen
    assert real.seen and not missing, f"{name}: not rehearsed: {sorted(missing)}"


class _NeedsAnArgument(torch.optim.SGD):
    def __init__(self, params, momentum_source: str) -> None:
        super().__init__(params, lr=0.1)


def test_an_optimizer_the_miniature_cannot_rebuild_skips_the_rehearsal() -> None:
    opt = _NeedsAnArgument(model().parameters(), "x")
    target = warmup.WarmupTarget(
        device=torch.device("cpu"), rehearsal=UpdateRehearsal.of(opt, fused=False)
    )
    assert warmup.warm_update(target) == 0
