"""Byte layout of a rank's retained model state: parameters, optimizer state, RNG.

Everything a resumed trainer needs to continue bit-identically lives in one flat
"state" region (so one snapshot copy and one digest cover it), gradients in a second
"grads" region. Offsets are aligned so each slice can be viewed as its own dtype.

An integration with its own contiguous gradient buffers (Megatron's
``DistributedDataParallel``) passes a ``GradPlacement`` instead: the gradients then live
where its buffers put them, one retained region per buffer, and each parameter's gradient
is its ``main_grad`` view there. With a sharded optimizer (Megatron's distributed
optimizer) the "parameters" of the layout are this rank's shards (its fp32 main params), and
the full model parameters live in ``mirror_regions``: retained but unprotected, since they
are rebuilt from every rank's committed shards after each update and at each resume.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from leto.errors import ConfigError
from leto.retained.optim_state import UpdateRule, optimizer_state
from leto.retained.slot import Slot, element_size

ALIGN = 64


@dataclass(frozen=True, slots=True)
class GradPlacement:
    """Gradients placed by an integration's own buffers instead of Leto's "grads" region."""

    regions: tuple[tuple[str, int], ...]
    """(region name, bytes) of every gradient buffer, in the order the integration allocates them."""
    slots: tuple[tuple[int, int], ...]
    """Per parameter (the optimizer's order): (index into ``regions``, byte offset)."""

    def __post_init__(self) -> None:
        names = [name for name, _ in self.regions]
        if len(set(names)) != len(names) or "grads" in names or "state" in names:
            raise ConfigError(
                f"gradient regions need unique names other than 'grads' and 'state': {names}"
            )


@dataclass(frozen=True, slots=True)
class Layout:
    """Slots of every retained tensor; ``digest`` identifies the layout for reattach checks."""

    params: tuple[Slot, ...]
    buffers: tuple[Slot, ...]
    frozen: tuple[Slot, ...]
    """The model's parameters outside the optimizer (frozen: ``requires_grad=False``, e.g.
    a fine-tuned model's base under LoRA adapters), after everything the update writes:
    retained so a successor finds them, never copied per step or written by the update."""
    grads: tuple[Slot, ...]
    """Each parameter's gradient, at an offset of its region ``grad_region``."""
    grad_scale: Slot | None
    """A float32 scalar after the gradients of Leto's "grads" region: the factor the fused
    update multiplies every gradient by (the clipping coefficient), retained and protected
    with the gradients it scales so that a finishing update applies the one every rank
    applied. None where an integration placed the gradients."""
    grad_present: Slot | None
    """One word per parameter after ``grad_scale``, in the gradients' dtype (float32 when
    they have several): 0 where no rank's backward produced the parameter's gradient this
    step, so the update skips it as torch's optimizers do; and one more, set once the step
    counters may differ between parameters (``leto.retained.presence``).
    Inside the "grads" region, so the gradients' all-reduce carries it. None where an
    integration placed the gradients."""
    optim: tuple[dict[str, Slot], ...]
    """Each parameter's optimizer state (``leto.retained.optim_state``: found by running the
    optimizer, with its ``PRESENT`` byte when torch creates the state lazily)."""
    rule: UpdateRule
    """How the optimizer state is updated: Leto's element-wise AdamW or the optimizer's own step."""
    rng: Slot
    state_bytes: int
    grad_regions: tuple[tuple[str, int], ...]
    """(name, bytes) of the gradient regions: ("grads", n) unless an integration placed them."""
    grad_region: tuple[str, ...]
    """Per parameter: the name of the region its gradient lives in."""
    mirror_regions: tuple[tuple[str, int], ...]
    """(name, bytes) of an integration's full parameter buffers, derived from the state
    (the distributed optimizer's all-gather): retained, unprotected, not updated by the RMU."""
    main_grad: bool
    """Gradients are the integration's ``param.main_grad`` buffers (filled by its backward
    hooks), not ``param.grad``; ``.grad`` points at them only for clipping and the update."""
    digest: int

    @property
    def grad_bytes(self) -> int:
        """Bytes of every gradient region together."""
        return sum(n for _, n in self.grad_regions)

    @classmethod
    def plan(
        cls,
        params: list[torch.nn.Parameter],
        buffers: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        rng_bytes: int | None = None,
        grads: GradPlacement | None = None,
        mirror: tuple[tuple[str, int], ...] = (),
        sharding: str = "",
        frozen: tuple[torch.nn.Parameter, ...] = (),
    ) -> Layout:
        """``rng_bytes``: size of the retained RNG blob (default: the CPU generator's state);
        ``grads``: gradient placement of an integration's buffers (default: Leto's "grads");
        ``mirror``: (name, bytes) of its full parameter buffers, when ``params`` are shards;
        ``sharding``: what else a reattaching trainer must match when ``params`` are local
        shards (FSDP2: the mesh and the global shapes, ``leto.trainer.sharding``); ``frozen``:
        the model's parameters outside the optimizer (:attr:`frozen`)."""
        rule, state_keys = optimizer_state(optimizer, params)
        cursor = 0
        param_slots, optim_slots = [], []
        for p in params:
            param_slots.append(Slot(cursor, tuple(p.shape), p.dtype))
            cursor = _align(cursor + param_slots[-1].nbytes)
        buffer_slots = []
        for b in buffers:  # module buffers: on a meta-device rebuild they have no values
            buffer_slots.append(Slot(cursor, tuple(b.shape), b.dtype))
            cursor = _align(cursor + buffer_slots[-1].nbytes)
        for p, keys in zip(params, state_keys, strict=True):
            slots = {}
            for key in keys:
                slots[key.name] = Slot(cursor, key.shape(p.shape), key.dtype)
                cursor = _align(cursor + slots[key.name].nbytes)
            optim_slots.append(slots)
        rng = Slot(cursor, (rng_bytes or torch.get_rng_state().numel(),), torch.uint8)
        cursor = _align(cursor + rng.nbytes)
        frozen_slots = []
        for f in frozen:
            frozen_slots.append(Slot(cursor, tuple(f.shape), f.dtype))
            cursor = _align(cursor + frozen_slots[-1].nbytes)
        state_bytes = cursor
        cursor, grad_slots = 0, []
        if grads is None:
            for p in params:
                grad_slots.append(Slot(cursor, tuple(p.shape), p.dtype))
                cursor = _align(cursor + grad_slots[-1].nbytes)
            grad_scale: Slot | None = Slot(cursor, (), torch.float32)
            cursor = _align(cursor + grad_scale.nbytes)
            dtypes = {p.dtype for p in params}
            word = dtypes.pop() if len(dtypes) == 1 else torch.float32
            grad_present: Slot | None = Slot(cursor, (len(params) + 1,), word)
            cursor = _align(cursor + grad_present.nbytes)
            grad_regions, grad_region = (("grads", cursor),), ("grads",) * len(params)
        else:
            grad_scale = grad_present = None
            grad_regions, grad_region = grads.regions, _place_grads(params, grads, grad_slots)
        described_keys = (
            tuple(k.name for k in state_keys[0])
            if rule.kind == "adamw" and state_keys
            else [[(k, s.shape, str(s.dtype)) for k, s in o.items()] for o in optim_slots]
        )
        description = repr(
            (
                type(optimizer).__name__,
                described_keys,
                [(s.shape, str(s.dtype)) for s in param_slots + buffer_slots],
            )
        )
        if frozen_slots:
            description += repr(("frozen", [(s.shape, str(s.dtype)) for s in frozen_slots]))
        description += sharding
        if grads is not None:  # a job must reattach with the gradient placement it started with
            description += repr((grad_regions, [s.offset for s in grad_slots]))
        if mirror:
            names = [name for name, _ in mirror]
            if (
                len(set(names)) != len(names)
                or {"state", "grads"} & set(names)
                or set(names) & set(dict(grad_regions))
            ):
                raise ConfigError(f"mirror regions need unique names of their own: {names}")
            description += repr(("mirror", tuple(mirror)))
        digest = int.from_bytes(
            hashlib.blake2b(description.encode(), digest_size=8).digest(), "little"
        )
        return cls(
            params=tuple(param_slots),
            buffers=tuple(buffer_slots),
            frozen=tuple(frozen_slots),
            grads=tuple(grad_slots),
            grad_scale=grad_scale,
            grad_present=grad_present,
            optim=tuple(optim_slots),
            rule=rule,
            rng=rng,
            state_bytes=state_bytes,
            grad_regions=tuple(grad_regions),
            grad_region=tuple(grad_region),
            mirror_regions=tuple(mirror),
            main_grad=grads is not None,
            digest=digest - (1 << 64) if digest >= 1 << 63 else digest,
        )


def _place_grads(
    params: list[torch.nn.Parameter], grads: GradPlacement, out: list[Slot]
) -> tuple[str, ...]:
    """Fill ``out`` with each parameter's slot in its region; returns the region names."""
    if len(grads.slots) != len(params):
        raise ConfigError(
            f"the gradient placement has {len(grads.slots)} slots for {len(params)} parameters"
        )
    names = []
    for p, (index, offset) in zip(params, grads.slots, strict=True):
        name, nbytes = grads.regions[index]
        slot = Slot(offset, tuple(p.shape), p.dtype)
        if offset < 0 or offset + slot.nbytes > nbytes or offset % element_size(p.dtype):
            raise ConfigError(
                f"gradient slot at byte {offset} ({slot.nbytes} bytes) does not fit region {name}"
            )
        out.append(slot)
        names.append(name)
    return tuple(names)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
