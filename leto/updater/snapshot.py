"""``consistency: snapshot`` (the paper's §5.1 strawman, kept as the baseline).

After ``GRADS_READY`` and the barrier: copy the whole state region to a host snapshot, mark
``UPDATING``, step torch's optimizer in place over the retained parameters, commit
(``IDLE(t+1)``). A kill in ``UPDATING`` is finished by restoring the snapshot and stepping
again; before it, the state was never written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from leto.erasure import ProtectionGroup
from leto.erasure.protection import ProtectedRegion
from leto.errors import UnrecoverableStateError
from leto.faults import FaultInjector
from leto.retained.layout import Layout
from leto.retained.marker import Marker, Phase
from leto.retained.optim_state import StateSlots, recorded_lr
from leto.retained.presence import GradPresence
from leto.updater.base import Buffer

SNAPSHOT = "snapshot"
"""The host region holding the state region's bytes from before the update."""


class SnapshotUpdater:
    """Applies torch's optimizer step to the retained state behind a host snapshot."""

    def __init__(
        self,
        *,
        layout: Layout,
        state: torch.Tensor,
        snapshot: torch.Tensor,
        rng_next: torch.Tensor,
        optimizer: torch.optim.Optimizer,
        slots: Callable[[], StateSlots],
        marker: Marker,
        protected: ProtectedRegion | None,
        injector: FaultInjector,
        fence: Callable[[], None],
        presence: GradPresence | None = None,
    ) -> None:
        """``state`` / ``snapshot`` / ``rng_next``: flat uint8 views of retained regions (the
        snapshot as large as the state). ``slots``: the optimizer state's retained slots,
        bound with the parameters after this updater is built. ``fence``: waits until the
        device's writes to retained memory have landed. ``presence``: the retained record
        of the parameters a step skips (no gradient on any rank)."""
        self.state, self.snapshot, self.rng_next = state, snapshot, rng_next
        self.optimizer, self.slots, self.marker = optimizer, slots, marker
        self.protected, self.injector, self.fence = protected, injector, fence
        self._rng = layout.rng.view(state)
        self.presence = presence
        self._skipped: frozenset[int] = frozenset()

    grad_scale = None
    """``optimizer.step()`` reads the gradients as clipping left them."""

    @classmethod
    def buffers(cls, state_nbytes: int) -> list[Buffer]:
        """The host snapshot of a state region of ``state_nbytes``."""
        return [Buffer(SNAPSHOT, state_nbytes, host=True)]

    def run(
        self, step: int, skipped: frozenset[int] = frozenset(), rng: torch.Tensor | None = None
    ) -> None:
        """``rng`` is not needed: the snapshot path waits for the device anyway (fences)."""
        self._skipped = skipped
        self.snapshot.copy_(self.state)
        self.fence()
        self.marker.advance(Phase.UPDATING)
        self._apply(step)

    def join(self) -> None:
        """Nothing runs past an update's commit."""

    def drain(self) -> None:
        """Nothing runs past an update's commit."""

    def lendable(self) -> dict[str, torch.Tensor]:
        return {}  # the snapshot is host memory

    def unprotected_needs(self, phase: Phase) -> tuple[str, ...]:
        return ()

    def prepare(self) -> None:
        """The snapshot is restored when the update is finished (``resume``)."""

    def rebuilds_state(self, phase: Phase) -> bool:
        return phase != Phase.UPDATING  # the snapshot restores the whole region

    def rebuild_groups(self, phase: Phase) -> list[ProtectionGroup] | None:
        return None

    def resume(self, step: int) -> str:
        self._skipped = self.presence.retained_skipped() if self.presence else frozenset()
        phase = self.marker.phase
        if phase == Phase.UPDATING:
            self.state.copy_(self.snapshot)  # idempotent: the snapshot is intact
            self._apply(step)
            return "restore+finish"
        if phase == Phase.GRADS_READY:
            self.run(step, self._skipped)
            return "finish"
        raise UnrecoverableStateError(  # an RMU phase in a snapshot marker
            f"step {step}'s update cannot be finished from {phase.name}: its gradients were "
            "never final under consistency: snapshot"
        )

    def _apply(self, step: int) -> None:
        """Torch's step at the recorded lrs, the step's RNG installed, the parity re-encoded,
        then the commit."""
        for group, lr in zip(self.optimizer.param_groups, self.marker.recorded_lrs(), strict=True):
            group["lr"] = recorded_lr(group["lr"], lr)
        slots = self.slots()
        slots.read_flags()  # a restored snapshot (or checkpoint) may have changed them
        slots.bind()
        held = {i: slots.params[i].grad for i in self._skipped}
        for i in held:  # torch's optimizers leave out a parameter without a gradient
            slots.params[i].grad = None
        try:
            self.optimizer.step()
        finally:
            for i, grad in held.items():
                slots.params[i].grad = grad
        slots.adopt(range(len(slots.params)))  # state torch created lazily, into its slots
        self._rng.copy_(self.rng_next)
        if self.protected is not None:
            self.protected.encode()
        self.injector.point("update")
        self.fence()
        self.marker.advance(Phase.IDLE, step + 1)
