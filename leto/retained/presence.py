"""Which parameters a step's update skips: those that received no gradient on any rank.

Torch's ``optimizer.zero_grad()`` (``set_to_none=True``, its default) leaves ``.grad`` None
for a parameter the step's backward never reached (an MoE expert no token was routed to, a
branch taken on some steps only, a layer dropped), and every torch optimizer then skips that
parameter: no parameter change, no moment decay, no weight decay, no step count. Leto's
gradients are retained views that always exist, so the update must be told.

Each rank writes one word per parameter into a retained slot after the gradients (1: this
rank's backward produced a gradient, 0: it did not) before the gradients' mean all-reduce,
which carries the slot with them: after it a word is 0 exactly where no rank had a gradient
(torch's DDP leaves those gradients None too). The slot is read back only on a rank that
had a parameter without a gradient: where a rank had them all, no parameter lacks one on
every rank. The slot is retained and protected with the gradients, so an update finished
after a failure skips what the interrupted one skipped.

A last word, set once any update skipped a parameter (or the state came from a checkpoint,
whose history is unknown), tells a resume that the step counters may differ between
parameters; until then it may hold them all to the same count
(``ResumableUpdater.check_counters``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class GradPresence:
    """The retained per-parameter presence words and the "counts may differ" word after
    them (``Layout.grad_present``, one word per parameter and one more)."""

    def __init__(self, words: torch.Tensor) -> None:
        self.words, self.uneven = words[:-1], words[-1:]
        self._uneven_known = False

    def attach(self) -> None:
        """At promotion (or a fresh start): what the retained last word says, so this
        process keeps saying it (a step may zero the whole gradient region first)."""
        self._uneven_known = bool(self.uneven.item() != 0)

    def mark(self, absent: Sequence[int]) -> None:
        """This rank's words for the step: 1, or 0 for the parameters in ``absent``; the
        last word again where the counts may differ."""
        self.words.fill_(1)
        for i in absent:
            self.words[i].zero_()
        if self._uneven_known:
            self.uneven.fill_(1)

    def retained_skipped(self) -> frozenset[int]:
        """The parameters the (all-reduced) retained words mark as skipped: no rank had a
        gradient for them. A read of the device."""
        return frozenset((self.words == 0).nonzero().flatten().tolist())

    def skip_all(self) -> None:
        """Every parameter skipped this step (an overflowed fp16 step), in the record."""
        self.words.zero_()
        self.note_uneven()

    def note_uneven(self) -> None:
        """Before GRADS_READY of an update that skips a parameter, and when the state is
        loaded from a checkpoint: the step counters may differ from now on (every rank
        writes the same, so the all-reduce keeps it)."""
        self.uneven.fill_(1)
        self._uneven_known = True

    def counts_may_differ(self) -> bool:
        """Whether the step counters may differ between parameters (a resume's check)."""
        self._uneven_known = bool(self.uneven.item() != 0)
        return self._uneven_known
