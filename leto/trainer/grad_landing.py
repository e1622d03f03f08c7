"""Gradients land in retained memory by one copy, not by a fill and an accumulation.

A parameter whose ``.grad`` is a view of the retained "grads" region receives its gradient
as autograd accumulates: ``grad += new``, after the region was zeroed at the step's start.
That is a fill of the whole region and an add that reads it back, three passes over the
gradients that ``optimizer.zero_grad()`` (``set_to_none=True``, torch's default) spares a
plain job. Instead each step starts with ``.grad`` unset, autograd hands the parameter its
fresh gradient, a post-accumulate hook notes it, and the gradients land by copies into
their retained views, one pass, the fresh tensors freed after. On a host-bound step each
copy's launch counts (tens of microseconds of host time each on a GPU, a step's hundreds
of gradients), so gradients wait, up to ``WAITING_BYTES``, and land together when that
much waits or backward ends (a callback on the engine): the waiting gradients whose views
are next to each other in the region (parameters in order, as a block's arrive) land by
one ``torch.cat`` into the region's bytes, the padding between them written with its
zeros; the rest by one multi-tensor copy (small ones) or a copy each. A gradient of
``WAITING_BYTES`` or more lands alone, at once. Until its copy a waiting gradient stays
the parameter's ``.grad``, so a hook of the script's after Leto's reads its value, and an
in-place change it makes lands. Later backward passes of the same step (gradient
accumulation) find the view bound and accumulate into it in place, as before.

After the compute phase, ``settle`` binds the zeroed view of every parameter that received
no gradient (what it adds to the all-reduce) and returns them: the update skips one that no
rank had a gradient for, as torch's optimizers skip a None ``.grad``
(``leto.retained.presence``). It refuses a gradient that arrived and was unset again
(``zero_grad()`` after backward): the update must never read a stale view. A parameter
frozen when the job began has no hook; once unfrozen, ``settle`` lands its first gradient
and hooks it up (gradual unfreezing).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from leto.errors import ScriptError

WAITING_BYTES = 256 << 20
"""Fresh gradients that may wait to land (the peak grows by less than twice this: a bucket
of DDP's ten times over, where DDP keeps a second copy of every gradient)."""
SMALL_GRAD_BYTES = 1 << 20
"""Waiting gradients smaller than this with no neighbour to land with share one
multi-tensor copy (which walks a large tensor on the host in blocks: larger ones are
copied each by itself)."""


class GradWrites:
    """Refuses a gradient written after backward, before ``state.step()``.

    Leto all-reduces the gradients inside ``state.step()``, where DDP has reduced them by the
    end of backward. A torchrun loop's ``clip_grad_norm_`` left between backward and
    ``state.step()`` would clip this rank's gradients by this rank's norm, not the mean's:
    the job would train differently than under torchrun, silently. Every view of the
    retained gradient region shares the region's version counter, which every in-place
    write bumps; its value at the end of the backward pass that brought the step's last
    gradient is what ``check`` expects (so a hook of the script's that writes a gradient in
    place during backward is its own business too). A write before the first arrival
    (``zero_grad(set_to_none=False)`` at the step's start) is the script's own business.
    (Under ``fully_shard`` the gradients are final after backward, as in torch: a script's
    own clipping there is what torch's loop does.)
    """

    def __init__(self, region: torch.Tensor) -> None:
        self.region = region
        self.expected = region._version
        self.any_arrived = False

    def begin(self) -> None:
        """At the step's start: nothing has arrived yet."""
        self.any_arrived = False

    def arrived(self) -> None:
        """At the end of a backward pass that wrote gradients (or after Leto wrote one)."""
        self.expected = self.region._version
        self.any_arrived = True

    def check(self) -> None:
        if self.any_arrived and self.region._version != self.expected:
            raise ScriptError(
                "a gradient was written between backward and state.step() "
                "(torch.nn.utils.clip_grad_norm_ left from a torchrun loop?): leto averages "
                "the gradients over the ranks inside state.step(), so this saw one rank's; "
                "clip with state.step(max_grad_norm=...), and scale the loss, not the gradients"
            )


class GradLanding:
    """Lands each parameter's first gradient of a step in its retained view."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        views: Sequence[torch.Tensor],
        region: torch.Tensor,
        writes: GradWrites,
        waiting_bytes: int = WAITING_BYTES,
    ) -> None:
        """``views``: each parameter's gradient view, in ``region`` (uint8) or not (a view
        elsewhere lands by a copy of its own)."""
        self.params, self.views = list(params), list(views)
        self.writes = writes
        self.waiting_bytes = waiting_bytes
        self._spans = _RegionSpans(region, self.views)
        self.arrived = [False] * len(self.params)
        """Whether parameter ``i``'s gradient has landed since the step began."""
        self.hooked = [False] * len(self.params)
        """Whether parameter ``i`` has its hook: one frozen when the job began has none
        until it is unfrozen (``settle`` lands its first gradient)."""
        self._waiting: list[int] = []
        """Parameters whose fresh gradient (their ``.grad``) waits to be copied into its view."""
        self._waiting_bytes = 0
        self._end_queued = False
        for i, p in enumerate(self.params):
            if p.requires_grad:
                self._hook_up(i)

    def _hook_up(self, i: int) -> None:
        self.params[i].register_post_accumulate_grad_hook(self._hook(i))
        self.hooked[i] = True

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        view, arrived = self.views[i], self.arrived
        nbytes = view.numel() * view.element_size()
        alone = nbytes >= self.waiting_bytes

        def landed(p: torch.Tensor) -> None:
            if not self._end_queued:  # what waits lands, and the writes are counted, at the end
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._end_queued = True
            if p.grad is view:  # accumulated in place: a later backward of the step
                arrived[i] = True
                return
            # the step's first gradient: autograd's fresh tensor, to copy into the view
            if alone:
                view.copy_(p.grad)
                p.grad = view
                arrived[i] = True
                return
            self._waiting.append(i)
            self._waiting_bytes += nbytes
            if self._waiting_bytes >= self.waiting_bytes:
                self.flush()

        return landed

    def _end_of_backward(self) -> None:
        """Once backward has run every hook (the script's too, which may write a gradient
        in place): the rest lands, and the region's version is what ``GradWrites`` expects."""
        self._end_queued = False
        self.flush()
        self.writes.arrived()

    def flush(self) -> None:
        """Copy every waiting gradient into its view and bind it: neighbours in the region
        by one ``torch.cat`` each run, the rest by copies. What is copied is the parameter's
        ``.grad`` now: a hook of the script's may have replaced it; one it unset stays
        unset, and ``settle`` refuses it."""
        if not self._waiting:
            return
        bound = [i for i in self._waiting if self.params[i].grad is not None]
        grads = [self.params[i].grad for i in bound]
        runs, alone = self._spans.runs(bound, grads)  # type: ignore[arg-type]
        for run in runs:
            self._spans.land(run, [self.params[i].grad for i in run])  # type: ignore[misc]
        small = [i for i in alone if self._spans.nbytes[i] < SMALL_GRAD_BYTES]
        if len(small) > 1:
            torch._foreach_copy_(
                [self.views[i] for i in small],
                [self.params[i].grad for i in small],  # type: ignore[misc]
            )
        for i in alone if len(small) <= 1 else [i for i in alone if i not in small]:
            self.views[i].copy_(self.params[i].grad)  # type: ignore[arg-type]
        for i in bound:
            self.params[i].grad = self.views[i]
        for i in self._waiting:
            self.arrived[i] = True
        self._drop_waiting()

    def _drop_waiting(self) -> None:
        self._waiting = []
        self._waiting_bytes = 0

    def begin(self) -> None:
        """At the step's start (and an OOM retry's): no gradient has landed yet."""
        self._drop_waiting()  # an OOM retry: what waited belongs to the failed attempt
        self._end_queued = False
        for i, p in enumerate(self.params):
            p.grad = None
            self.arrived[i] = False
        self.writes.begin()

    def settle(self) -> list[int]:
        """After the compute phase: every parameter's ``.grad`` is its retained view; one
        that received no gradient gets its view zeroed (what it adds to the mean
        all-reduce) and is returned, for the update to skip where no rank had one
        (``leto.retained.presence``). ``ScriptError`` for a gradient unset after it landed
        or written in place (``GradWrites``)."""
        if self._waiting:  # backward's end copies them all: only if its callback did not run
            self._end_of_backward()
        self.writes.check()
        absent = []
        for i, (p, view) in enumerate(zip(self.params, self.views, strict=True)):
            if p.grad is view:
                continue
            if self.arrived[i]:
                raise ScriptError(
                    "a gradient no longer lives in retained memory: it was unset or replaced "
                    "after backward (optimizer.zero_grad() between backward and "
                    "RetainedState.step()?); leto starts each step's gradients itself"
                )
            if p.grad is not None and not self.hooked[i] and p.requires_grad:
                # unfrozen since the job began: land this gradient here, the next by the hook
                view.copy_(p.grad)
                p.grad = view
                self._hook_up(i)
                continue
            if p.grad is not None:
                raise ScriptError(
                    "a gradient no longer lives in retained memory: it was set outside "
                    "backward (p.grad = ...); only autograd may write a retained gradient"
                )
            view.zero_()
            p.grad = view
            absent.append(i)
        return absent


class _RegionSpans:
    """Where each gradient view lies in the region, and how waiting gradients land there
    together: a run of views next to each other (nothing but padding between) by one
    ``torch.cat`` of their bytes and the padding's, written over the run's span."""

    def __init__(self, region: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
        self.region = region
        self.nbytes = [v.numel() * v.element_size() for v in views]
        base, end = region.data_ptr(), region.data_ptr() + region.numel()
        self.offset: list[int | None] = [
            v.data_ptr() - base
            if v.is_contiguous() and base <= v.data_ptr() and v.data_ptr() + n <= end
            else None
            for v, n in zip(views, self.nbytes, strict=True)
        ]
        in_region = sorted((o, i) for i, o in enumerate(self.offset) if o is not None)
        self.next: dict[int, int] = {}
        """The view that starts after view ``i`` with only padding between (none overlaps)."""
        self.gap: dict[int, int] = {}
        """Padding bytes between view ``i`` and ``next[i]``."""
        for (o, i), (o2, j) in itertools.pairwise(in_region):
            if o + self.nbytes[i] <= o2:
                self.next[i], self.gap[i] = j, o2 - o - self.nbytes[i]
        self.dtype = [v.dtype for v in views]
        self.shape = [v.shape for v in views]
        self._pads: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def runs(
        self, bound: list[int], grads: list[torch.Tensor]
    ) -> tuple[list[list[int]], list[int]]:
        """``bound`` (with their ``grads``) as runs of two or more neighbours that can land
        by bytes (same dtype and shape as the view, contiguous, on its device), and the rest."""
        fits = {
            i
            for i, g in zip(bound, grads, strict=True)
            if self.offset[i] is not None
            and g.dtype == self.dtype[i]
            and g.shape == self.shape[i]
            and g.device == self.region.device
            and g.is_contiguous()
        }
        runs: list[list[int]] = []
        alone = [i for i in bound if i not in fits]
        for i in sorted(fits, key=self.offset.__getitem__):  # type: ignore[arg-type]
            if runs and self.next.get(runs[-1][-1]) == i:
                runs[-1].append(i)
            else:
                runs.append([i])
        alone += [r[0] for r in runs if len(r) == 1]
        return [r for r in runs if len(r) > 1], alone

    def land(self, run: list[int], grads: list[torch.Tensor]) -> None:
        """One run's gradients, and the zeros of the padding between them, over its span."""
        lo = self.offset[run[0]]
        assert lo is not None
        sizes = [lo, *(self.nbytes[i] for i in run), *(self.gap[i] for i in run[:-1])]
        word = next(w for w in (8, 4, 2, 1) if all(n % w == 0 for n in sizes))
        as_word = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
        parts = []
        for i, g in zip(run, grads, strict=True):
            parts.append(g.view(-1).view(as_word))
            if i != run[-1] and self.gap[i]:
                parts.append(self._pad(self.gap[i] // word, as_word))
        hi = self.offset[run[-1]] + self.nbytes[run[-1]]  # type: ignore[operator]
        torch.cat(parts, out=self.region[lo:hi].view(as_word))

    def _pad(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        pad = self._pads.get((n, dtype))
        if pad is None:
            pad = self._pads[(n, dtype)] = torch.zeros(n, dtype=dtype, device=self.region.device)
        return pad
