"""Plain data parallelism's gradient mean, overlapped with backward as DDP overlaps it.

Leto averages the gradients over the ranks in retained memory (the flat "grads" region)
before the update. Reduced in one all-reduce after backward, the whole reduction is in
every step's critical path; DDP instead launches a bucket's all-reduce as soon as backward
has produced every gradient in it, so most of the communication hides behind the rest of
backward. :class:`BucketedMean` does the same over the retained region:

* buckets are contiguous ranges of the region, about ``BUCKET_BYTES`` each, cut at the
  gradients' slots from the last parameter to the first (backward produces the last
  layers' gradients first), launched in that order on every rank, each once all of its
  gradients have landed (``leto.trainer.grad_landing``) and every bucket before it is
  launched, so every rank issues the same collectives in the same order;
* a bucket that cannot be launched during backward (a parameter without a gradient this
  step, zeroed by ``settle`` after backward; a parameter outside autograd) is launched in
  ``finish``, inside ``state.step()``, with the rest of the region (the presence words);
* at the end of each backward the launched buckets are waited for (on CUDA the current
  stream waits, the host does not), so nothing writes a gradient being reduced.

A step may run several backward passes (gradient accumulation): only the last one's
gradients are final. The buckets are launched during the pass the previous step says is
the last (``expected``: its passes, retained in the marker for a promoted trainer, so a
recovered step reduces as the fault-free one did); where a later pass comes after all,
it accumulates onto averaged buckets, and ``finish`` averages the whole region again:
the mean of (a mean every rank holds + this rank's later gradients) is the mean of all of
them. The arithmetic of each element is the same whether its bucket was launched during
backward or in ``finish`` (the same bucket, the same reduction), so a step re-run after a
failure reduces bit for bit as the fault-free run did.

NCCL averages in the collective (``ReduceOp.AVG``); gloo sums, and the launched buckets
are divided by the group's size once waited for. Over gloo the trainer launches every
bucket in ``finish``: on a CPU the ranks' compute and gloo's threads share the cores, and
overlapping them did not make a step faster (``bench/dp_overlap.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from leto.trainer.grad_sync import GradSync

BUCKET_BYTES = 25 << 20
"""A bucket's size, as DDP's ``bucket_cap_mb`` default."""


@dataclass(slots=True)
class _Bucket:
    view: torch.Tensor
    params: range
    """The parameters whose gradient slots it covers."""
    needed: int = 0
    """Of those, the ones whose gradient lands by backward (hooked)."""
    left: int = 0
    """Of those, the ones not landed yet in this backward pass."""


class BucketedMean:
    """The mean all-reduce of the flat gradient region, in buckets overlapping backward."""

    def __init__(
        self,
        grads: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        tail: torch.Tensor,
        sync: GradSync,
        *,
        overlap: bool,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        """``grads``: the region's gradient part, one dtype, flat; ``spans[i]``: parameter
        ``i``'s element range in it, in order, contiguous (padding included); ``tail``: the
        rest of the region, reduced in ``finish``; ``overlap``: launch buckets during
        backward (else all in ``finish``, the same reductions)."""
        self.sync, self.tail, self.overlap = sync, tail, overlap
        self.size = sync.size()
        nccl = dist.get_backend(sync.group) == "nccl"
        self.op = dist.ReduceOp.AVG if nccl else dist.ReduceOp.SUM
        self._divide = not nccl
        self.buckets: list[_Bucket] = []
        self.bucket_of = [0] * len(spans)
        end = len(spans)
        cap = max(1, bucket_bytes // grads.element_size())
        for i in reversed(range(len(spans))):
            first_elem = spans[i][0]
            if spans[end - 1][1] - first_elem >= cap or i == 0:
                self.buckets.append(_Bucket(grads[first_elem : spans[end - 1][1]], range(i, end)))
                end = i
        for b, bucket in enumerate(self.buckets):
            for i in bucket.params:
                self.bucket_of[i] = b
        self.expected = 0
        """Backward passes of the step that the buckets are launched in the last of."""
        self.passes = 0
        self._next = 0
        self._works: list[dist.Work] = []
        self._undivided: list[torch.Tensor] = []
        self._stale = False

    def hooked(self, hooked: Sequence[bool]) -> None:
        """Which parameters' gradients land by backward (the others' buckets wait for ``finish``)."""
        for bucket in self.buckets:
            bucket.needed = sum(1 for i in bucket.params if hooked[i])
        self._rearm()

    def _rearm(self) -> None:
        """A backward pass starts: every bucket waits for all its gradients."""
        for bucket in self.buckets:
            bucket.left = bucket.needed

    def begin(self) -> None:
        """At the step's start: nothing launched, no backward pass yet."""
        self.passes, self._next, self._stale = 0, 0, False
        self._works, self._undivided = [], []
        self._rearm()

    @property
    def launched(self) -> bool:
        """Whether this step launched a collective (a retry of the compute phase would not
        be matched by the other ranks)."""
        return self._next > 0

    @property
    def overlapping(self) -> bool:
        """Whether this backward pass launches buckets (the one expected to be the last)."""
        return self.overlap and self.passes + 1 == self.expected

    def landed(self, i: int) -> None:
        """Parameter ``i``'s gradient is in its view for this backward pass."""
        if not self.overlapping:
            return
        bucket = self.buckets[self.bucket_of[i]]
        bucket.left -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].left <= 0:
            self._launch(self.buckets[self._next].view)
            self._next += 1

    def landed_late(self, i: int) -> None:
        """Parameter ``i``'s gradient landed after backward (a parameter unfrozen since the
        job began): where its bucket was launched without it, every bucket is reduced again."""
        if self.bucket_of[i] < self._next:
            self._stale = True

    def end_of_backward(self) -> None:
        """Once a backward pass has run every hook: what it launched is waited for."""
        self._wait()
        self.passes += 1
        if self.passes > self.expected and self._next > 0:
            self._stale = True  # a later pass accumulates onto averaged buckets
        self._rearm()

    def finish(self) -> int:
        """Inside ``state.step()``, after absent gradients are zeroed and the presence words
        written: reduce what backward did not (every bucket again where a pass came after
        the launches), and the tail; wait. Returns the step's backward passes, the next
        step's ``expected``."""
        if self._stale:
            self._next = 0
        for bucket in self.buckets[self._next :]:
            self._launch(bucket.view)
        self._next = len(self.buckets)
        self._launch(self.tail)
        self._wait()
        self.expected = self.passes
        return self.passes

    def _launch(self, view: torch.Tensor) -> None:
        self._works.append(dist.all_reduce(view, op=self.op, group=self.sync.group, async_op=True))
        if self._divide:
            self._undivided.append(view)

    def _wait(self) -> None:
        for work in self._works:
            work.wait()
        if self._undivided:
            torch._foreach_div_(self._undivided, self.size)
        self._works, self._undivided = [], []
