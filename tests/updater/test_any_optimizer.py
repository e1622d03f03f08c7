"""Any ``torch.optim`` optimizer on the RMU in-process (``leto.retained.optim_state``,
``leto.updater.torch_step``): its state is found by running it, the chunked update equals
its own ``step()`` bit for bit, a kill at every point of the update (in the first step,
where torch creates the state, and in a later one) finishes exactly, so does the snapshot
path's sequence; and what cannot be retained is refused when the layout is planned, i.e. at
``retain()``."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from leto.erasure import ErasureConfig
from leto.errors import ConfigError, UnrecoverableStateError
from leto.optim import ChainedOptimizer
from leto.retained.layout import Layout
from leto.retained.marker import Phase
from leto.retained.optim_state import PRESENT, StateSlots, optimizer_state
from leto.updater.plan import plan_chunks
from leto.updater.rmu import buffer_bytes
from tests.updater.rig import Killed, Rig, kill_at, model, no_faults
from tests.updater.test_rmu import CHUNK, ERASURE, LRS, _clip, _points, _recover, _step

Factory = Callable[[nn.Module], torch.optim.Optimizer]


class Lion(torch.optim.Optimizer):
    """A user's own optimizer class, written the way most are (Lion, Chen et al. 2023): its
    state made lazily at the first step, a Python loop over parameters."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = state["exp_avg"] * beta1 + p.grad * (1 - beta1)
                p.add_(update.sign_(), alpha=-group["lr"])
                state["exp_avg"].mul_(beta2).add_(p.grad, alpha=1 - beta2)


def _groups(net: nn.Module, **decay: float) -> list[dict]:
    """Two groups, as training scripts build them: matrices with weight decay, the rest without."""
    mats = [p for p in net.parameters() if p.dim() >= 2]
    rest = [p for p in net.parameters() if p.dim() < 2]
    return [{"params": mats, **decay}, {"params": rest, "weight_decay": 0.0}]


OPTIMIZERS: dict[str, Factory] = {
    "sgd-nesterov": lambda n: torch.optim.SGD(
        _groups(n, weight_decay=0.01), lr=0.1, momentum=0.9, nesterov=True
    ),
    # dampening: torch's first step copies the gradient into the buffer, zeros would not give it
    "sgd-dampening": lambda n: torch.optim.SGD(
        _groups(n, weight_decay=0.01), lr=0.1, momentum=0.9, dampening=0.3, foreach=True
    ),
    "sgd-plain": lambda n: torch.optim.SGD(n.parameters(), lr=0.1),
    "adam-amsgrad": lambda n: torch.optim.Adam(_groups(n, weight_decay=0.01), amsgrad=True),
    "adamw-amsgrad": lambda n: torch.optim.AdamW(
        _groups(n, weight_decay=0.1), amsgrad=True, foreach=True
    ),
    "nadam": lambda n: torch.optim.NAdam(_groups(n, weight_decay=0.01)),
    "nadam-decoupled": lambda n: torch.optim.NAdam(
        _groups(n, weight_decay=0.1), decoupled_weight_decay=True
    ),
    "radam": lambda n: torch.optim.RAdam(_groups(n, weight_decay=0.01), foreach=True),
    "rmsprop": lambda n: torch.optim.RMSprop(
        _groups(n, weight_decay=0.01), momentum=0.9, centered=True
    ),
    "adagrad": lambda n: torch.optim.Adagrad(
        _groups(n, weight_decay=0.01), initial_accumulator_value=0.1
    ),
    "adamax": lambda n: torch.optim.Adamax(_groups(n, weight_decay=0.01)),
    "adadelta": lambda n: torch.optim.Adadelta(_groups(n, weight_decay=0.01)),
    "asgd": lambda n: torch.optim.ASGD(_groups(n, weight_decay=0.01), t0=1),
    "rprop": lambda n: torch.optim.Rprop(n.parameters()),
    "adafactor": lambda n: torch.optim.Adafactor(n.parameters(), lr=1e-2),
    "muon": lambda n: torch.optim.Muon(n.parameters(), lr=2e-2),
    "lion-user-class": lambda n: Lion(_groups(n, weight_decay=0.1), lr=1e-3),
    # Muon for the matrices, AdamW for the rest, chained into one optimizer (leto.optim)
    "muon+adamw": lambda n: ChainedOptimizer(
        [
            torch.optim.Muon([p for p in n.parameters() if p.dim() == 2], lr=2e-2),
            torch.optim.AdamW([p for p in n.parameters() if p.dim() != 2], weight_decay=0.1),
        ]
    ),
    # AdamW over parameters of two dtypes: its own step, Leto's AdamW walks one dtype
    "adamw-mixed-dtypes": lambda n: torch.optim.AdamW(_groups(n, weight_decay=0.1)),
}
"""Optimizers whose state is found by the probe (the ``torch`` rule)."""
LETO_ADAMW: dict[str, Factory] = {
    "adamw-fused": lambda n: torch.optim.AdamW(_groups(n, weight_decay=0.1), fused=True),
}
"""Planned as Leto's AdamW (``tests/updater/test_rmu.py`` compares its update with torch's);
the snapshot path still runs their own ``step()``."""
FACTORIES = {**OPTIMIZERS, **LETO_ADAMW}


def _net(name: str) -> nn.Module:
    """The rig's model (4 chunks at CHUNK bytes); Muon takes matrices only; the last layer
    in bfloat16 for the mixed-dtype case."""
    if name == "adamw-mixed-dtypes":
        net = model()
        net[3].to(torch.bfloat16)
        return net
    if name != "muon":
        return model()
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(24, 72, bias=False),
        nn.GELU(),
        nn.Linear(72, 24, bias=False),
        nn.Linear(24, 24, bias=False),
    )


def _build(name: str, erasure: ErasureConfig | None = ERASURE) -> Rig:
    return Rig.build(_net(name), erasure=erasure, chunk_bytes=CHUNK, optimizer=FACTORIES[name])


def _torch_reference(name: str, steps: int) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """The optimizer's own step() on ordinary tensors, with the rig's gradients and clipping."""
    net = _net(name)
    opt = FACTORIES[name](net)
    params = [p for g in opt.param_groups for p in g["params"]]
    probe = Rig.build(
        copy.deepcopy(net), erasure=None, chunk_bytes=CHUNK, optimizer=FACTORIES[name]
    )  # its grads
    for step in range(steps):
        probe.set_grads(seed=100 + step)
        for p, slot in zip(params, probe.layout.grads, strict=True):
            p.grad = slot.view(probe.grads).clone()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for g in opt.param_groups:
            g["lr"] = LRS[step]
        opt.step()
    return params, opt


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


# -- what the probe finds ------------------------------------------------------------------------
def test_the_probe_finds_each_optimizers_state_without_touching_anything() -> None:
    net = model()
    rng, before = torch.get_rng_state(), [p.detach().clone() for p in net.parameters()]
    opt = torch.optim.Adafactor(net.parameters())
    rule, keys = optimizer_state(opt, list(net.parameters()))
    assert torch.equal(torch.get_rng_state(), rng), "the probe drew from the global RNG"
    assert (
        all(torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))
        and not opt.state
    )
    assert (rule.kind, rule.separable, rule.counters) == ("torch", True, frozenset({"step"}))
    w = next(net.parameters())  # (72, 24): factored second moment, a row and a column
    shapes = {k.name: k.shape(w.shape) for k in keys[0]}
    assert shapes == {"step": (), "row_var": (72, 1), "col_var": (1, 24), PRESENT: ()}
    assert {k.name: k.shape((72,)) for k in keys[1]} == {"step": (), "variance": (72,), PRESENT: ()}
    sgd = torch.optim.SGD(_groups(net), lr=0.1, momentum=0.9)
    sgd.param_groups[1]["momentum"] = 0.0  # no state at all in the second group
    rule, keys = optimizer_state(sgd, [p for g in sgd.param_groups for p in g["params"]])
    assert rule.counters == frozenset()
    assert [[k.name for k in ks] for ks in keys] == [["momentum_buffer", PRESENT]] * 2 + [
        [PRESENT]
    ] * 4
    rule, keys = optimizer_state(torch.optim.AdamW(net.parameters()), list(net.parameters()))
    assert rule.kind == "adamw" and [k.name for k in keys[0]] == ["step", "exp_avg", "exp_avg_sq"]


def test_fused_adamw_is_reported_once_a_process(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shadow's update rehearsal plans the same optimizer class again: one log line."""
    from leto.retained import optim_state

    monkeypatch.setattr(optim_state, "_FUSED_SAID", set())
    net = model()
    with caplog.at_level("INFO", logger=optim_state.logger.name):
        for _ in range(2):
            rule, _keys = optimizer_state(
                torch.optim.AdamW(net.parameters(), fused=True), list(net.parameters())
            )
            assert rule.kind == "adamw"
    said = [r for r in caplog.records if "fused=True" in r.getMessage()]
    assert len(said) == 1 and said[0].getMessage().startswith("AdamW(fused=True)")


# -- one update equals the optimizer's own ------------------------------------------------------
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_chunked_update_equals_the_optimizers_own_step(name: str) -> None:
    """Three steps chunk by chunk (several chunks, parameters of two groups in one chunk)
    give torch's bytes for every parameter and every state tensor; parity stays current."""
    rig = _build(name)
    assert rig.layout.rule.kind == "torch"
    assert len(rig.updater(no_faults()).chunks) >= 3
    for step in range(3):
        _step(rig, step, no_faults())
    params, opt = _torch_reference(name, 3)
    for i, (p, slot, oslots) in enumerate(
        zip(params, rig.layout.params, rig.layout.optim, strict=True)
    ):
        assert torch.equal(_bits(slot.view(rig.state)), _bits(p)), f"{name}: parameter {i}"
        held = opt.state[p]
        assert set(oslots) - {PRESENT} == set(held), f"{name}: state keys of parameter {i}"
        for key, t in held.items():
            assert torch.equal(_bits(oslots[key].view(rig.state)), _bits(t)), (
                f"{name}: {key} of parameter {i}"
            )
        assert int(oslots[PRESENT].view(rig.state)) == (1 if held else 0)
    for g in rig.protected.groups:
        t1, t2 = g.tier1.clone(), g.tier2.clone()
        g.encode_all()
        assert torch.equal(t1, g.tier1) and torch.equal(t2, g.tier2)


# -- kills ---------------------------------------------------------------------------------------
def _reference(name: str, erasure: ErasureConfig | None) -> Rig:
    rig = _build(name, erasure)
    for s in range(3):
        _step(rig, s, no_faults())
    return rig


@pytest.mark.parametrize("kill_step", [0, 1], ids=["first-step", "later-step"])
@pytest.mark.parametrize(
    "name",
    [
        "sgd-dampening",
        "nadam",
        "rmsprop",
        "adam-amsgrad",
        "adagrad",
        "muon",
        "adafactor",
        "adamw-mixed-dtypes",
        "muon+adamw",
        "lion-user-class",
    ],
)
def test_every_kill_point_finishes_exactly(name: str, kill_step: int) -> None:
    """A kill at every chunk boundary, mid-chunk (the chunk's bytes scribbled), inside the
    parity update and the flush, then H1 lost pages per group: recovery and one more step
    equal the fault-free run. The first step is where torch creates lazily initialised state
    (the PRESENT byte is in the undo copy)."""
    ref = _reference(name, ERASURE)
    n_chunks = len(ref.updater(no_faults()).chunks)
    actions = set()
    for point, chunk in _points(n_chunks):
        rig = _build(name)
        for s in range(kill_step):
            _step(rig, s, no_faults())
        with pytest.raises(Killed):
            _step(rig, kill_step, kill_at(kill_step, point, chunk))
        actions.add(_recover(rig, kill_step, erase_per_group=ERASURE.tier1_parity))
        assert rig.marker.step == kill_step + 1 and rig.marker.phase == Phase.IDLE
        for s in range(kill_step + 1, 3):
            _step(rig, s, no_faults())
        assert torch.equal(rig.state, ref.state), (
            f"{name}: diverged after a kill at {point} {chunk}"
        )
        for g, r in zip(rig.protected.groups, ref.protected.groups, strict=True):
            assert torch.equal(g.tier1, r.tier1) and torch.equal(g.tier2, r.tier2)
    assert {"restore+finish", "resume+finish", "flush"} <= actions


def test_a_kill_mid_chunk_without_erasure_finishes_exactly() -> None:
    ref = _reference("sgd-dampening", None)
    for chunk in range(len(ref.updater(no_faults()).chunks)):
        rig = _build("sgd-dampening", None)
        with pytest.raises(Killed):
            _step(rig, 0, kill_at(0, "optimizer", chunk))
        assert _recover(rig, 0, erase_per_group=0) == "restore+finish"
        for s in (1, 2):
            _step(rig, s, no_faults())
        assert torch.equal(rig.state, ref.state)


def test_without_the_present_byte_a_restored_first_step_diverges() -> None:
    """The mechanism the kill tests rely on: if the first step's restore left SGD's
    momentum buffer bound (as zeros) instead of absent, the finished step is wrong."""
    ref = _reference("sgd-dampening", None)
    rig = _build("sgd-dampening", None)
    with pytest.raises(Killed):
        _step(rig, 0, kill_at(0, "optimizer", 0))
    up = rig.updater(no_faults())
    up.prepare()
    flag = rig.layout.optim[0][PRESENT].view(rig.state)
    assert int(flag) == 0, "the undo copy restores the byte"
    flag.fill_(1)
    up.resume(0)
    for s in (1, 2):
        _step(rig, s, no_faults())
    assert not torch.equal(rig.state, ref.state)


def test_state_the_optimizer_holds_at_retain_is_kept_and_checked() -> None:
    """A script that loads an optimizer state dict before ``retain()``: the slots start from
    it (step counters at 1, not 0), the updates continue it as torch would, and a kill whose
    resume checks those counters against the marker (step 0) finishes exactly."""

    def loaded(net: nn.Module) -> torch.optim.Optimizer:
        opt = OPTIMIZERS["nadam"](net)
        opt.load_state_dict(held)
        return opt

    torch.manual_seed(5)
    ref_net = _net("nadam")
    ref_opt = OPTIMIZERS["nadam"](ref_net)
    ref_params = [p for g in ref_opt.param_groups for p in g["params"]]
    for p in ref_params:
        p.grad = torch.randn_like(p)
    ref_opt.step()  # the state a checkpoint would hold
    held = copy.deepcopy(ref_opt.state_dict())

    def build() -> Rig:
        return Rig.build(
            copy.deepcopy(ref_net), erasure=ERASURE, chunk_bytes=CHUNK, optimizer=loaded
        )

    plain, killed = build(), build()
    for step in range(2):
        plain.set_grads(seed=100 + step)
        for p, slot in zip(ref_params, plain.layout.grads, strict=True):
            p.grad = slot.view(plain.grads).clone()
        torch.nn.utils.clip_grad_norm_(ref_params, 1.0)
        for g in ref_opt.param_groups:
            g["lr"] = LRS[step]
        ref_opt.step()
        _step(plain, step, no_faults())
    for p, slot, oslots in zip(ref_params, plain.layout.params, plain.layout.optim, strict=True):
        assert torch.equal(_bits(slot.view(plain.state)), _bits(p))
        assert float(oslots["step"].view(plain.state)) == 3.0
        for key, t in ref_opt.state[p].items():
            assert torch.equal(_bits(oslots[key].view(plain.state)), _bits(t)), key
    with pytest.raises(Killed):
        _step(killed, 0, kill_at(0, "optimizer", 1))
    assert _recover(killed, 0, erase_per_group=ERASURE.tier1_parity) == "restore+finish"
    _step(killed, 1, no_faults())
    assert torch.equal(killed.state, plain.state)


@pytest.mark.parametrize("corrupt", ["counter", "present"])
def test_retained_state_that_contradicts_the_marker_refuses_the_resume(corrupt: str) -> None:
    """What a rebuild from lagging parity would leave: a step counter off by one against the
    chunks the marker says committed, or a PRESENT byte that is neither 0 nor 1."""
    rig = _build("nadam", None)
    _step(rig, 0, no_faults())
    with pytest.raises(Killed):
        _step(rig, 1, kill_at(1, "boundary", 2))  # chunks 0 and 1 committed
    first = rig.updater(no_faults()).chunks[0].pieces[0].param
    key, value = ("step", 1.0) if corrupt == "counter" else (PRESENT, 3)
    rig.layout.optim[first][key].view(rig.state).fill_(value)
    with pytest.raises(UnrecoverableStateError, match="contradict the update marker"):
        _recover(rig, 1, erase_per_group=0)


# -- the snapshot path's sequence ---------------------------------------------------------------
class _Snapshot:
    """``RetainedState``'s snapshot update over a rig's memory: the optimizer's params are
    views of the state region; snapshot, bind, ``optimizer.step()``, adopt."""

    def __init__(self, name: str) -> None:
        self.rig = rig = _build(name, None)
        self.params = [p for g in rig.opt.param_groups for p in g["params"]]
        for p, pslot, gslot in zip(self.params, rig.layout.params, rig.layout.grads, strict=True):
            torch.utils.swap_tensors(p, nn.Parameter(pslot.view(rig.state)))
            p.grad = gslot.view(rig.grads)
        self.slots = StateSlots(rig.opt.state, self.params, rig.layout.optim, rig.state)
        self.slots.capture()
        self.snapshot = rig.state.clone()

    def step(self, step: int, *, kill: bool = False) -> None:
        rig = self.rig
        rig.set_grads(seed=100 + step)
        _clip(rig)
        self.snapshot.copy_(rig.state)
        for g in rig.opt.param_groups:
            g["lr"] = LRS[step]
        self.slots.read_flags()
        self.slots.bind()
        rig.opt.step()
        self.slots.adopt(range(len(self.params)))
        if kill:  # the state is torn; a promoted trainer restores the snapshot and steps again
            rig.state.copy_(torch.randint(0, 256, rig.state.shape, dtype=torch.uint8))
            rig.state.copy_(self.snapshot)
            self.step(step)


@pytest.mark.parametrize("name", ["sgd-dampening", "nadam", "adagrad", "muon", "adamw-fused"])
def test_snapshot_path_equals_the_optimizers_own_step_and_recovers(name: str) -> None:
    params, opt = _torch_reference(name, 3)
    for killed_step in (None, 0, 1):
        snap = _Snapshot(name)
        for s in range(3):
            snap.step(s, kill=s == killed_step)
        for p, slot, oslots in zip(
            params, snap.rig.layout.params, snap.rig.layout.optim, strict=True
        ):
            assert torch.equal(_bits(slot.view(snap.rig.state)), _bits(p)), (
                f"{name}, kill at {killed_step}"
            )
            for key, t in opt.state[p].items():
                assert torch.equal(_bits(oslots[key].view(snap.rig.state)), _bits(t)), (
                    f"{name}: {key}"
                )


# -- refusals, at plan time ---------------------------------------------------------------------
class _GlobalNormSGD(torch.optim.SGD):
    """Scales every update by the global gradient norm: stepping parameters separately differs."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad) for p in params])
        )
        for p in params:
            p.add_(p.grad, alpha=-float(self.param_groups[0]["lr"]) / float(norm))
        return None


class _CountingSGD(torch.optim.SGD):
    """Keeps a Python int in its state: nothing Leto can hold in retained memory."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["calls"] = self.state[p].get("calls", 0) + 1
        return super().step(closure)


class _RowSGD(torch.optim.SGD):
    """Keeps a statistic whose shape does not follow the parameter's."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["flat"] = p.grad.reshape(-1)[:1].clone()
        return super().step(closure)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda n: torch.optim.LBFGS(n.parameters()), "without a closure"),
        (lambda n: torch.optim.SparseAdam(n.parameters()), "dense retained gradients"),
        (lambda n: _CountingSGD(n.parameters(), lr=0.1), "'calls' as int, not a tensor"),
        (lambda n: _RowSGD(n.parameters(), lr=0.1), "not following the parameter's shape"),
    ],
)
def test_state_leto_cannot_retain_is_refused_when_the_layout_is_planned(
    make: Factory, message: str
) -> None:
    net = model()
    with pytest.raises(ConfigError, match=message):
        Layout.plan(list(net.parameters()), [], make(net))


def test_an_update_that_couples_parameters_is_refused_under_rmu_only() -> None:
    net = model()
    layout = Layout.plan(list(net.parameters()), [], _GlobalNormSGD(net.parameters(), lr=0.1))
    assert layout.rule.kind == "torch" and not layout.rule.separable  # snapshot steps it whole
    with pytest.raises(ConfigError, match="couples parameters.*use consistency: snapshot"):
        buffer_bytes(layout, layout.state_bytes, CHUNK, None)


def test_adam_amsgrad_is_planned_at_retain_and_the_fused_kernel_is_adamw_only() -> None:
    rig = _build("adam-amsgrad")
    assert rig.layout.rule.kind == "torch" and "max_exp_avg_sq" in rig.layout.optim[0]
    chunks = plan_chunks(rig.layout, CHUNK, 64, rig.state.numel())
    assert all(
        p.lo == 0 and p.hi == s.numel()
        for c in chunks
        for p in c.pieces
        for s in [rig.layout.params[p.param].view(rig.state)]
    )
    with pytest.raises(ConfigError, match="rmu_fused"):
        rig.fused = True
        rig.updater(no_faults())
