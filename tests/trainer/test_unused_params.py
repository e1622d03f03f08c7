"""A parameter that gets no gradient in a step is left alone by the update, as torch's
optimizers leave a parameter whose ``.grad`` is None after ``zero_grad()`` (its default,
``set_to_none=True``): no parameter change, no moment or weight decay, no step count
(``leto.retained.presence``). Updating it with a zero gradient instead would train a model
with a branch some steps do not take (an MoE expert no token reached), or with a frozen
parameter left in the optimizer, differently than torchrun does.

A layer frozen when the job began and unfrozen later (gradual unfreezing) lands its first
gradient when the gradients settle (``leto.trainer.grad_landing``). A real trainer
``Context`` in this process (tests/trainer/local.py), against torch alone. The finishing
update after a kill skips the same parameters: the retained record here, and in a job with
kills, tests/launcher/test_moe_recovery.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.trainer.local import local_context

STEPS = 6


class Branchy(nn.Module):
    """``b`` is used on even steps only; ``frozen`` never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.a(x) + self.frozen
        if step % 2 == 0:
            h = self.b(h)
        return self.c(torch.tanh(h)).square().mean()


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1),
}
X = torch.linspace(-1, 1, 8).reshape(2, 4)


def _torch_alone(optimizer: str) -> list[torch.Tensor]:
    net = Branchy()
    opt = OPTIMIZERS[optimizer](list(net.parameters()))
    for step in range(STEPS):
        opt.zero_grad()
        net(X, step).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _leto(monkeypatch: pytest.MonkeyPatch, optimizer: str, **env: object) -> list[torch.Tensor]:
    with local_context(monkeypatch, **env) as ctx:
        net = Branchy()
        state = ctx.retain(net, OPTIMIZERS[optimizer](list(net.parameters())))
        for step in state.steps(STEPS):
            state.compute(lambda step=step: net(X, step).backward())
            state.step()
        return [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize(
    ("optimizer", "env"),
    [
        ("adamw", {}),
        ("adamw-fused", {}),
        ("sgd-momentum", {}),  # the optimizer's own step, chunk by chunk
        ("adamw", {"consistency": "snapshot"}),
    ],
    ids=["adamw", "adamw-fused", "sgd-momentum", "snapshot"],
)
def test_a_parameter_without_a_gradient_is_updated_as_torch_would(
    monkeypatch: pytest.MonkeyPatch, optimizer: str, env: dict
) -> None:
    want = _torch_alone(optimizer)
    got = _leto(monkeypatch, optimizer, **env)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), f"parameter {i}"


def test_the_fused_kernel_leaves_a_skipped_parameter_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Leto's Triton AdamW (the interpreter on CPU): equal to torch within its float
    rounding, and the parameter never given a gradient bit for bit unchanged."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    want = _torch_alone("adamw")
    got = _leto(monkeypatch, "adamw", rmu_fused=True)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0], Branchy().frozen)  # own parameters come first


def test_a_finishing_update_skips_what_the_interrupted_one_skipped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The skipped parameters are read back from retained memory, not from the process
    that chose them: a fresh record of the same words names the same parameters."""
    with local_context(monkeypatch) as ctx:
        net = Branchy()
        state = ctx.retain(net, OPTIMIZERS["adamw"](list(net.parameters())))
        steps = state.steps(2)
        next(steps)
        state.compute(lambda: net(X, 1).backward())  # an odd step: b has no gradient
        state.step()
        presence = state.updater.presence
        assert presence is not None
        unused = [id(p) for p in (*net.b.parameters(), net.frozen)]
        skipped = {i for i, p in enumerate(state.params) if id(p) in unused}
        assert len(skipped) == 3
        assert presence.retained_skipped() == frozenset(skipped)
        assert presence.counts_may_differ()


def test_unfreezing_and_freezing_during_training_trains_as_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gradual unfreezing: a layer frozen when the job began (no landing hook yet) gets its
    first gradient landed when ``step()`` settles the gradients; a layer frozen later is
    skipped from then on. Both as torch's loop over the same schedule."""

    def net() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
        m[0].requires_grad_(False)
        return m

    def schedule(m: nn.Module, step: int) -> None:
        if step == 2:
            m[0].requires_grad_(True)
        if step == 4:
            m[2].requires_grad_(False)

    _assert_trains_as_torch(monkeypatch, net, schedule, lambda m, _: m(X).square().mean())


def _assert_trains_as_torch(
    monkeypatch: pytest.MonkeyPatch,
    net: Callable[[], nn.Module],
    schedule: Callable[[nn.Module, int], None],
    loss: Callable[[nn.Module, int], torch.Tensor],
    titan: bool = False,
) -> None:
    """``net()`` trained for ``STEPS`` steps under ``schedule`` by torch's loop (AdamW,
    ``zero_grad()``) and by Leto's: every parameter equal at the end. With ``titan`` both
    clip the gradients themselves after backward and Leto's calls ``zero_grad()`` at each
    step's start too, as torchtitan's loop does."""
    ref = net()
    ref_opt = OPTIMIZERS["adamw"](list(ref.parameters()))
    for step in range(STEPS):
        schedule(ref, step)
        ref_opt.zero_grad()
        loss(ref, step).backward()
        if titan:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    with local_context(monkeypatch) as ctx:
        m = net()
        opt = OPTIMIZERS["adamw"](list(m.parameters()))
        state = ctx.retain(m, opt)
        for step in state.steps(STEPS):
            schedule(m, step)
            if titan:
                opt.zero_grad()
            state.compute(lambda step=step: loss(m, step).backward())
            if titan:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            state.step()
        for (name, a), b in zip(ref.named_parameters(), m.parameters(), strict=True):
            assert torch.equal(_full(a), _full(b)), name


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_the_uneven_word_survives_a_zeroed_gradient_region() -> None:
    """Under ``fully_shard`` every step starts by zeroing the whole gradient region, words
    included: once the step counters may differ (a parameter was skipped, say while it was
    frozen, or a checkpoint was loaded), every later step's ``mark`` says so again, and a
    promoted trainer learns it from the retained word (``attach``)."""
    from leto.retained.presence import GradPresence

    region = torch.zeros(5)
    presence = GradPresence(region)
    presence.mark([])
    assert not presence.counts_may_differ()
    presence.mark([1])
    presence.note_uneven()  # the step skipped parameter 1
    region.zero_()  # the next step's start
    presence.mark([])  # a step that skips nothing
    assert presence.retained_skipped() == frozenset()
    assert presence.counts_may_differ()
    successor = GradPresence(region)
    successor.attach()
    region.zero_()
    successor.mark([])
    assert successor.counts_may_differ()


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A gloo group of one, for ``fully_shard``'s mesh."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded(m: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
    return m


@pytest.mark.parametrize("titan", [False, True], ids=["", "zero_grad-clip"])
def test_under_fully_shard_unused_and_unfrozen_parameters_train_as_torch(
    monkeypatch: pytest.MonkeyPatch, world_of_one: None, titan: bool
) -> None:
    """Under ``fully_shard`` FSDP2 reduces gradients into the retained shards itself; the
    parameters it reduced none for (``b`` on odd steps, a layer frozen until step 2, one
    frozen from step 4) are skipped by the update, as torch's optimizer skips their None
    ``.grad``. torchtitan's loop works as under torch: an ``optimizer.zero_grad()`` at each
    step's start leaves FSDP2 a None ``.grad`` to assign, which lands in retained memory all
    the same, and the script's own clipping after backward sees final gradients. A world
    of one: FSDP2's bookkeeping is the same on every rank."""

    def net() -> nn.Module:
        m = Branchy()
        m.a.requires_grad_(False)
        return _sharded(m)

    def schedule(m: nn.Module, step: int) -> None:
        if step == 2:
            m.a.requires_grad_(True)
        if step == 4:
            m.c.bias.requires_grad_(False)

    _assert_trains_as_torch(monkeypatch, net, schedule, lambda m, step: m(X, step), titan)


def test_under_fully_shard_a_step_with_a_nonfinite_norm_is_skipped_as_torch_skips_it(
    monkeypatch: pytest.MonkeyPatch, world_of_one: None
) -> None:
    """``state.step(skip_nonfinite=True)`` over FSDP2's DTensor norm: the step whose loss
    is scaled by inf leaves the shards and AdamW's state as ``if norm.isfinite():
    opt.step()`` leaves them."""

    def net() -> nn.Module:
        torch.manual_seed(0)
        return _sharded(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)))

    def loss(m: nn.Module, step: int) -> torch.Tensor:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        return m(x).square().mean() * (float("inf") if step == 2 else 1.0)

    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for step in range(5):
        opt.zero_grad()
        loss(m, step).backward()
        if torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5).isfinite():
            opt.step()
    expected = [_full(p).clone() for p in m.parameters()]
    with local_context(monkeypatch) as ctx:
        m = net()
        state = ctx.retain(m, torch.optim.AdamW(m.parameters(), lr=1e-2))
        finite = []
        for step in state.steps(5):
            state.compute(lambda step=step: loss(m, step).backward())
            finite.append(bool(state.step(max_grad_norm=0.5, skip_nonfinite=True).isfinite()))
        got = [_full(p).clone() for p in m.parameters()]
    assert finite == [True, True, False, True, True]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
