"""What the step loop asks of an updater, whichever consistency mode makes the update safe.

Two implementations: ``leto.updater.rmu.ResumableUpdater`` (``consistency: rmu``, chunk
transactions) and ``leto.updater.snapshot.SnapshotUpdater`` (``consistency: snapshot``, a
host copy of the state before the optimizer steps it). Each says which retained buffers it
needs (``buffers``, a classmethod: the trainer maps them before building the updater); from
then on the trainer drives both through this interface alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from leto.erasure import ProtectionGroup
    from leto.retained.marker import Phase


@dataclass(frozen=True, slots=True)
class Buffer:
    """A retained region an updater works in, besides the state and gradient regions."""

    name: str
    nbytes: int
    host: bool = False
    """Host memory (a memfd region); else a device region on the model's device."""


class Updater(Protocol):
    """Applies one step's optimizer update to the retained state crash-consistently."""

    @property
    def grad_scale(self) -> torch.Tensor | None:
        """The retained float32 scalar this updater multiplies every gradient by as it reads
        it (``Layout.grad_scale``): the trainer writes the clipping coefficient there, or 1,
        before GRADS_READY, instead of scaling the gradients in place. None: the gradients
        must arrive scaled."""
        ...

    def run(
        self, step: int, skipped: frozenset[int] = frozenset(), rng: torch.Tensor | None = None
    ) -> None:
        """Apply step ``step``'s update from GRADS_READY; ends at IDLE(step + 1), leaving
        the ``skipped`` parameters (no gradient on any rank, ``leto.retained.presence``)
        as they are. A finishing update (:meth:`resume`) reads them from retained memory.
        ``rng``: a page-locked copy of the retained ``rng_next`` bytes, which the update
        installs without the host waiting for the device (None: ``rng_next`` itself, a
        host region the copy from which waits, as a finishing update reads it)."""
        ...

    def join(self) -> None:
        """Order the next marker write after what the last update left running."""
        ...

    def drain(self) -> None:
        """After the job's last update: wait until everything it left running has landed."""
        ...

    def lendable(self) -> dict[str, torch.Tensor]:
        """Device buffers idle outside the update, which the compute phase may borrow."""
        ...

    def unprotected_needs(self, phase: Phase) -> tuple[str, ...]:
        """This updater's buffers that a resume from ``phase`` reads and nothing protects:
        a lost page of one leaves no consistent state to resume from."""
        ...

    def prepare(self) -> None:
        """After a failure, before lost pages are rebuilt: bring the state to where the
        parity that ``rebuild_groups`` names describes it."""
        ...

    def rebuilds_state(self, phase: Phase) -> bool:
        """Whether lost pages of the state region must be rebuilt before resuming from
        ``phase`` (False where the resume restores the whole region itself)."""
        ...

    def rebuild_groups(self, phase: Phase) -> list[ProtectionGroup] | None:
        """The protection groups to rebuild lost state data from in ``phase``; None: the
        region's own host parity."""
        ...

    def resume(self, step: int) -> str:
        """Finish step ``step``'s interrupted update from the marker's phase (after
        :meth:`prepare` and the rebuild); returns how, for the ``resumed`` event."""
        ...
