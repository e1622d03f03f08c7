"""What a ``torch.optim`` optimizer keeps per parameter, found by running it, and its binding.

Leto retains an optimizer's state in the "state" region, so it must know the state's keys,
shapes and dtypes before the first step, for any optimizer. Adam and AdamW on the paths
``leto.updater.adamw`` reproduces keep the fixed ``step`` / ``exp_avg`` / ``exp_avg_sq``
(``fused=True`` among them: Leto's AdamW, on CUDA its own fused kernel, stands in for torch's
fused kernel, the same update to float rounding);
every other optimizer (and Adam with amsgrad, maximize or capturable) is *probed*:
its own ``step()`` runs twice on tiny CPU stand-ins of the real parameters (two for each
parameter group, dimensionality and dtype), and what it leaves in ``optimizer.state`` is the
layout. Each state tensor must be a scalar or follow the parameter's shape dimension by
dimension (a dimension of the parameter's size or of size 1: Adafactor's row and column
statistics); anything else is refused at ``retain()``, as are optimizers whose step cannot
run from retained memory (it needs a closure, sparse gradients; it writes the gradients, the
parameter groups or state keyed by something other than a parameter).

The same probe, stepping each parameter alone, tells whether the update is separable: equal
bytes mean ``consistency: rmu`` may run the optimizer's own step over one chunk of parameters
at a time (``leto.updater.torch_step``); an update that couples parameters needs
``consistency: snapshot``.

Torch creates most state lazily in the first step, and not always as zeros (SGD's momentum
buffer starts as the first gradient, NAdam's ``mu_product`` at 1, Rprop's step sizes at the
learning rate), so probed optimizers get one more retained byte per parameter,
:data:`PRESENT`: 1 once the optimizer created the parameter's state (it is then bound to its
slots), 0 before (``optimizer.state[p]`` is left empty and torch initialises it itself).
The byte lives beside the state it describes and is saved, restored and checkpointed with it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from leto.errors import ConfigError, ProtocolError
from leto.retained.slot import Slot

logger = logging.getLogger(__name__)

PRESENT = "leto.present"
"""Slot key of the per-parameter byte "the optimizer has created this parameter's state"."""

ADAM_KEYS = ("step", "exp_avg", "exp_avg_sq")

_PROBE_STEPS = 2


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One state entry of a parameter: a scalar, or a tensor following the parameter's shape."""

    name: str
    dtype: torch.dtype
    dims: tuple[bool, ...] | None
    """None: a scalar; else per parameter dimension, its size (True) or 1 (False)."""

    def shape(self, param_shape: Sequence[int]) -> tuple[int, ...]:
        if self.dims is None:
            return ()
        return tuple(d if keep else 1 for d, keep in zip(param_shape, self.dims, strict=True))


@dataclass(frozen=True, slots=True)
class UpdateRule:
    """How the retained optimizer state is updated."""

    kind: Literal["adamw", "torch"]
    """adamw: Leto's own AdamW (``leto.updater.adamw``, the fused kernel), element-wise, so a
    chunk may split a parameter; torch: the optimizer's own ``step()``, whole parameters."""
    separable: bool
    """Stepping parameters separately gives the bytes of one step over all of them."""
    reason: str
    """Why the kind (and, when not separable, why not): for logs and refusals."""
    counters: frozenset[str]
    """Scalar keys that count steps (each step adds one): checked against the marker."""


def adamw_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why Leto's own AdamW cannot stand in for ``optimizer.step()`` (None: it can)."""
    name = type(optimizer).__name__
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{name} is not Adam/AdamW"
    for group in optimizer.param_groups:
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(key):
                return f"{name} with {key}=True"
        betas = group["betas"]
        if isinstance(group["lr"], torch.Tensor) or any(isinstance(b, torch.Tensor) for b in betas):
            return f"{name} with a tensor lr or betas"
    return None


_FUSED_SAID: set[str] = set()
"""Optimizer classes whose ``fused=True`` this process has reported."""


def optimizer_state(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]
) -> tuple[UpdateRule, tuple[tuple[KeySpec, ...], ...]]:
    """The update rule and, per parameter (optimizer order), the state entries to retain.

    Raises ``ConfigError`` naming the reason when the optimizer's state cannot be retained."""
    refusal = adamw_refusal(optimizer)
    dtypes = {p.dtype for p in params}
    if refusal is None and len(dtypes) > 1:  # Leto's AdamW walks one flat space of one dtype
        refusal = f"parameters of {len(dtypes)} dtypes"
    if refusal is None:
        name = type(optimizer).__name__
        if any(g.get("fused") for g in optimizer.param_groups) and name not in _FUSED_SAID:
            _FUSED_SAID.add(name)  # once a process: the shadow's rehearsal plans the same class
            logger.info(
                "%s(fused=True): Leto's AdamW runs the update (on CUDA its fused kernel), "
                "the same update to float rounding",
                name,
            )
        rule = UpdateRule(
            "adamw", True, "Adam/AdamW: leto's element-wise AdamW", frozenset({"step"})
        )
        return rule, tuple(
            (
                KeySpec("step", torch.float32, None),
                *(KeySpec(k, p.dtype, (True,) * p.dim()) for k in ADAM_KEYS[1:]),
            )
            for p in params
        )
    return _Probe(optimizer, params).run(refusal)


def unhooked_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], Any]:
    """The class's ``step`` without torch's hook wrapper: per-chunk calls must not fire the
    user's (or an LR scheduler's) step hooks, which belong to the whole step."""
    fn = type(optimizer).step
    return fn.__wrapped__ if getattr(fn, "hooked", False) else fn  # type: ignore[attr-defined]


def view_of(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    state: MutableMapping[torch.Tensor, dict[str, Any]],
) -> torch.optim.Optimizer:
    """``optimizer`` with other parameter groups and state: same class, same settings and
    attributes, no constructor run (a constructor may check or initialise parameters)."""
    view = object.__new__(type(optimizer))
    view.__dict__.update(optimizer.__dict__)
    view.param_groups = groups
    view.state = state  # type: ignore[assignment]
    return view


def subgroups(
    optimizer: torch.optim.Optimizer,
    members: Mapping[int, list[torch.Tensor]],
    lrs: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
    """Copies of the optimizer's groups ``members`` names (group index -> parameters), with
    those parameters (and, given ``lrs``, the recorded learning rates)."""
    groups = []
    for gi, ps in members.items():
        g = {**optimizer.param_groups[gi], "params": ps}
        if lrs is not None:
            g["lr"] = recorded_lr(g["lr"], lrs[gi])
        groups.append(g)
    return groups


def recorded_lr(live: float | torch.Tensor, value: float) -> float | torch.Tensor:
    """A recorded learning rate in the form its group holds one: a tensor lr stays a tensor
    of its dtype and device (torch's step computes with it there, not in double)."""
    return live.new_tensor(value) if isinstance(live, torch.Tensor) else value


class StateSlots:
    """Entries of an optimizer state mapping as views of their retained slots.

    ``state`` is ``optimizer.state`` or the updater's own mapping over its parameter views;
    ``params`` are its keys, in the layout's order. Parameters whose :data:`PRESENT` byte is
    0 are bound to an empty dict (torch initialises them in their first step, and
    :meth:`adopt` then moves what it made into the slots)."""

    def __init__(
        self,
        state: MutableMapping[torch.Tensor, Any],
        params: Sequence[torch.Tensor],
        slots: Sequence[Mapping[str, Slot]],
        region: torch.Tensor,
        seen: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """``seen(i, view)``: parameter ``i``'s state tensor as the optimizer must see it
        (an FSDP2 shard's ``DTensor``, ``leto.trainer.sharding``); default the view itself."""
        self.state, self.params = state, params
        self.views = [
            {
                k: s.view(region) if seen is None else seen(i, s.view(region))
                for k, s in o.items()
                if k != PRESENT
            }
            for i, o in enumerate(slots)
        ]
        self.flags = [o[PRESENT].view(region) if PRESENT in o else None for o in slots]
        self.lazy = any(f is not None for f in self.flags)
        self.present = [True] * len(slots)
        """Host copy of the PRESENT bytes (:meth:`read_flags`); always True without them."""

    def read_flags(self) -> list[int]:
        """Refresh :attr:`present` from retained memory (one copy); returns the raw bytes."""
        if not self.lazy:
            return [1] * len(self.flags)
        raw = torch.stack([f for f in self.flags if f is not None]).cpu().tolist()
        it = iter(raw)
        values = [next(it) if f is not None else 1 for f in self.flags]
        self.present = [v != 0 for v in values]
        return values

    def bind(self, indices: Sequence[int] | None = None) -> None:
        """Point the state of ``indices`` (default: every parameter) at its slots."""
        for i in range(len(self.params)) if indices is None else indices:
            self.state[self.params[i]] = dict(self.views[i]) if self.present[i] else {}

    def capture(self) -> None:
        """A fresh start: zero the slots, move state the optimizer already holds into them (with
        lazy state: Adagrad's, made by its constructor; Leto's AdamW starts from zeros), bind."""
        for i, p in enumerate(self.params):
            held = self.state.get(p) if self.lazy else None
            if held:
                self._take(i, held)
            else:
                for v in self.views[i].values():
                    v.zero_()
            if self.flags[i] is not None:
                self.flags[i].fill_(1 if held else 0)
            self.present[i] = bool(held) or self.flags[i] is None
        self.bind()

    def adopt(self, indices: Sequence[int]) -> list[int]:
        """After the optimizer's own step over ``indices``: move the state it created or
        replaced into the slots and mark it present; returns the parameters newly present."""
        new = []
        for i in indices:
            held = self.state.get(self.params[i])
            if not held:
                continue
            self._take(i, held)
            if not self.present[i]:
                self.flags[i].fill_(1)  # type: ignore[union-attr]
                self.present[i] = True
                new.append(i)
        return new

    def _take(self, i: int, held: dict[str, Any]) -> None:
        views = self.views[i]
        if set(held) != set(views):
            raise ProtocolError(
                f"parameter {i}'s optimizer state has keys {sorted(held)}, the layout planned at "
                f"retain() {sorted(views)}: the optimizer's state differs from its probe"
            )
        for key, t in held.items():
            v = views[key]
            if t is v:
                continue
            if not isinstance(t, torch.Tensor) or t.shape != v.shape or t.dtype != v.dtype:
                raise ProtocolError(
                    f"parameter {i}'s optimizer state {key!r} is not the planned "
                    f"{v.dtype} tensor of shape {list(v.shape)}"
                )
            v.copy_(t)
            held[key] = v


class _Probe:
    """Runs the optimizer on small stand-ins of its parameters; see the module docstring."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> None:
        self.opt, self.name = optimizer, type(optimizer).__name__
        group_of = [gi for gi, g in enumerate(optimizer.param_groups) for _ in g["params"]]
        self.classes: dict[tuple[int, int, torch.dtype], list[int]] = {}
        for i, p in enumerate(params):
            self.classes.setdefault((group_of[i], p.dim(), p.dtype), []).append(i)
        self.params = params
        gen = torch.Generator().manual_seed(0)  # the probe must not draw from the global RNG
        self.probes: list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]] = []
        """(group, initial value, initial state) of each stand-in."""
        for (gi, _, dtype), members in self.classes.items():
            real = params[members[0]]
            if not (dtype.is_floating_point or dtype.is_complex):
                raise ConfigError(
                    f"{self.name}: leto retains floating-point parameters, got {dtype}"
                )
            for extra in (2, 3):
                shape = tuple(min(d, extra + j) for j, d in enumerate(real.shape))
                self.probes.append(
                    (
                        gi,
                        torch.randn(shape, generator=gen, dtype=dtype),
                        self._existing(real, shape),
                    )
                )
        self.grads = [
            [torch.randn(x.shape, generator=gen, dtype=x.dtype) for _, x, _ in self.probes]
            for _ in range(_PROBE_STEPS)
        ]

    def _existing(self, real: torch.Tensor, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """State the optimizer already holds for ``real`` (Adagrad's, made in its constructor),
        cut to the stand-in's shape."""
        out = {}
        for key, t in self.opt.state.get(real, {}).items():
            if not isinstance(t, torch.Tensor) or (t.dim() and tuple(t.shape) != tuple(real.shape)):
                raise ConfigError(
                    f"{self.name} holds state {key!r} that is not a tensor of the parameter's "
                    "shape or a scalar; leto cannot retain it"
                )
            small = torch.zeros(shape if t.dim() else (), dtype=t.dtype)
            if not t.is_meta:
                small.copy_(t[tuple(slice(0, n) for n in shape)] if t.dim() else t)
            out[key] = small
        return out

    def _groups(self, ps: list[torch.Tensor], only: int | None = None) -> list[dict[str, Any]]:
        members: dict[int, list[torch.Tensor]] = {}
        for k, ((gi, _, _), p) in enumerate(zip(self.probes, ps, strict=True)):
            if only is None or k == only:
                members.setdefault(gi, []).append(p)
        groups = subgroups(self.opt, members)
        for g in groups:  # CPU stand-ins: options that only place state on an accelerator are off
            if g.get("capturable"):
                g["capturable"] = False
            for k, v in list(g.items()):
                if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                    g[k] = v.cpu()
        return groups

    def _steps(
        self, separately: bool
    ) -> tuple[list[torch.Tensor], dict, list[dict[int, dict[str, torch.Tensor]]]]:
        """Stand-ins after the probe steps, their state, and each step's state snapshot."""
        ps = [torch.nn.Parameter(x.clone()) for _, x, _ in self.probes]
        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for p, (_, _, existing) in zip(ps, self.probes, strict=True):
            if existing:
                state[p] = {k: v.clone() for k, v in existing.items()}
        step = unhooked_step(self.opt)
        history = []
        for s in range(_PROBE_STEPS):
            for p, g in zip(ps, self.grads[s], strict=True):
                p.grad = g.clone()
            ptrs = [p.data_ptr() for p in ps]
            calls = range(len(ps)) if separately else [None]
            for only in calls:
                groups = self._groups(ps, only)
                before = [{k: v for k, v in g.items() if k != "params"} for g in groups]
                try:
                    step(view_of(self.opt, groups, state))
                except Exception as e:  # any failure of the user's optimizer is the reason
                    raise ConfigError(
                        f"{self.name}.step() failed on small stand-ins of the parameters "
                        f"({type(e).__name__}: {e}); leto calls step() itself, without a closure, "
                        "on dense retained gradients, so this optimizer cannot be retained "
                        "(under any consistency)"
                    ) from e
                for b, g in zip(before, groups, strict=True):
                    if set(b) != set(g) - {"params"} or any(
                        not _same(v, g[k]) for k, v in b.items()
                    ):
                        raise ConfigError(
                            f"{self.name}.step() changes its parameter groups; leto retains "
                            "per-parameter tensor state only"
                        )
            if [p.data_ptr() for p in ps] != ptrs:
                raise ConfigError(
                    f"{self.name}.step() replaces parameter storage; leto needs in-place updates"
                )
            if not all(_bits_equal(p.grad, g) for p, g in zip(ps, self.grads[s], strict=True)):
                raise ConfigError(
                    f"{self.name}.step() writes the gradients; a re-run of an interrupted "
                    "update would read them changed, so leto cannot retain it"
                )
            history.append(
                {
                    k: {
                        key: v.clone() for key, v in state[p].items() if isinstance(v, torch.Tensor)
                    }
                    for k, p in enumerate(ps)
                }
            )
        return ps, state, history

    def run(self, why: str) -> tuple[UpdateRule, tuple[tuple[KeySpec, ...], ...]]:
        ps, state, history = self._steps(separately=False)
        if set(state) - set(ps):
            raise ConfigError(
                f"{self.name} keeps state that is not per parameter; leto cannot retain it"
            )
        per_class: list[tuple[KeySpec, ...]] = []
        for c in range(len(self.classes)):
            a, b = (self._keys(ps[k], state[ps[k]], history, k) for k in (2 * c, 2 * c + 1))
            if (
                a != b
            ):  # the two stand-ins differ in size: a dimension that follows one follows both
                raise ConfigError(
                    f"{self.name} keeps state whose shape does not follow the parameter's"
                )
            per_class.append(tuple(a))
        counters = self._counters(history)
        sep_ps, sep_state, _ = self._steps(separately=True)
        separable = all(_bits_equal(x, y) for x, y in zip(ps, sep_ps, strict=True)) and all(
            state[x].keys() == sep_state[y].keys()
            and all(_bits_equal(state[x][k], sep_state[y][k]) for k in state[x])
            for x, y in zip(ps, sep_ps, strict=True)
        )
        reason = f"{why}: the optimizer's own step() over whole parameters"
        if not separable:
            reason = (
                f"{self.name}'s step over parameters taken separately differs from its step "
                "over all of them (the update couples parameters)"
            )
        keys: list[tuple[KeySpec, ...]] = [()] * len(self.params)
        for c, members in enumerate(self.classes.values()):
            for i in members:
                keys[i] = (*per_class[c], KeySpec(PRESENT, torch.uint8, None))
        return UpdateRule("torch", separable, reason, counters), tuple(keys)

    def _keys(self, p: torch.Tensor, st: dict[str, Any], history: list, k: int) -> list[KeySpec]:
        out = []
        for key, t in st.items():
            if key == PRESENT:
                raise ConfigError(
                    f"{self.name} uses the state key {PRESENT!r}, which leto reserves"
                )
            if not isinstance(t, torch.Tensor):
                raise ConfigError(
                    f"{self.name} keeps {key!r} as {type(t).__name__}, not a tensor; leto retains "
                    "tensor state only"
                )
            dims = _dims(tuple(t.shape), tuple(p.shape), key, self.name)
            out.append(KeySpec(key, t.dtype, dims))
        if set(history[0][k]) != set(st):
            raise ConfigError(
                f"{self.name} changes the set of its state keys between steps; "
                "leto cannot retain it"
            )
        return out

    def _counters(self, history: list[dict[int, dict[str, torch.Tensor]]]) -> frozenset[str]:
        """Scalar keys that every stand-in advanced by exactly one in the last probe step."""
        first, last = history[-2], history[-1]
        keys = {key for st in last.values() for key, t in st.items() if t.dim() == 0}
        return frozenset(
            key
            for key in keys
            if all(
                key in first[k] and float(last[k][key]) - float(first[k][key]) == 1.0
                for k in last
                if key in last[k]
            )
        )


def _dims(
    state: tuple[int, ...], param: tuple[int, ...], key: str, name: str
) -> tuple[bool, ...] | None:
    if not state and param:
        return None
    if len(state) == len(param) and all(s in (p, 1) for s, p in zip(state, param, strict=True)):
        return tuple(s == p for s, p in zip(state, param, strict=True))
    raise ConfigError(
        f"{name} keeps {key!r} of shape {list(state)} for a parameter of shape {list(param)}: "
        "not a scalar and not following the parameter's shape; leto cannot retain it"
    )


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an uncomparable value counts as changed
        return False


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(
        a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)
    )
