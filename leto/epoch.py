"""The recovery epoch: how every node's agent learns of a failure and answers it alike.

For each transition out of trainer generation ``g`` there is exactly one record, the key
``epoch/{g+1}`` (``leto.contract.epoch``) in the job's store (the per-attempt worker store
every agent shares; it works the same under c10d, static or etcd rendezvous, and needs no
``num_nodes_waiting``).
The agent that sees a failure first publishes it with ``compare_set``; a node that sees a
failure of its own at the same time gets the first record back, so all nodes act on one
decision:

* ``in_place`` — every agent stops its actives and promotes its shadows (generation g+1);
* ``restart``  — every agent stops its workers and takes torchrun's group restart, after
  which trainers load the newest checkpoint.

A node that cannot follow an ``in_place`` record (its shadows died) publishes a ``cold``
``in_place`` record for the next generation, which the others, now at g+1, see and follow.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal, TypeVar

import torch.distributed as dist

from leto import contract
from leto.errors import StoreLostError

logger = logging.getLogger(__name__)

Action = Literal["in_place", "restart"]
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EpochRecord:
    """One recovery decision, as stored (JSON) under ``epoch/{epoch}``."""

    epoch: int
    """The generation the job moves to (``in_place``) or that is abandoned (``restart``)."""
    action: Action
    failure: str
    """The failure class (``leto.health.FailureClass`` value) that caused it."""
    node: int
    """Group rank of the agent that published it."""
    ranks: dict[str, int] = field(default_factory=dict)
    """Failed global ranks → exit code (negative: signal)."""
    root_ranks: list[int] = field(default_factory=list)
    reason: str = ""
    detected_t: float = 0.0
    cold: bool = False
    """``in_place`` with a cold generation: every node closes the shadows it has and starts
    fresh trainers that attach to the retained state at once (some node had no shadows)."""
    fresh: bool = False
    """``restart`` before every rank's state was retained: not counted against
    ``--max-restarts`` (``leto_run.policy.Action.FRESH_START``)."""


class EpochBoard:
    """Publishes and polls recovery records in the job's store."""

    def __init__(self, store: dist.Store, where: str) -> None:
        self._store = store
        self._where = where

    def publish(self, record: EpochRecord) -> EpochRecord:
        """Publish ``record`` unless one exists for its epoch; returns the record that won."""
        payload = json.dumps(asdict(record))
        got = self._call(lambda: self._store.compare_set(contract.epoch(record.epoch), "", payload))
        return _decode(got)

    def poll(self, epoch: int) -> EpochRecord | None:
        """The record for ``epoch`` if one has been published (never blocks)."""
        key = contract.epoch(epoch)
        if not self._call(lambda: self._store.check([key])):
            return None
        return _decode(self._call(lambda: self._store.get(key)))

    def check(self, keys: list[str]) -> bool:
        """Whether every key is set (any other job-wide flag: fatal reports, shadow readiness)."""
        return bool(self._call(lambda: self._store.check(keys)))

    def wait(self, epoch: int, timeout_s: float, interval_s: float = 0.02) -> EpochRecord | None:
        """Poll for the record of ``epoch`` for up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            record = self.poll(epoch)
            if record is not None or time.monotonic() >= deadline:
                return record
            time.sleep(interval_s)

    def _call(self, op: Callable[[], T]) -> T:
        try:
            return op()
        except dist.DistError as e:
            raise StoreLostError(self._where, e) from None


def _decode(raw: bytes | str) -> EpochRecord:
    data = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    return EpochRecord(**data)
