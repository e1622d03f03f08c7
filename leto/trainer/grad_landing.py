"""Gradients land in retained memory by one copy, not by a fill and an accumulation.

A parameter whose ``.grad`` is a view of the retained "grads" region receives its gradient
as autograd accumulates: ``grad += new``, after the region was zeroed at the step's start.
That is a fill of the whole region and an add that reads it back, three passes over the
gradients that ``optimizer.zero_grad()`` (``set_to_none=True``, torch's default) spares a
plain job. Instead each step starts with ``.grad`` unset, autograd hands the parameter its
fresh gradient, and a post-accumulate hook copies it into the retained view and binds the
view, one pass; the fresh tensor is freed at once, so the peak holds one parameter's
gradient more at most. Small gradients (biases, norms' weights: under
``SMALL_GRAD_BYTES`` each) wait, and land together by one multi-tensor copy when backward
ends (a callback on the engine) or when ``WAITING_BYTES`` wait: one launch where there
were dozens, each a few microseconds of host time. (A large gradient is copied alone, at
once: a multi-tensor copy walks its elements on the host in blocks.) Until its copy a
waiting gradient stays the parameter's ``.grad``, so a hook of the script's after Leto's
reads its value. Later backward passes of the same step (gradient accumulation) find the
view bound and accumulate into it in place, as before.

Given a ``copy_stream`` (the trainer passes one on CUDA, but not with the bucketed mean,
whose launches read the views at once), a large gradient's copy runs on it beside the rest
of backward: the copy is memory-bound and backward's matrix products mostly are not, so it
overlaps them in part (the two share the memory's bandwidth). The compute stream waits for a
copy when the next large gradient arrives (its source is released then: the peak holds one
fresh gradient more) and for the last one when backward ends, before anything reads a view
on it; where a hook of the script's follows Leto's, the gradient lands on the compute
stream, for the hook.

After the compute phase, ``settle`` binds the zeroed view of every parameter that received
no gradient (what it adds to the all-reduce) and returns them: the update skips one that no
rank had a gradient for, as torch's optimizers skip a None ``.grad``
(``leto.retained.presence``). It refuses a gradient that arrived and was unset again
(``zero_grad()`` after backward): the update must never read a stale view. A parameter
frozen when the job began has no hook; once unfrozen, ``settle`` lands its first gradient
and hooks it up (gradual unfreezing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from leto.errors import ScriptError

if TYPE_CHECKING:
    from leto.trainer.grad_buckets import BucketedMean

SMALL_GRAD_BYTES = 1 << 20
"""A gradient smaller than this waits to land with the others (at the end of backward);
``WAITING_BYTES`` bounds what waits, so the peak grows by that at most."""
WAITING_BYTES = 8 << 20


def _runs_last(p: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> bool:
    """Whether ``hook`` is ``p``'s last post-accumulate hook: none of the script's runs after
    it, to read or write the gradient (ones registered before it ran already)."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None)
    return bool(hooks) and next(reversed(hooks.values())) is hook


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
                "(torch.nn.utils.clip_grad_norm_ or clip_grad_value_ left from a torchrun "
                "loop?): leto averages the gradients over the ranks inside state.step(), so "
                "this saw one rank's; clip with state.step(max_grad_norm=..., "
                "max_grad_value=...), and scale the loss, not the gradients"
            )


class GradLanding:
    """Lands each parameter's first gradient of a step in its retained view."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        views: Sequence[torch.Tensor],
        writes: GradWrites,
        reduce: BucketedMean | None = None,
        copy_stream: torch.cuda.Stream | None = None,
    ) -> None:
        """``reduce``: plain data parallelism's mean, told of each gradient as it lands
        (``leto.trainer.grad_buckets``); None: nothing overlaps backward. ``copy_stream``
        (CUDA): large gradients land on it (``_land_async``)."""
        self.params, self.views = list(params), list(views)
        self.copy_stream = copy_stream
        self._in_flight: tuple[torch.cuda.Event, torch.Tensor] | None = None
        """The last copy queued on ``copy_stream``: its end, and the fresh gradient it reads."""
        self.writes = writes
        self.reduce = reduce
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
        if reduce is not None:
            reduce.hooked(self.hooked)

    def _hook_up(self, i: int) -> None:
        self.params[i].register_post_accumulate_grad_hook(self._hook(i))
        self.hooked[i] = True

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        view, arrived, reduce = self.views[i], self.arrived, self.reduce
        nbytes = view.numel() * view.element_size()
        small = nbytes < SMALL_GRAD_BYTES

        def landed(p: torch.Tensor) -> None:
            if not self._end_queued:  # what waits lands, and the writes are counted, at the end
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._end_queued = True
            if (
                reduce is not None
                and self._waiting
                and reduce.overlapping
                and reduce.bucket_of[self._waiting[0]] != reduce.bucket_of[i]
            ):
                self.flush()  # backward left the waiting gradients' bucket: it may be complete
            if p.grad is view:  # accumulated in place: a later backward of the step
                arrived[i] = True
                if reduce is not None:
                    reduce.landed(i)
                return
            # the step's first gradient: autograd's fresh tensor, to copy into the view
            if p.grad.layout != torch.strided:
                raise ScriptError(
                    f"a parameter of shape {tuple(p.shape)} got a {p.grad.layout} gradient; "
                    "leto's retained gradients are dense: produce dense gradients for it"
                )
            if not small:
                if self.copy_stream is not None and _runs_last(p, landed):
                    self._land_async(view, p.grad)
                else:  # a hook of the script's runs next and may read or write it: land it now
                    self.join_copies()
                    view.copy_(p.grad)
                p.grad = view
                arrived[i] = True
                if reduce is not None:
                    reduce.landed(i)
                return
            self._waiting.append(i)
            self._waiting_bytes += nbytes
            if self._waiting_bytes >= WAITING_BYTES:
                self.flush()

        return landed

    def _end_of_backward(self) -> None:
        """Once backward has run every hook (the script's too, which may write a gradient
        in place): the rest lands, and the region's version is what ``GradWrites`` expects."""
        self._end_queued = False
        self.flush()
        self.join_copies()
        if self.reduce is not None:
            self.reduce.end_of_backward()
        self.writes.arrived()

    def _land_async(self, view: torch.Tensor, fresh: torch.Tensor) -> None:
        """Copy ``fresh`` into ``view`` on the copy stream, where it runs beside the rest of
        backward (a copy is memory-bound, backward's matrix products mostly are not). The
        compute stream waits for it only when the next large gradient arrives, and
        ``fresh`` is released then: after that wait, so the caching allocator reuses its
        block only behind the copy, and with no ``record_stream`` (a block awaiting a
        stream would count as live in lent memory). The peak holds one fresh gradient more
        than a landing on the compute stream: the one in flight."""
        assert self.copy_stream is not None
        current = torch.cuda.current_stream(fresh.device)
        self.copy_stream.wait_stream(current)  # ``fresh`` is computed
        with torch.cuda.stream(self.copy_stream):
            view.copy_(fresh)
        done = self.copy_stream.record_event()
        self.join_copies()
        self._in_flight = (done, fresh)

    def join_copies(self) -> None:
        """The compute stream waits for the copy in flight (``_land_async``), whose source
        is released: before anything on the compute stream reads a view it wrote."""
        if self._in_flight is not None:
            assert self.copy_stream is not None
            torch.cuda.current_stream(self.copy_stream.device).wait_event(self._in_flight[0])
            self._in_flight = None

    def flush(self) -> None:
        """Copy every waiting gradient into its view (one multi-tensor copy) and bind it.
        What is copied is the parameter's ``.grad`` now: a hook of the script's may have
        replaced it; one it unset stays unset, and ``settle`` refuses it."""
        if not self._waiting:
            return
        bound = [i for i in self._waiting if self.params[i].grad is not None]
        landed = set(bound)
        targets = [self.views[i] for i in bound]
        sources = [self.params[i].grad for i in bound]
        if len(targets) == 1:
            targets[0].copy_(sources[0])  # type: ignore[arg-type]
        elif targets:
            torch._foreach_copy_(targets, sources)  # type: ignore[arg-type]
        for i in bound:
            self.params[i].grad = self.views[i]
        for i in self._waiting:
            self.arrived[i] = True
            if self.reduce is not None and i in landed:
                self.reduce.landed(i)
        self._drop_waiting()

    def _drop_waiting(self) -> None:
        self._waiting = []
        self._waiting_bytes = 0

    def begin(self) -> None:
        """At the step's start (and an OOM retry's): no gradient has landed yet."""
        self.join_copies()  # an OOM retry: the failed attempt's copy in flight
        self._drop_waiting()  # an OOM retry: what waited belongs to the failed attempt
        self._end_queued = False
        if self.reduce is not None:
            self.reduce.begin()
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
        self.join_copies()
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
                if self.reduce is not None:
                    self.reduce.landed_late(i)
                    self.reduce.hooked(self.hooked)
                continue
            if p.grad is not None:
                raise ScriptError(
                    "a gradient no longer lives in retained memory: it was set outside "
                    "backward (p.grad = ...); only autograd may write a retained gradient "
                    "(hand it the gradient instead: torch.autograd.backward(params, grads), "
                    "which leto averages over the ranks as any backward's)"
                )
            view.zero_()
            p.grad = view
            absent.append(i)
        return absent
