"""Stateful objects retained with the step: LR schedulers, optimizer hyperparameters, loaders.

Besides tensors, a training script holds small objects whose state a resumed trainer needs:
the optimizer's param-group hyperparameters (lr, betas, weight decay: a fresh process builds
them at their initial values), LR schedulers attached to the optimizer (found on their own,
:func:`attached_schedulers`), and whatever the user names (``ctx.retain(...,
stateful={"loader": dl})``: anything with ``state_dict()`` / ``load_state_dict()``, torch's
``Stateful`` protocol). Their ``state_dict()`` is serialized (``pickle``) into retained
host memory twice per step:

* ``BEGIN(t)`` at the start of step t (``RetainedState.steps``): everything step t-1 did,
  including the script's code after ``state.step()`` (``scheduler.step()``);
* ``PRE(t)`` in ``state.step()`` of step t before ``GRADS_READY``: the script's code of step t
  up to the commit (the batch fetched from a loader), and the hyperparameters its update uses.

A resume at step s restores ``BEGIN(s)`` when this rank wrote it. Otherwise the rank died
after its update of s-1 began, before step s (inside the update, or in the script's code
after ``state.step()``): it restores ``PRE(s-1)`` — the finishing update reads its
hyperparameters from there — and then replays what the script did after ``state.step()`` of
s-1, from what the previous steps showed (each ``PRE`` record carries, per object, how many
steps were observed and in how many the object changed between ``PRE(t)`` and
``BEGIN(t+1)``, and whether it changed before the commit of this step):

* an LR scheduler that changed after ``state.step()`` in every observed step is stepped once,
  where one ``step()`` tried on a copy from its state at the commit reproduced every observed
  change (a scheduler stepped twice, or with an epoch, ``step(epoch + i / iters)``, is not
  replayable); one that never changed there is not stepped; on the job's first step (nothing
  observed yet) it is stepped unless it was stepped before ``state.step()`` (torch's order:
  ``scheduler.step()`` after ``optimizer.step()``); a ``ReduceLROnPlateau`` is stepped with
  the loss the script gave ``state.step(loss=...)`` (``PRE`` carries it), tried alike;
* a named ``AveragedModel`` (an EMA of the weights) whose every observed step changed it by
  one ``update_parameters`` call over the retained model after the commit is updated so
  once more, over the finished update's parameters;
* anything else (a scheduler stepped after the commit on some steps only, two schedulers to
  replay in an unknown order, a ``ReduceLROnPlateau`` stepped with another metric or before
  any step was observed (a warning names the first as soon as a step shows it), a user object or
  hyperparameters changed after ``state.step()``, a user object whose first step's behaviour
  was not seen) raises ``UnrecoverableStateError`` naming the object: the checkpoint path
  takes over rather than a resume on wrong state.

Records live in a ring of ``SLOTS`` slots of a retained host region, each with a sequence
number, step, kind, length and checksum; a write goes to the oldest slot, so a torn write
never destroys a newer good record. On a GPU the host may run ahead of the device, and a
resume follows the marker as it landed: before a record is overwritten the trainer waits
for the marker to pass what a resume from that record needs (:meth:`Record.needed_until`,
``Marker.wait_landed``). Three records of each kind let the host run about two steps ahead
before it waits. A resume at step s discards the records of the failed trainer's steps
beyond s (its host ran ahead of the device there): the steps are run again, and a later
resume must never read those.
"""

from __future__ import annotations

import copy
import enum
import gc
import hashlib
import io
import logging
import pickle
import random
import struct
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.optim.swa_utils import AveragedModel

from leto.errors import ConfigError, UnrecoverableStateError
from leto.retained.marker import Phase
from leto.trainer import loaders

if TYPE_CHECKING:
    from leto.retained.marker import Marker
    from leto.trainer.memory import RegionMemory

logger = logging.getLogger(__name__)

STATE_LIMIT_BYTES = 64 << 20
"""Largest serialized state Leto retains for the stateful objects together (they are meant
to be small: schedulers, loader positions, counters)."""
OPTIMIZER = "optimizer"
"""The name of the optimizer's param-group hyperparameters among the retained objects."""
SCHEDULER_PREFIX = "lr_scheduler."

HEADER_BYTES = 64
_HEADER = struct.Struct("<QQqQQ16s")  # magic, seq, step, kind, length, checksum
_MAGIC = 0x4C45544F_58540002  # "LETO" "XT" v2 (v1: two slots)
SLOTS = 6
"""Record slots in the ring: three records of each kind (``BEGIN`` and ``PRE`` alternate)."""


class Capture(enum.IntEnum):
    """When a record was taken: at the start of its step, or just before its commit."""

    BEGIN = 1
    PRE = 2


@dataclass(frozen=True, slots=True)
class Record:
    seq: int
    step: int
    kind: Capture
    payload: bytes

    def needed_until(self) -> tuple[Phase, int]:
        """The marker write a resume from this record needs until it has landed:
        ``BEGIN(u)`` re-runs step u until its gradients are final (``GRADS_READY`` at u),
        ``PRE(u)`` finishes u's update until it commits (``IDLE`` at u + 1)."""
        if self.kind == Capture.BEGIN:
            return Phase.GRADS_READY, self.step
        return Phase.IDLE, self.step + 1


def _checksum(seq: int, step: int, kind: int, payload: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack("<QqQQ", seq, step, kind, len(payload)))
    h.update(payload)
    return h.digest()


class RecordSlots:
    """A ring of ``SLOTS`` record slots in one retained host region (uint8 CPU tensor)."""

    def __init__(self, region: torch.Tensor) -> None:
        self._mem = region.numpy()
        self.capacity = (region.numel() - SLOTS * HEADER_BYTES) // SLOTS
        if self.capacity <= 0:
            raise ValueError(f"a record region of {region.numel()} bytes holds no record")
        self._seqs = [-1] * SLOTS
        """Each slot's sequence number (-1: empty or invalid), as read and as written."""
        for slot, record in self.read():
            self._seqs[slot] = record.seq

    @staticmethod
    def region_bytes(capacity: int) -> int:
        return SLOTS * (HEADER_BYTES + capacity)

    def _offset(self, slot: int) -> int:
        return slot * (HEADER_BYTES + self.capacity)

    def _read(self, slot: int) -> Record | None:
        off = self._offset(slot)
        magic, seq, step, kind, length, checksum = _HEADER.unpack(
            self._mem[off : off + _HEADER.size].tobytes()
        )
        if magic != _MAGIC or length > self.capacity or kind not in (Capture.BEGIN, Capture.PRE):
            return None
        payload = self._mem[off + HEADER_BYTES : off + HEADER_BYTES + length].tobytes()
        if _checksum(seq, step, kind, payload) != checksum:
            return None
        return Record(seq, step, Capture(kind), payload)

    def read(self) -> list[tuple[int, Record]]:
        """(slot, record) of every slot holding a complete record (checksum verified)."""
        records = ((slot, self._read(slot)) for slot in range(SLOTS))
        return [(slot, record) for slot, record in records if record is not None]

    def next_slot(self) -> tuple[int, Record | None]:
        """The slot the next write goes to (an empty or invalid one, else the oldest) and
        the record it holds."""
        slot = min(range(SLOTS), key=self._seqs.__getitem__)
        return slot, None if self._seqs[slot] < 0 else self._read(slot)

    def write(self, slot: int, record: Record) -> None:
        """Invalidate ``slot``'s header, write the payload, then the header."""
        if len(record.payload) > self.capacity:
            raise ValueError(
                f"a {len(record.payload)}-byte record does not fit a {self.capacity}-byte slot"
            )
        off = self._offset(slot)
        self._mem[off : off + 8] = 0
        self._seqs[slot] = -1
        n = len(record.payload)
        self._mem[off + HEADER_BYTES : off + HEADER_BYTES + n] = memoryview(record.payload)
        header = _HEADER.pack(
            _MAGIC,
            record.seq,
            record.step,
            record.kind,
            n,
            _checksum(record.seq, record.step, record.kind, record.payload),
        )
        self._mem[off + 8 : off + _HEADER.size] = memoryview(header)[8:]
        self._mem[off : off + 8] = memoryview(header)[:8]  # the magic last
        self._seqs[slot] = record.seq

    def discard(self, slot: int) -> None:
        self._mem[self._offset(slot) : self._offset(slot) + 8] = 0
        self._seqs[slot] = -1


REGION = "extras"
DEFAULT_SLOT_BYTES = 1 << 20
"""Bytes of each record slot unless ``ctx.retain(..., stateful_bytes=)`` says."""


def map_records(
    memory: RegionMemory, slot_capacity: int, marker: Marker | None = None
) -> RecordStore:
    """The rank's record region: made with ``slot_capacity`` bytes per slot by the first
    trainer (before its marker is initialised: the marker records which regions the state
    consists of), reattached at whatever size it has by its successors. ``marker``: the
    rank's, whose landing each overwrite waits for (``RecordStore``)."""
    if not 0 < slot_capacity <= STATE_LIMIT_BYTES:
        raise ConfigError(
            f"stateful_bytes must be in (0, {STATE_LIMIT_BYTES}], got {slot_capacity}"
        )
    spec = memory.pool.describe(memory.rank, REGION)
    nbytes = spec.nbytes if spec is not None else RecordSlots.region_bytes(slot_capacity)
    return RecordStore(memory.host_region(REGION, nbytes)[0], marker)


class RecordStore:
    """The retained records of one rank. With ``marker`` (a stream-ordered one: the host may
    be ahead of it), a record is overwritten only once the marker has landed past what a
    resume from it needs (:meth:`Record.needed_until`)."""

    def __init__(self, region: torch.Tensor, marker: Marker | None = None) -> None:
        self.region = region
        """The whole region (the fatal-failure checkpoint saves and loads it as it is)."""
        self.marker = marker
        self.reload()

    def reload(self) -> None:
        self.slots = RecordSlots(self.region)
        self.seq = max((r.seq for r in self.records()), default=0)

    @property
    def capacity(self) -> int:
        return self.slots.capacity

    def records(self) -> list[Record]:
        return [r for _, r in self.slots.read()]

    def find(self, kind: Capture, step: int) -> Record | None:
        """The newest complete record of ``kind`` for ``step``."""
        found = [r for r in self.records() if r.kind == kind and r.step == step]
        return max(found, key=lambda r: r.seq, default=None)

    def latest(self, kind: Capture) -> Record | None:
        return max((r for r in self.records() if r.kind == kind), key=lambda r: r.seq, default=None)

    def write(self, step: int, kind: Capture, payload: bytes) -> None:
        if len(payload) > self.capacity:
            raise ConfigError(
                f"the stateful objects' state is {len(payload)} bytes, more than the {self.capacity} "
                "bytes a record slot holds: pass a larger ctx.retain(..., stateful_bytes=N) "
                f"(at most {STATE_LIMIT_BYTES >> 20} MiB)"
            )
        slot, victim = self.slots.next_slot()
        if victim is not None and self.marker is not None:
            self.marker.wait_landed(*victim.needed_until())
        self.seq += 1
        self.slots.write(slot, Record(self.seq, step, kind, payload))

    def discard_beyond(self, step: int) -> None:
        """Drop the records a resume at ``step`` makes stale: ``BEGIN`` after it, ``PRE``
        from it on (a failed trainer's host ran those steps ahead of its device; they run
        again and must never be read for the new run of them)."""
        for slot, r in self.slots.read():
            if r.step > step or (r.kind == Capture.PRE and r.step == step):
                self.slots.discard(slot)


Kind = Literal["optimizer", "scheduler", "averaged", "stateful"]


class GeneratorState:
    """A random generator named in ``stateful=`` (torch's ``Generator``, NumPy's
    ``Generator`` or ``RandomState``, Python's ``random.Random``), read and set through
    torch's ``Stateful`` protocol, which they do not follow: a script that draws its data
    from one it made itself names it, and a recovery draws what the failed trainer drew."""

    KINDS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        g = self.generator
        if isinstance(g, torch.Generator):
            return {"state": g.get_state()}
        if isinstance(g, np.random.Generator):
            return {"state": g.bit_generator.state}
        return {"state": g.get_state() if isinstance(g, np.random.RandomState) else g.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        g, value = self.generator, state["state"]
        if isinstance(g, torch.Generator):
            g.set_state(value)
        elif isinstance(g, np.random.Generator):
            g.bit_generator.state = value
        elif isinstance(g, np.random.RandomState):
            g.set_state(value)
        else:
            g.setstate(value)


@dataclass(slots=True)
class Tracked:
    """One retained object and how its state is read and written."""

    name: str
    kind: Kind
    obj: Any

    def state(self) -> bytes:
        if self.kind == "optimizer":
            value: Any = [
                {k: v for k, v in g.items() if k != "params"} for g in self.obj.param_groups
            ]
        else:
            value = self.obj.state_dict()
        try:  # pickle: a twentieth of torch.save's cost, twice a step
            return _dumps(value)
        except Exception as e:  # noqa: BLE001 - any serialization failure is the same user error
            raise ConfigError(
                f"cannot serialize the state of {self.name} ({type(self.obj).__name__}) for "
                f"retention: {e}"
            ) from None

    def load(self, data: bytes) -> None:
        # written by this job, into its own memory (torch.save's zip format: older records)
        value = (
            torch.load(io.BytesIO(data), weights_only=False)
            if data[:2] == b"PK"
            else pickle.loads(data)
        )
        if self.kind != "optimizer":
            self.obj.load_state_dict(value)
            return
        groups = self.obj.param_groups
        if len(value) != len(groups):
            raise UnrecoverableStateError(
                f"the retained optimizer had {len(value)} param groups, this one has {len(groups)}"
            )
        for group, saved in zip(groups, value, strict=True):
            group.update(saved)


def _materialize(module: torch.nn.Module, model: torch.nn.Module) -> None:
    """Give ``module``'s meta tensors storage on the retained model's device: a shadow builds
    its model on the meta device, so an ``AveragedModel`` copied from it has no data until
    its retained state is loaded into it. Tensors with data stay where they are."""
    device = next((p.device for p in model.parameters() if not p.is_meta), None)
    if device is None:
        return
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if p.is_meta:
                real = torch.empty_like(p, device=device)
                setattr(m, name, torch.nn.Parameter(real, requires_grad=p.requires_grad))
        for name, b in list(m.named_buffers(recurse=False)):
            if b is not None and b.is_meta:
                keep = name not in m._non_persistent_buffers_set
                m.register_buffer(name, torch.empty_like(b, device=device), persistent=keep)


def _tensor_from(data: bytes, dtype: str, shape: tuple[int, ...], device: str) -> torch.Tensor:
    """A tensor pickled by :func:`_dumps`."""
    raw = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )
    return raw.view(getattr(torch, dtype)).reshape(shape).to(device)


class _Pickler(pickle.Pickler):
    """Plain tensors as their bytes, dtype, shape and device: the same state pickles to the
    same bytes in every process (torch's own reduction goes through ``torch.save``, whose
    archive differs from process to process), so a capture compares and digests by value."""

    def reducer_override(self, obj: Any) -> Any:
        if (
            type(obj) is not torch.Tensor
            or obj.layout != torch.strided
            or obj.is_quantized
            or obj.is_meta
        ):
            return NotImplemented  # torch's own reduction
        t = obj.detach().contiguous()
        data = t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
        dtype = str(t.dtype).removeprefix("torch.")
        return _tensor_from, (data, dtype, tuple(t.shape), str(t.device))


def _dumps(value: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return out.getvalue()


class CannotReplay(UnrecoverableStateError):
    """What the script did after ``state.step()`` cannot be redone; ``names``: the objects."""

    def __init__(self, names: list[str], message: str) -> None:
        super().__init__(message)
        self.names = names


class _Hyperparameters:
    """The optimizer as a scheduler's trial step sees it: the groups' hyperparameters, which
    the step reads and writes, so the trial leaves the real optimizer alone."""

    def __init__(self) -> None:
        self.param_groups: list[dict[str, Any]] = []
        self._opt_called = True  # the update ran before the step tried

    def step(self) -> None:  # what a scheduler checks it wrapped (never called)
        raise AssertionError("a trial scheduler step stepped the optimizer")

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]


def attached_schedulers(
    optimizer: torch.optim.Optimizer, frozen: Sequence[LRScheduler] = ()
) -> list[LRScheduler]:
    """The LR schedulers built on ``optimizer`` (those inside a ``SequentialLR`` or
    ``ChainedScheduler`` are part of it: its state dict holds theirs). ``frozen``: those
    :func:`freeze_heap` found, which the scan of the unfrozen heap no longer sees."""
    found = [
        r
        for r in gc.get_referrers(optimizer)
        if isinstance(r, LRScheduler) and getattr(r, "optimizer", None) is optimizer
    ]
    found += [
        s
        for s in frozen
        if getattr(s, "optimizer", None) is optimizer and all(s is not f for f in found)
    ]
    inner = {id(s) for r in found for s in getattr(r, "_schedulers", ())}
    return [s for s in found if id(s) not in inner]


def freeze_heap(optimizer: torch.optim.Optimizer) -> list[LRScheduler]:
    """A shadow, once it said it is ready and before it waits: the schedulers built on
    ``optimizer``, then every object that exists moved out of the collector's sight
    (``gc.freeze``: constant time; garbage frozen with the rest is collected once it is
    unfrozen).

    Finding schedulers scans every object the collector tracks (``gc.get_referrers``:
    25-50 ms with torch, dynamo and transformers loaded), and a promoted trainer does it
    twice on the recovery's path (when ``steps()`` starts and at its second step). Frozen,
    its heap is only what the script builds after ``retain()`` returns; what was there
    before is the returned list. :meth:`RetainedExtras` unfreezes once its scans are done.
    """
    found = attached_schedulers(optimizer)
    for part in getattr(optimizer, "parts", ()):  # a ChainedOptimizer's: discover() refuses them
        found += attached_schedulers(part)
    gc.freeze()
    return found


def _digest(states: Mapping[str, bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(states):
        h.update(
            struct.pack("<Q", len(name)) + name.encode() + struct.pack("<Q", len(states[name]))
        )
        h.update(states[name])
    return h.hexdigest()


class RetainedExtras:
    """Captures, restores and replays the stateful objects of one rank (module docstring)."""

    def __init__(
        self,
        store: RecordStore,
        optimizer: torch.optim.Optimizer,
        named: Mapping[str, Any] | None,
        rank: int,
        frozen: Sequence[LRScheduler] | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        """``frozen``: the schedulers :func:`freeze_heap` found (None: the heap is not frozen);
        ``model``: the retained model, which a named ``AveragedModel`` is replayed over."""
        self.store = store
        self.optimizer = optimizer
        self.rank = rank
        self.model = model
        self._by_model: dict[str, int] = {}
        """Per ``AveragedModel``: steps whose change after the commit was one
        ``update_parameters`` call over the retained model (what a recovery can redo)."""
        self._averaged_calls: dict[str, list[bool]] = {}
        """Per ``AveragedModel``: its ``update_parameters`` calls since the last ``PRE``
        capture, each True where it averaged the retained model."""
        self._tracked: dict[str, Tracked] = {OPTIMIZER: Tracked(OPTIMIZER, "optimizer", optimizer)}
        for name, obj in (named or {}).items():
            if isinstance(obj, GeneratorState.KINDS):
                obj = GeneratorState(obj)
            if name == OPTIMIZER or name.startswith(SCHEDULER_PREFIX):
                raise ConfigError(f"stateful name {name!r} is reserved: choose another")
            if not loaders.is_stateful(obj):
                raise ConfigError(
                    f"stateful object {name!r} ({type(obj).__name__}) has no state_dict() / "
                    "load_state_dict(): leto retains objects that follow torch's Stateful protocol"
                )
            kind: Kind = (
                "scheduler"
                if isinstance(obj, LRScheduler)
                else "averaged"
                if isinstance(obj, AveragedModel)
                else "stateful"
            )
            self._tracked[name] = tracked = Tracked(name, kind, obj)
            if isinstance(obj, torch.nn.Module) and model is not None:
                _materialize(obj, model)  # a shadow's copy of its meta model
            if kind == "averaged":
                self._watch_averaging(name, obj)
            if (size := len(tracked.state())) > STATE_LIMIT_BYTES:
                raise ConfigError(
                    f"stateful object {name!r} serializes to {size >> 20} MiB, more than the "
                    f"{STATE_LIMIT_BYTES >> 20} MiB leto retains; retain only small objects"
                )
        self._history: dict[str, tuple[int, int]] = {}
        """Per object: (steps observed, steps in which it changed after the commit)."""
        self._by_step: dict[str, int] = {}
        """Per LR scheduler: steps whose change after the commit one ``step()`` reproduces
        (a ``ReduceLROnPlateau``'s with the loss given to ``state.step(loss=...)``;
        :meth:`_reproduced`)."""
        self._trials: dict[str, tuple[Any, _Hyperparameters]] = {}
        """Per LR scheduler: its copy over a stand-in optimizer, for :meth:`_reproduced`."""
        self._pre_loss: float | None = None
        """The loss given with the last ``PRE`` capture (host float; None: none given)."""
        self._pre_flags: dict[str, bool] = {}
        """Which objects changed before the last ``PRE`` capture (its ``pre`` field)."""
        self._warned: set[str] = set()
        """Objects already named by :meth:`_warn_if_unreplayable`."""
        self._last_begin: dict[str, bytes] | None = None
        self._loaded: dict[str, bytes] = {}
        """Objects restored since the last capture, as loaded (``_states``)."""
        self._last_pre: dict[str, bytes] | None = None
        self._wrapped = False
        self._discoveries = 0
        self._resumed_at: int | None = None
        """The step this trainer resumed at from a record (None: it started the job)."""
        self._loader_scans_left = 2
        """Steps at whose start to look for a DataLoader a recovery would restart (the first
        two: an iterator may be built in the first); none once a warning named one."""
        self._frozen = frozen
        self.commit_digest = ""
        """Digest of the objects at the last commit (its ``PRE`` record), for ``emit_digest``."""

    def _watch_averaging(self, name: str, obj: AveragedModel) -> None:
        """Count ``obj.update_parameters`` calls and whether each averaged the retained model:
        torch's loop calls it after ``optimizer.step()``, so a recovery that finishes the
        update redoes it only where every observed step did exactly that."""
        average = obj.update_parameters
        calls = self._averaged_calls.setdefault(name, [])

        def update_parameters(model: torch.nn.Module) -> None:
            calls.append(model is self.model)
            average(model)

        obj.update_parameters = update_parameters  # type: ignore[method-assign]

    # -- discovery ---------------------------------------------------------------------------
    def discover(self) -> None:
        """Track the LR schedulers attached to the optimizer (when ``steps()`` starts: a
        shadow's script builds them after ``retain()``, which it waits in)."""
        self._discoveries += 1
        self._wrapped = bool(getattr(self.optimizer.step, "_wrapped_by_lr_sched", False))
        for i, part in enumerate(getattr(self.optimizer, "parts", ())):  # a ChainedOptimizer
            on_part = attached_schedulers(part, self._frozen or ())
            if on_part:
                raise ConfigError(
                    f"{type(on_part[0]).__name__} is built on part {i} of the ChainedOptimizer "
                    "leto retains, so leto cannot retain it: build it on the ChainedOptimizer "
                    "(LambdaLR takes one function per parameter group)"
                )
        known = {id(t.obj) for t in self._tracked.values()}
        found = [
            s for s in attached_schedulers(self.optimizer, self._frozen or ()) if id(s) not in known
        ]
        for s in found:
            name = SCHEDULER_PREFIX + type(s).__name__
            if name in self._tracked:
                raise ConfigError(
                    f"two {type(s).__name__} schedulers on the retained optimizer: name them, "
                    "ctx.retain(model, opt, stateful={'warmup': s1, 'decay': s2})"
                )
            if self._discoveries > 1:
                raise ConfigError(
                    f"{type(s).__name__} on the retained optimizer was built after state.steps() "
                    "began, so leto cannot retain it: build it before the training loop"
                )
            self._tracked[name] = Tracked(name, "scheduler", s)

    def _name_unretained_loaders(self) -> None:
        """At the first two steps this trainer begins (an iterator may be built in the first):
        warn, once, of a live DataLoader iterator no named object holds
        (``leto.trainer.loaders``), whose batches restart after a recovery."""
        if self._loader_scans_left == 0:
            return
        self._loader_scans_left -= 1
        named = [t.obj for t in self._tracked.values() if t.kind == "stateful"]
        found = loaders.unretained_loader_iterators(named)
        if not found:
            return
        self._loader_scans_left = 0
        what = loaders.describe(found[0]) + (
            f" and {len(found) - 1} more" if len(found) > 1 else ""
        )
        if self._resumed_at is None:
            consequence = (
                "after a recovery the promoted trainer's loader starts again from its first "
                "batch, and the job trains on other data than a run without failures"
            )
        else:
            consequence = (
                f"this trainer resumed at step {self._resumed_at}, but that loader started "
                "again from its first batch: from here on the job trains on other data than "
                "a run without failures"
            )
        logger.warning(
            "rank %d: %s is not retained by leto: %s. Name a torchdata StatefulDataLoader "
            "(or its sampler, or a position) in ctx.retain(..., stateful=...), or draw each "
            "batch by step",
            self.rank,
            what,
            consequence,
        )

    def _check_discovery(self) -> None:
        """Once more at the second step, and whenever a scheduler is first attached: a
        scheduler built inside the loop is an error, never a silent loss at recovery."""
        wrapped = bool(getattr(self.optimizer.step, "_wrapped_by_lr_sched", False))
        if self._discoveries == 1 and self._last_pre is not None or wrapped != self._wrapped:
            self.discover()

    def _unfreeze_once_scanned(self) -> None:
        """A promoted trainer's heap, frozen by its shadow (:func:`freeze_heap`), goes back
        to the collector once the planned scans are done: the second scheduler discovery and
        both loader scans (after it, a loader scan would walk the whole heap: tens of ms)."""
        if self._frozen is not None and self._discoveries > 1 and self._loader_scans_left == 0:
            gc.unfreeze()
            self._frozen = None

    # -- captures ----------------------------------------------------------------------------
    def _states(self) -> dict[str, bytes]:
        """Every object's serialized state; an object restored since the last capture and not
        touched by Leto since is not asked again: its state is what was loaded. (Asking would
        not be harmless: a ``StatefulDataLoader`` builds its iterator to answer, before the
        script's ``set_epoch``.)"""
        states = {name: self._loaded.get(name) or t.state() for name, t in self._tracked.items()}
        self._loaded = {}
        return states

    def begin(self, step: int) -> None:
        """Capture ``BEGIN(step)``: the state after all of the previous step."""
        if self._discoveries == 0:
            self.discover()
        self._name_unretained_loaders()
        self._check_discovery()
        self._unfreeze_once_scanned()
        states = self._states()
        if self._last_pre is not None:  # what changed between the previous commit and now
            self._account(self._last_pre, states)
            self._last_pre = None
            self._warn_if_unreplayable(step - 1)
        self._last_begin = states
        self._write(step, Capture.BEGIN, states, digest=self.commit_digest)

    @property
    def wants_loss(self) -> bool:
        """A ``ReduceLROnPlateau`` is retained: :meth:`before_commit` wants the step's loss
        as a host float (reading it waits for the device), to replay that scheduler."""
        return any(isinstance(t.obj, ReduceLROnPlateau) for t in self._tracked.values())

    def before_commit(self, step: int, loss: float | None = None) -> None:
        """Capture ``PRE(step)``, just before the step's commit begins; ``loss``: the loss
        the script gave ``state.step()``, where :attr:`wants_loss`."""
        states = self._states()
        begin = self._last_begin or {}
        pre = {name: data != begin.get(name) for name, data in states.items()}
        self.commit_digest = _digest(states)
        self._last_pre, self._pre_flags = states, pre
        self._pre_loss = loss
        for calls in self._averaged_calls.values():
            calls.clear()  # what follows the commit is what a recovery would redo
        self._write(step, Capture.PRE, states, digest=self.commit_digest, pre=pre, loss=loss)

    def _account(self, pre: dict[str, bytes], now: dict[str, bytes]) -> None:
        scheduled = any(now[n] != pre[n] for n, t in self._tracked.items() if t.kind == "scheduler")
        for name, t in self._tracked.items():
            changed = now[name] != pre.get(name)
            if t.kind == "optimizer":  # a scheduler's own writes are replayed with it
                changed = changed and not scheduled
            seen, post = self._history.get(name, (0, 0))
            self._history[name] = (seen + 1, post + changed)
            if changed and t.kind == "scheduler" and self._reproduced(t, pre, now):
                self._by_step[name] = self._by_step.get(name, 0) + 1
            if changed and t.kind == "averaged" and self._averaged_calls[name] == [True]:
                self._by_model[name] = self._by_model.get(name, 0) + 1

    def _reproduced(self, t: Tracked, pre: dict[str, bytes], now: dict[str, bytes]) -> bool:
        """Whether one ``step()`` of the scheduler ``t`` from its state at the commit (a
        ``ReduceLROnPlateau``'s with the step's loss) ends where it and the optimizer's
        hyperparameters are now. Tried on a copy over a stand-in optimizer holding the committed
        hyperparameters, so the real ones are not touched; every observed step so reproduced is
        what lets a recovery replay the interrupted step's ``step()``."""
        plateau = isinstance(t.obj, ReduceLROnPlateau)
        if plateau and self._pre_loss is None:
            return False
        try:  # a scheduler that cannot be tried is not replayable, never an error here
            if t.name not in self._trials:
                stand_in = _Hyperparameters()
                memo: dict[int, Any] = {id(self.optimizer): stand_in}
                if self.model is not None:
                    memo[id(self.model)] = self.model  # shared, never copied
                self._trials[t.name] = (copy.deepcopy(t.obj, memo), stand_in)
            trial, stand_in = self._trials[t.name]
            stand_in.param_groups = [dict(g) for g in pickle.loads(pre[OPTIMIZER])]
            trial.load_state_dict(pickle.loads(pre[t.name]))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trial.step(self._pre_loss) if plateau else trial.step()
            return bool(
                trial.state_dict() == pickle.loads(now[t.name])
                and stand_in.param_groups == pickle.loads(now[OPTIMIZER])
            )
        except Exception:  # noqa: BLE001 - any failure of the trial means "cannot replay"
            return False

    def _accounts(self) -> dict[str, dict[str, Any]]:
        """What the steps so far showed of each object (copies), as a record carries it and
        as :meth:`_replay_plan` reads it."""
        return {
            "history": dict(self._history),
            "by_step": dict(self._by_step),
            "by_model": dict(self._by_model),
        }

    def _write(
        self,
        step: int,
        kind: Capture,
        states: dict[str, bytes],
        *,
        digest: str,
        pre: dict[str, bool] | None = None,
        loss: float | None = None,
    ) -> None:
        payload = pickle.dumps(
            {
                "objects": states,
                "kinds": {n: t.kind for n, t in self._tracked.items()},
                **self._accounts(),
                "loss": loss,
                "pre": pre or {},
                "digest": digest,
            },
            protocol=5,
        )
        if len(payload) > STATE_LIMIT_BYTES:
            largest = max(states, key=lambda n: len(states[n]))
            raise ConfigError(
                f"the stateful objects serialize to {len(payload) >> 20} MiB (largest: {largest}), "
                f"more than the {STATE_LIMIT_BYTES >> 20} MiB leto retains"
            )
        self.store.write(step, kind, payload)

    # -- restore -----------------------------------------------------------------------------
    def _load(self, record: Record) -> dict[str, Any]:
        content = pickle.loads(record.payload)
        kinds: dict[str, str] = content["kinds"]
        if set(kinds) != set(self._tracked):
            missing, extra = (
                sorted(set(kinds) - set(self._tracked)),
                sorted(set(self._tracked) - set(kinds)),
            )
            raise UnrecoverableStateError(
                f"rank {self.rank}: the failed trainer retained {missing or 'nothing more'} and not "
                f"{extra or 'nothing less'} than this one: build the same schedulers and stateful objects, before "
                "the training loop"
            )
        for name, data in content["objects"].items():
            self._tracked[name].load(data)
        self._loaded = dict(content["objects"])
        self._history = dict(content["history"])
        self._by_step = dict(content.get("by_step", {}))
        self._by_model = dict(content.get("by_model", {}))
        self.commit_digest = content["digest"]
        return content

    def load_pre(self, step: int) -> None:
        """Restore ``PRE(step)`` (a rank about to finish step ``step``'s update: the update
        reads its hyperparameters)."""
        record = self.store.find(Capture.PRE, step)
        if record is None:
            raise UnrecoverableStateError(
                f"rank {self.rank}: no retained capture of the stateful objects "
                f"before step {step}'s commit"
            )
        self._load(record)

    def resume(self, step: int) -> str:
        """Bring every object to the start of ``step``; returns which capture was used."""
        self._last_pre = self._last_begin = None
        self.store.discard_beyond(step)
        record = self.store.find(Capture.BEGIN, step)
        if record is not None:
            self._load(record)
            self._resumed_at = step
            return "begin"
        record = self.store.find(Capture.PRE, step - 1)
        if record is not None:
            self._resumed_at = step
            content = self._load(record)
            replayed = self._replay(step - 1, content)
            self._last_pre, self._pre_flags = content["objects"], content["pre"]
            self._pre_loss = content.get("loss")
            return "pre+replay" if replayed else "pre"
        if not self.store.records():  # the job's first step never began: the objects are as built
            return "none"
        raise UnrecoverableStateError(
            f"rank {self.rank}: no retained capture of the stateful objects for step {step}"
        )

    def _replay(self, step: int, content: dict[str, Any]) -> list[str]:
        """What the script did after ``state.step()`` of ``step`` (module docstring)."""
        plan = self._replay_plan(step, content)
        for calls in self._averaged_calls.values():
            calls.clear()  # the replay's own calls are the step's, as the script's were
        for t, metric in plan:
            if t.kind == "averaged":
                t.obj.update_parameters(self.model)  # over the finished update's parameters
                call, wrote = "update_parameters(model)", (t.name,)
            else:
                self.optimizer._opt_called = True  # type: ignore[attr-defined]  # the update ran: no warning
                if metric is None:
                    t.obj.step()
                else:
                    t.obj.step(metric)
                call, wrote = "step()", (t.name, OPTIMIZER)
            for changed in wrote:  # the replay wrote them: ask them again
                self._loaded.pop(changed, None)
            logger.info(
                "[rank %d step %d] replayed %s.%s after the finished update",
                self.rank,
                step,
                t.name,
                call,
            )
        return [t.name for t, _ in plan]

    def _replay_plan(
        self, step: int, content: dict[str, Any]
    ) -> list[tuple[Tracked, float | None]]:
        """The schedulers a resume after ``step``'s finished update steps, each with its
        metric (a ``ReduceLROnPlateau``'s) or None; :class:`CannotReplay` where the records
        cannot tell what the script did after ``state.step()``."""
        history, pre = content["history"], content["pre"]
        replay, averaged = [], []
        for name, t in self._tracked.items():
            seen, post = history.get(name, (0, 0))
            where = f"rank {self.rank} step {step}: {name} ({type(t.obj).__name__})"
            if t.kind == "averaged" and post:
                by_model = content.get("by_model", {}).get(name, 0)
                if post < seen or by_model < post:
                    raise CannotReplay(
                        [name],
                        f"{where} changed after state.step() in {post} of {seen} steps, "
                        f"{by_model} of them by one update_parameters() over the retained model: "
                        "call ema.update_parameters(model) once after every state.step(), or "
                        "before it",
                    )
                averaged.append(t)
            elif t.kind == "scheduler":
                if 0 < post < seen:
                    raise CannotReplay(
                        [name],
                        f"{where} was stepped after state.step() in {post} of {seen} steps, so leto cannot tell "
                        "whether this step's would have run: step it every step, or before state.step()",
                    )
                if post == seen and (seen or not pre.get(name)):
                    by_step = content.get("by_step", {}).get(name, 0)
                    if by_step < post and not isinstance(t.obj, ReduceLROnPlateau):
                        raise CannotReplay(
                            [name],
                            f"{where} changed after state.step() otherwise than by one step() in "
                            f"{post - by_step} of {post} steps (stepped twice, or with an epoch), "
                            "so leto cannot replay it: step() it once per state.step(), its "
                            "period counted in steps, or step it before state.step()",
                        )
                    replay.append(t)
            elif post:
                what = "hyperparameters were" if t.kind == "optimizer" else "state was"
                raise CannotReplay(
                    [name],
                    f"{where}: its {what} changed after state.step(), which a recovery that finishes the update "
                    "cannot redo: change it before state.step()",
                )
            elif not seen and t.kind in ("stateful", "averaged") and not pre.get(name):
                raise CannotReplay(
                    [name],
                    f"{where}: the first step's update was interrupted before leto saw whether it changes "
                    "after state.step()",
                )
        if len(replay) > 1:
            raise CannotReplay(
                [t.name for t in replay],
                f"rank {self.rank} step {step}: {', '.join(t.name for t in replay)} are stepped after state.step() in "
                "an order leto cannot know: combine them (SequentialLR, ChainedScheduler)",
            )
        return [
            (
                t,
                self._plateau_metric(step, t, content)
                if isinstance(t.obj, ReduceLROnPlateau)
                else None,
            )
            for t in replay
        ] + [(t, None) for t in averaged]

    def _warn_if_unreplayable(self, step: int) -> None:
        """After the script's code that followed ``state.step()`` of ``step``: name, once per
        object, what would make a failure inside that update end in-place recovery, so the
        script can be fixed before a failure rather than after one."""
        content = {**self._accounts(), "pre": self._pre_flags, "loss": self._pre_loss}
        try:
            self._replay_plan(step, content)
        except CannotReplay as e:
            if not self._warned.issuperset(e.names):
                self._warned.update(e.names)
                logger.warning("%s (a failure inside an update would end in-place recovery)", e)

    def _plateau_metric(self, step: int, t: Tracked, content: dict[str, Any]) -> float:
        """The metric ``t`` (a ``ReduceLROnPlateau``) was about to be stepped with: the step's
        loss, where every observed step's ``step(loss)`` reproduced its change."""
        post = content["history"].get(t.name, (0, 0))[1]
        by_step, loss = content.get("by_step", {}).get(t.name, 0), content.get("loss")
        if loss is None or not post or by_step < post:
            why = (
                "no step was observed yet"
                if not post
                else "no loss was given to state.step(loss=...)"
                if loss is None
                else f"in {post - by_step} of {post} steps its metric was not that loss"
            )
            raise CannotReplay(
                [t.name],
                f"rank {self.rank} step {step}: {t.name} is stepped after state.step() with a "
                f"metric leto cannot replay ({why}): pass that metric as state.step(loss=...), "
                "or step it before state.step()",
            )
        return loss

    # -- checkpoint --------------------------------------------------------------------------
    def reload(self) -> None:
        """After the record region was written from outside (a checkpoint loaded into it):
        read it again; ``resume`` then restores from its records (after discovery)."""
        self.store.reload()
        record = self.store.latest(Capture.PRE)
        self.commit_digest = "" if record is None else pickle.loads(record.payload)["digest"]
