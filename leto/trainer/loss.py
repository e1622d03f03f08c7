"""The loss a step reports in its ``step_done``, read without making the host wait.

Reading a device loss (``float(loss)``) when a step ends waits for the device to finish the
step: the device then idles while the host prepares the next one, every step. On CUDA the
loss is therefore copied to page-locked memory on the current stream, right after the
compute phase that produced it, and reported one step late: step ``n``'s ``step_done``
carries ``prev_loss``, step ``n - 1``'s loss, whose copy ran while the device worked on
step ``n``. Only the last step of ``steps(total)`` waits for its own loss (``loss``), as
the job ends there. On CPU there is nothing to wait for: ``loss`` is the step's own.

A consumer finds step ``s``'s loss in ``s``'s ``loss`` or in ``s + 1``'s ``prev_loss``
(``leto.summary.losses``). A promoted trainer's first step has no ``prev_loss``: its
predecessor's last loss was not retained.
"""

from __future__ import annotations

import torch

Staged = tuple[torch.Tensor, "torch.cuda.Event | None"]
"""A loss on its way to the host: the tensor to read, and the event its copy recorded."""


class LossReport:
    """Turns each step's loss into its ``step_done`` fields (``loss``, ``prev_loss``)."""

    def __init__(self, device: torch.device, *, defer: bool | None = None) -> None:
        """``defer`` (default: on CUDA) reports each loss one step late."""
        self.defer = device.type == "cuda" if defer is None else defer
        cuda = device.type == "cuda"
        self._slots = [
            torch.zeros((), dtype=torch.float32, pin_memory=cuda) for _ in range(2 if cuda else 0)
        ]
        self._next = 0
        self._current: Staged | None = None
        """This step's loss, staged by :meth:`stage`."""
        self._previous: Staged | None = None
        """The previous step's, not yet reported (deferred)."""

    def stage(self, loss: torch.Tensor | float | None) -> None:
        """The step's loss as its compute phase left it (None: the script passed none). Call
        at the start of ``RetainedState.step``, so the copy is queued ahead of the update."""
        if loss is not None and not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float(loss))  # a number the script read itself
        if loss is None:
            self._current = None
        elif not self.defer:
            self._current = (loss.detach(), None)
        else:
            self._current = self._copy(loss.detach().float().reshape(()))

    def fields(self, *, last: bool) -> dict[str, float | None]:
        """The ``step_done`` loss fields of the step staged last; ``last``: the loop's last
        step, which reads its own loss."""
        current, self._current = self._current, None
        if not self.defer:
            return {"loss": None if current is None else _read(current)}
        previous, self._previous = self._previous, current
        out: dict[str, float | None] = {"loss": None}
        if previous is not None:
            out["prev_loss"] = _read(previous)
        if last and current is not None:
            out["loss"], self._previous = _read(current), None
        return out

    def _copy(self, value: torch.Tensor) -> Staged:
        if value.device.type != "cuda":
            return value.clone(), None
        slot, self._next = self._slots[self._next], 1 - self._next
        slot.copy_(value, non_blocking=True)  # read a step later: long landed by then
        event = torch.cuda.Event()
        event.record()
        return slot, event


def _read(staged: Staged) -> float:
    value, copied = staged
    if copied is not None:
        copied.synchronize()
    return float(value)
