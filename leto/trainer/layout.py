"""Byte layout of a rank's retained model state: parameters, optimizer state, RNG.

Everything a resumed trainer needs to continue bit-identically lives in one flat
"state" region (so one snapshot copy and one digest cover it), gradients in a second
"grads" region. Offsets are aligned so each slice can be viewed as its own dtype.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from leto.errors import ConfigError

ALIGN = 64


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor lives inside a region."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * _itemsize(self.dtype)

    def view(self, region: torch.Tensor) -> torch.Tensor:
        return region[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True, slots=True)
class Layout:
    """Slots of every retained tensor; ``digest`` identifies the layout for reattach checks."""

    params: tuple[Slot, ...]
    buffers: tuple[Slot, ...]
    grads: tuple[Slot, ...]
    optim: tuple[dict[str, Slot], ...]
    rng: Slot
    state_bytes: int
    grad_bytes: int
    digest: int

    @classmethod
    def plan(
        cls, params: list[torch.nn.Parameter], buffers: list[torch.Tensor], optimizer: torch.optim.Optimizer,
        rng_bytes: int | None = None,
    ) -> Layout:
        """``rng_bytes``: size of the retained RNG blob (default: the CPU generator's state)."""
        state_keys = optimizer_state_keys(optimizer)
        cursor = 0
        param_slots, optim_slots = [], []
        for p in params:
            param_slots.append(Slot(cursor, tuple(p.shape), p.dtype))
            cursor = _align(cursor + param_slots[-1].nbytes)
        buffer_slots = []
        for b in buffers:  # module buffers: on a meta-device rebuild they have no values
            buffer_slots.append(Slot(cursor, tuple(b.shape), b.dtype))
            cursor = _align(cursor + buffer_slots[-1].nbytes)
        for p in params:
            slots = {}
            for key in state_keys:
                shape, dtype = ((), torch.float32) if key == "step" else (tuple(p.shape), p.dtype)
                slots[key] = Slot(cursor, shape, dtype)
                cursor = _align(cursor + slots[key].nbytes)
            optim_slots.append(slots)
        rng = Slot(cursor, (rng_bytes or torch.get_rng_state().numel(),), torch.uint8)
        state_bytes = _align(cursor + rng.nbytes)
        cursor, grad_slots = 0, []
        for p in params:
            grad_slots.append(Slot(cursor, tuple(p.shape), p.dtype))
            cursor = _align(cursor + grad_slots[-1].nbytes)
        description = repr(
            (type(optimizer).__name__, state_keys, [(s.shape, str(s.dtype)) for s in param_slots + buffer_slots])
        )
        digest = int.from_bytes(hashlib.blake2b(description.encode(), digest_size=8).digest(), "little")
        return cls(
            params=tuple(param_slots),
            buffers=tuple(buffer_slots),
            grads=tuple(grad_slots),
            optim=tuple(optim_slots),
            rng=rng,
            state_bytes=state_bytes,
            grad_bytes=max(cursor, ALIGN),
            digest=digest - (1 << 64) if digest >= 1 << 63 else digest,
        )


def optimizer_state_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The per-parameter state tensors of the optimizers Leto can retain exactly."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ConfigError(
            f"leto retains Adam/AdamW state; {type(optimizer).__name__} is not supported yet"
        )
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable"):
            raise ConfigError("leto needs the foreach/for-loop Adam paths (fused=False, capturable=False)")
    amsgrad = any(g.get("amsgrad") for g in optimizer.param_groups)
    return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ())


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
