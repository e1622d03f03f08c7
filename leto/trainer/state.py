"""Retained, consistent model state and the step loop that keeps it so.

``RetainedState`` places parameters, gradients and optimizer state in pool regions
(zero copy: the module's parameters *are* views of retained memory) and drives each
step through the update marker (see ``leto.trainer.marker``):

* compute phase (forward, backward, gradient all-reduce, clipping): model state is
  read-only, so a failure here costs only the re-run of this step; an out-of-memory error
  in forward/backward run through ``compute()`` reclaims the node's shadows and re-runs
  them in place (``leto.preinit``);
* ``GRADS_READY`` then a barrier: once any rank passes it, every rank's gradients are
  final, so any rank can finish the update alone;
* update phase, ``consistency: rmu`` (the default, paper §5.2): the optimizer runs chunk
  by chunk as transactions (undo copy, in-place AdamW, incremental parity, commit), see
  ``leto.updater.rmu``;
* update phase, ``consistency: snapshot`` (the paper's §5.1 strawman, kept as the
  baseline): copy the whole state region to a host snapshot, mark ``UPDATING``, apply the
  optimizer in place, commit, see ``leto.updater.snapshot``.

Both updaters are driven through ``leto.updater.base.Updater``. The state is built in four
steps: plan (``leto.trainer.placement.plan``, in ``Context.retain``), map
(``placement.map_regions``), a shadow's warm-ups and wait for promotion, recover
(``leto.trainer.recovery.Recovery``, then binding the model to its regions).

A promoted trainer resumes with one collective: if any rank began (or finished) step
t's update, every rank finishes it — from its last committed chunk (rmu) or from the
snapshot (snapshot) — and training continues at t+1; otherwise every rank re-runs step t
from its forward pass (the decision: ``leto.trainer.resume.decide_resume``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from leto import compiled, contract
from leto.errors import ConfigError, ProtocolError, ScriptError, UnrecoverableStateError
from leto.events import EventLog, Kind, last_event
from leto.preinit import probe, replay
from leto.preinit.model_warmup import (
    cached_free,
    warm_compiler,
    warm_forward,
    warm_sharded_clip,
)
from leto.preinit.warmup import warm_shadow
from leto.retained.marker import Phase
from leto.retained.optim_state import StateSlots
from leto.retained.slot import element_size
from leto.trainer import placement
from leto.trainer.buffers import BufferUndo, own_view
from leto.trainer.compute import ComputePhase, lends
from leto.trainer.extras import DEFAULT_SLOT_BYTES, RetainedExtras, freeze_heap, map_records
from leto.trainer.grad_buckets import BucketedMean
from leto.trainer.grad_landing import GradLanding, GradWrites
from leto.trainer.grad_sync import norm_order
from leto.trainer.loss import LossReport
from leto.trainer.loss_scale import LossScale
from leto.trainer.rebind import rebind
from leto.trainer.recovery import Recovery
from leto.trainer.resume import ResumeAction, decide_resume
from leto.trainer.rng import HOST_BYTES, rng_blob, set_rng_blob, staged
from leto.trainer.sharding import ShardGradArrival, local
from leto.trainer.step_guard import OptimizerStepGuard
from leto.trainer.timing import PhaseTimes, StepProfiler, warn_on_device_waits

if TYPE_CHECKING:
    from leto.trainer.placement import Plan
    from leto.trainer.services import TrainerServices

logger = logging.getLogger(__name__)

T = TypeVar("T")

BUFFER_UNDO = "buffers.undo"
"""The retained copy of the module buffers at the start of the step (``BufferUndo``)."""


class RetainedState:
    """The retained state of one rank and its crash-consistent step protocol."""

    def __init__(
        self,
        services: TrainerServices,
        plan: Plan,
        wait_for_promotion: Callable[[Callable[[], None]], None] | None = None,
        stateful: Mapping[str, Any] | None = None,
        stateful_bytes: int | None = None,
        loss_scale: LossScale | None = None,
    ) -> None:
        """``plan``: what is retained and where (``leto.trainer.placement.plan``, which says
        what an integration's ``grads`` and ``mirror`` are). A shadow passes
        ``wait_for_promotion``: it maps every retained region first (when they exist:
        mapping reads nothing) and waits, so promotion costs no mapping work; an L1 shadow
        has waited before planning (``Context.retain``).

        An integration's gradient buffers (``plan.layout.main_grad``) are filled by the
        integration (``param.main_grad``) and reduced and zeroed by its ``GradSync``
        (``GradSync.reduce``, ``GradSync.zero``); a sharded optimizer's full parameter
        buffers (``plan.layout.mirror_regions``) are mapped here, unprotected, and refilled
        by ``GradSync.gather`` after every committed update and at every resume (lost pages
        included).

        ``stateful``: objects with ``state_dict()`` / ``load_state_dict()`` retained with each
        step by name (``leto.trainer.extras``; LR schedulers on the optimizer are found
        without one); ``stateful_bytes``: the bytes of one of their record slots."""
        self.services = services
        self.model = plan.model
        self.optimizer = plan.optimizer
        self.params = plan.params
        self._groups = _group_sizes(plan.optimizer)
        """The optimizer's groups as retained (their sizes): a group added later is refused."""
        self._norm_order = norm_order(plan.model, plan.params)
        """The parameters' indices in ``model.parameters()`` order, which clipping's total
        norm follows, so it has the bits of a torch loop's ``clip_grad_norm_``."""
        self.buffers = plan.buffers
        self.frozen = plan.frozen
        self.device = plan.device
        self.shards = plan.shards
        """FSDP2's shards among the parameters (``leto.trainer.sharding``), or None."""
        self.layout = plan.layout
        if loss_scale is not None and (plan.shards is not None or plan.layout.main_grad):
            raise ConfigError(
                "ctx.retain(scaler=...): a GradScaler with fully_shard or an integration's "
                "gradient buffers is not supported; train in bfloat16"
            )
        self._loss_scale = loss_scale
        """fp16's dynamic loss scale (``leto.trainer.loss_scale``), or None."""
        # Regions exist once the first trainer initialised them (marker written last); only
        # then may a shadow map them ahead: mapping never creates, never reads the data.
        mapped_ahead = wait_for_promotion is None or services.ready_to_map_ahead()
        self._replay_kept = False
        """This shadow's forward replay left its blocks cached for the first step."""
        self._buckets: BucketedMean | None = None
        self._graphs_at_begin = 0
        """Dynamo's graphs compiled in this process when the step began."""
        self._traced_hooks: compiled.TracedHooks | None = None
        """The hooks this shadow's replay compiled the model's graphs under, until the
        promoted trainer's first ``compute`` checks them (``leto.compiled``)."""
        self._frozen_schedulers: list | None = None
        """A shadow's LR schedulers found before it froze its heap (``extras.freeze_heap``)."""
        self.mapped_ahead_step: int | None = None
        """The marker's step when this shadow mapped the regions ahead of its promotion."""
        if mapped_ahead:
            self._map(plan)
            if wait_for_promotion is not None and self.marker.is_valid():
                self.mapped_ahead_step = self.marker.step
        if wait_for_promotion is not None:
            self._wait_as_shadow(wait_for_promotion)
        t0 = time.perf_counter()
        if not mapped_ahead:
            self._map(plan)
        else:  # mapped before the predecessor died: read the marker as it finally landed
            self.marker.reload()
        self._recover(stateful, stateful_bytes)
        self.attach_s = time.perf_counter() - t0
        self._committed_this_step = False
        """This iteration of ``steps()`` committed: a second ``step()`` in it is refused."""
        self._announced = False
        self._total: int | None = None
        """The ``total`` of ``steps()``, reported with each step (progress, ETA)."""
        self._step_started = 0.0
        self._phases = PhaseTimes(self.device, 0.0, enabled=False)
        self._install_fault_hooks()
        OptimizerStepGuard(self.optimizer, self.marker)  # the update is Leto's to run
        self._rng_host: torch.Tensor | None = None
        """The RNG slot's bytes on the host while known (set at each commit)."""
        self._rng_next_host = self._rng_host
        self._barrier_word = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._loss = LossReport(self.device)
        """Each step's loss for its ``step_done``, read without a wait for the device."""

    # -- construction: plan (Context.retain) → map → wait → recover -------------------------
    def _map(self, plan: Plan) -> None:
        """Allocate or reattach every region of this rank (``placement.map_regions``)."""
        regions = placement.map_regions(plan, self.services, slots=lambda: self.optimizer_state)
        self.memory = regions.memory
        self.state_region = regions.state
        """The state region's bytes (uint8): parameters, optimizer state, buffers, RNG."""
        self.grad_regions = regions.grads
        """Gradient regions by name (Leto's "grads", or an integration's buffers)."""
        self.mirror_regions = regions.mirrors
        """Full parameter buffers of a sharded optimizer, by name (``Layout.mirror_regions``)."""
        self.marker = regions.marker
        self._rng_next = regions.rng_next
        self.protected = regions.protected
        self.updater = regions.updater
        self._recovery = Recovery(regions, self.services)
        self._presence = regions.presence
        self._grad_view_list: list[torch.Tensor] | None = None
        self._seen_grad_list: list[torch.Tensor] | None = None
        self._seen_grad_ptrs: list[int] | None = None
        env = self.services.env
        lent = self.updater.lendable()
        lending = lends(lent, self.device, env.lend_activations)
        if env.lend_activations and not lending:  # rmu: checked with the job file
            logger.info(
                "leto.lend_activation_memory: nothing to lend on %s (activations are CUDA memory)",
                self.device,
            )
        self._compute = ComputePhase(
            rank=self.services.rank,
            device=self.device,
            guard=self.services.preinit,
            grad_sync=self.services.grad_sync,
            restart=self._restart_compute,
            lent=lent if lending else {},
            lend_asked=env.lend_activations,
            launched=lambda: self._buckets is not None and self._buckets.launched,
        )

    def _wait_as_shadow(self, wait_for_promotion: Callable[[Callable[[], None]], None]) -> None:
        """A shadow's warm-ups (level 3), then its wait for promotion."""
        site = self.services.shadow_site()
        warm_shadow(site, self.layout, self.optimizer)  # the Triton kernels of a recovery
        warm_sharded_clip(site, self.params)  # FSDP2: DTensor's sharding propagation of the clip
        # The model's first step (leto.preinit.replay). Its freed blocks are kept for the
        # first step's activations unless lending was asked for: the lending pool would grow
        # afresh, so a trainer whose shadow kept them does not lend.
        keep = self.services.env.lend_activations is not True
        replayed = warm_forward(site, self.model, keep_cache=keep)
        self._traced_hooks = None if replayed is None else replayed.traced
        warm_compiler(site, self.model, replayed)  # a compiled model: the compiler's first use
        # Kept if no later warm-up had to return the cache (warm_model: only one that grew it).
        self._replay_kept = (
            replayed is not None and replayed.result.kept_bytes > 0 and cached_free(self.device)
        )

        def freeze() -> None:  # once ready: the scan must not delay readiness
            self._frozen_schedulers = freeze_heap(self.optimizer)

        wait_for_promotion(freeze)

    def _recover(self, stateful: Mapping[str, Any] | None, stateful_bytes: int | None) -> None:
        """Reattach (identity and layout checked, lost pages rebuilt) or start fresh; then
        bind the model to its regions and attach the extras; a fresh start initialises the
        regions and seals them."""
        rank = self.services.rank
        self.reattached = self._recovery.attach(self.layout.digest)
        if self._presence is not None and self.reattached:
            self._presence.attach()  # whether the predecessor's step counters may differ
        if not self.reattached and any(t.is_meta for t in self.params + self.buffers + self.frozen):
            raise UnrecoverableStateError(
                f"rank {rank}: no retained state to reattach to, but the model was built on "
                "the meta device; build it for real (ctx.init_device() does this)"
            )
        if self._replay_kept:
            self._compute.stop_lending("the forward replay's blocks serve the compute phase")
        self._bind()
        self._buckets = self._bucketed_mean()
        """Plain data parallelism's mean, launched bucket by bucket as backward lands the
        gradients (``leto.trainer.grad_buckets``); None where nothing overlaps backward."""
        self._landing = (
            GradLanding(
                self.params,
                self._seen_grads(),
                GradWrites(self.grad_regions["grads"]),
                self._buckets,
                self._landing_stream(),
            )
            if self.shards is None and not self.layout.main_grad
            else None
        )
        """Gradients copied into their views as they arrive (``leto.trainer.grad_landing``);
        FSDP2 and the integrations' buffers accumulate into retained memory themselves."""
        self._arrival = (
            ShardGradArrival(self.params, self._seen_grads()) if self.shards is not None else None
        )
        """Which FSDP2 shards received a gradient this step (``leto.trainer.sharding``)."""
        self._attach_extras(stateful, stateful_bytes)  # before the marker records the regions
        self._rng = self.layout.rng.view(self.state_region)
        if not self.reattached:
            self._rng.copy_(rng_blob(self.device))
            self.encode("state")
            identity = self.memory.identity_record()
            self.marker.initialise(self.layout.digest, identity=identity)
            self.memory.seal(identity)

    def _bind(self) -> None:
        """Make params, grads, optimizer state, buffers and the parameters outside the
        optimizer views of retained memory (zero copy).
        Parameters and buffers get a version counter each (``own_view``): a buffer updated
        in place in forward (BatchNorm) must not invalidate the parameters saved for backward."""
        fresh = not self.reattached
        shards = self.shards
        for i, (p, pslot, grad) in enumerate(
            zip(self.params, self.layout.params, self.grad_views(), strict=True)
        ):
            data = own_view(self.state_region, pslot)
            if shards is not None:  # FSDP2: the shard's DTensor over its padded slot
                shards.bind_param(i, p, data, fresh)
            else:
                if fresh:
                    data.copy_(p.detach())
                rebind(p, torch.nn.Parameter(data, requires_grad=p.requires_grad))
            if fresh:
                grad.zero_()
        for p, grad in zip(self.params, self._seen_grads(), strict=True):
            p.grad = None if self.layout.main_grad else grad  # main_grad: the integration binds it
        self.optimizer_state = StateSlots(
            self.optimizer.state,
            self.params,
            self.layout.optim,
            self.state_region,
            seen=self.seen,
        )
        if fresh:  # zeroed, or the state the optimizer already holds (Adagrad's)
            self.optimizer_state.capture()
        else:
            self.optimizer_state.read_flags()
            self.optimizer_state.bind()
        for b, slot in zip(self.buffers, self.layout.buffers, strict=True):
            data = own_view(self.state_region, slot)
            if fresh:
                data.copy_(b)
            rebind(b, data)
        for j, (f, slot) in enumerate(zip(self.frozen, self.layout.frozen, strict=True)):
            data = own_view(self.state_region, slot)
            if shards is not None:  # FSDP2: indexed after the optimizer's parameters
                shards.bind_param(len(self.params) + j, f, data, fresh)
                continue
            if fresh:
                data.copy_(f.detach())
            rebind(f, torch.nn.Parameter(data, requires_grad=f.requires_grad))
        self._frozen_versions = [f._version for f in self.frozen]
        self._note_param_versions()

    def _attach_extras(
        self, stateful: Mapping[str, Any] | None, stateful_bytes: int | None
    ) -> None:
        """The undo copy of the module buffers and the records of the stateful objects (both
        retained regions: a fresh trainer makes them, a successor reattaches)."""
        self.buffer_undo: BufferUndo | None = None
        if self.layout.buffers:
            nbytes = BufferUndo.region_bytes(BufferUndo.span(self.layout.buffers)[1])
            self.buffer_undo = BufferUndo(
                self.state_region,
                self.layout.buffers,
                self.memory.device_region(BUFFER_UNDO, nbytes)[0],
                functools.partial(self.memory.lost_chunks, BUFFER_UNDO),
            )
        records = map_records(self.memory, stateful_bytes or DEFAULT_SLOT_BYTES, self.marker)
        self.extras = RetainedExtras(
            records,
            self.optimizer,
            stateful,
            self.services.rank,
            self._frozen_schedulers,
            model=self.model,
        )

    def _refuse_buffer_updates(self) -> None:
        """Under ``leto.erasure``: a buffer updated in forward would leave the parity behind."""
        assert self.buffer_undo is not None
        if changed := self.buffer_undo.changed():
            names = {id(b): n for n, b in self.model.named_buffers(remove_duplicate=False)}
            which = ", ".join(names.get(id(self.buffers[i]), "?") for i in changed)
            raise ConfigError(
                f"module buffers were updated in forward ({which}), which leto.erasure's "
                "parity does not follow: run without leto.erasure, or keep such buffers "
                "out of the model"
            )

    def grad_views(self) -> list[torch.Tensor]:
        """Each optimizer parameter's gradient as a view of its retained region, in
        ``params`` order: where an integration binds its gradients (``main_grad``). Built
        once: a few hundred views cost milliseconds of host time per step on a 1 B model."""
        if self._grad_view_list is None:
            self._grad_view_list = [
                slot.view(self.grad_regions[name])
                for slot, name in zip(self.layout.grads, self.layout.grad_region, strict=True)
            ]
        return self._grad_view_list

    def _seen_grads(self) -> list[torch.Tensor]:
        """Each parameter's gradient as torch sees it: its retained view, or for an FSDP2
        shard the ``DTensor`` over it (built once)."""
        if self._seen_grad_list is None:
            self._seen_grad_list = [self.seen(i, g) for i, g in enumerate(self.grad_views())]
        return self._seen_grad_list

    def seen(self, i: int, view: torch.Tensor) -> torch.Tensor:
        """A retained view of parameter ``i``'s data, gradient or state as torch sees it:
        for an FSDP2 shard its ``DTensor`` (``FsdpShards.seen``), else the view itself."""
        return view if self.shards is None else self.shards.seen(i, view)

    def allow_uneven_counts(self) -> None:
        """The parameters' step counters may differ from here on (a checkpoint was loaded:
        its history is unknown), which a resume's counter check must allow."""
        if self._presence is not None:
            self._presence.note_uneven()

    def encode(self, name: str) -> None:
        """Recompute retained region ``name``'s parity from its contents (nothing for an
        unprotected region): after something other than the update protocol wrote it, a
        checkpoint load for one, the parity must match again before the next update."""
        if name in self.protected:
            self.protected[name].encode()

    def _encode_grads(self) -> None:
        for name in self.grad_regions:
            self.encode(name)

    def _install_fault_hooks(self) -> None:
        """Forward/backward kill points sit in the middle of the model's hook sites (its
        leaves outside compiled modules, ``leto.compiled``), mid-phase."""
        leaves = compiled.hook_sites(self.model)
        if not leaves or not self.services.injector.pending:
            return
        middle = leaves[len(leaves) // 2]
        forward = compiled.opaque_hook(lambda *_: self.services.injector.point("forward"))
        middle.register_forward_pre_hook(forward)
        middle.register_forward_hook(compiled.opaque_hook(self._arm_backward_point))

    def _arm_backward_point(self, module: torch.nn.Module, args: object, output: object) -> None:
        """The backward kill point: a hook on the gradient of the module's output. (A full
        backward hook would wrap the outputs in an autograd function: a returned parameter,
        e.g. Megatron's skipped bias, would reach compiled fusions as a plain tensor, and the
        injected run would compile what the fault-free one never does.)"""
        out = next(
            (
                t
                for t in replay.leaves(output)  # a Hugging Face ModelOutput is a mapping
                if isinstance(t, torch.Tensor) and t.grad_fn is not None
            ),
            None,
        )
        if out is not None:
            out.register_hook(self._backward_point)

    def _backward_point(self, grad: torch.Tensor) -> None:
        self.services.injector.point("backward")

    # -- the step loop -----------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Yield the steps still to run; resumes exactly where the job was interrupted."""
        self._total = total
        self.extras.discover()  # the LR schedulers: a shadow's script builds them after retain()
        self._rng_host = None  # a resume or a checkpoint may write the RNG slot: read it once
        if self.reattached:
            step = self._resume()
        else:  # a checkpoint's capture (loaded by retain) or, on a fresh job, nothing yet
            step = self.marker.step
            self.extras.resume(step)
        self._publish_forward_shapes()
        if self.device.type == "cuda":
            # What the model's device build cached is dead weight now that it lives in retained
            # memory (a promoted shadow's cache is its forward replay's: the first step's); the
            # peak in step_done (device_peak_bytes) counts from here, the steps only.
            if not self.reattached:
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        first = step
        profiler = None
        if self.services.env.profile_dir is not None:
            env = self.services.env
            profiler = StepProfiler(
                env.profile_dir, self.services.rank, self.device, env.profile_after
            )
        while step < total:
            if self.services.env.sync_debug and step == first + 1:
                warn_on_device_waits(self.device)
            if self.services.env.sync_debug and step == total - 1:  # its loss is read now
                warn_on_device_waits(self.device, on=False)
            if profiler is not None:
                profiler.begin(step)
            self._begin(step)
            yield step
            if not self._committed_this_step:
                raise ScriptError(
                    f"step {step} ended without state.step() being called: leto commits every "
                    "step it begins; call state.step() in every iteration of state.steps()"
                )
            if profiler is not None:
                profiler.end(step)
            step += 1
        self.updater.drain()  # the last flush's host copies land
        self.services.finished()  # no more heartbeats: the hang watch leaves this trainer alone

    def _step_rng(self) -> torch.Tensor:
        """The RNG state this step starts from, on the host: the copy kept when the last
        commit installed it, else read from the retained slot (at a process's first step, or
        after a resume: one device read)."""
        if self._rng_host is None:
            self._rng_host = self._rng.cpu()
        return self._rng_host

    def _publish_forward_shapes(self) -> None:
        """The shapes of the model's first call, for the shadows' forward replay
        (``leto.preinit.replay``), once per group attempt."""
        if replay.setting_reason(self.services.env.preinit.replay_forward, self.device) is not None:
            return
        key = contract.forward_spec(self.services.rank)
        if not self.services.store.check([key]):
            replay.ForwardRecorder(self.model, lambda text: self.services.store.set(key, text))

    def _begin(self, step: int) -> None:
        if self.marker.step != step or self.marker.phase != Phase.IDLE:
            raise ProtocolError(
                f"step {step} begins with the marker at {self.marker.step}/{self.marker.phase.name}"
            )
        self._committed_this_step = False
        self._step_started = time.perf_counter()
        self._graphs_at_begin = compiled.graphs_compiled()
        self._phases = PhaseTimes(
            self.device, self._step_started, enabled=self.services.env.phase_times
        )
        self.services.injector.step = step
        set_rng_blob(self._step_rng(), self.device)
        self._zero_grads()
        if self.buffer_undo is not None:  # forward writes running statistics: a re-run starts here
            self.buffer_undo.save(step)
        self.extras.begin(step)

    def _zero_grads(self) -> None:
        """Start this step's gradients: unset, to land by one copy each (``GradLanding``);
        else zero Leto's regions (FSDP2) or the integration's buffers (``GradSync.zero``),
        with ``.grad`` back to its retained view (undoing a ``zero_grad(set_to_none=True)``),
        or None where the integration's hooks fill ``main_grad`` (a ``.grad`` there would be
        added to it twice)."""
        if self.services.grad_sync().zero is not None:
            self.services.grad_sync().zero()
        elif self._landing is not None:  # no fill: each gradient lands by one copy
            self._landing.begin()
            return
        else:
            for region in self.grad_regions.values():
                region.zero_()
            if self._arrival is not None:
                self._arrival.begin()
        if self.layout.main_grad:
            for p in self.params:
                p.grad = None
            return
        for p, grad in self._unbound_grads():
            p.grad = grad

    def compute(self, fn: Callable[[], T]) -> T:
        """Run this step's compute phase (forward and backward) through ``fn``.

        An out-of-memory error while the node has shadows is theirs to pay for: the shadows
        are reclaimed (``leto.preinit.guard.OomGuard.reclaim``, which also says why this is
        the hook into PyTorch's allocator), the step's RNG is restored from retained memory,
        the retained gradients are zeroed and ``fn`` runs again — the same step, bit for bit,
        since model state is read-only here. Without shadows the error propagates.
        ``fn`` must not run collectives: the other ranks do not retry with this one (so with
        a model-parallel ``Context.grad_sync`` the error always propagates).
        """
        if self._traced_hooks is not None:  # a promoted shadow's first step
            self._keep_traced_graphs(self._traced_hooks)
            self._traced_hooks = None
        return self._compute.run(self.marker.step, fn)

    def _keep_traced_graphs(self, traced: compiled.TracedHooks) -> None:
        """The graphs the replay compiled serve this trainer where its model has the hooks
        they were traced under; else Dynamo's caches are dropped and it compiles afresh."""
        if not traced.keep_or_drop(self.model):
            logger.info(
                "[rank %d] the module hooks changed since the shadow compiled the model: "
                "compiling afresh",
                self.services.rank,
            )

    def _restart_compute(self) -> None:
        """Back to the start of this step's compute phase (buffers, zero gradients; the
        retry sets the RNG each compute call began with)."""
        if self.buffer_undo is not None:
            self.buffer_undo.restart()
        self._zero_grads()

    def step(
        self,
        max_grad_norm: float | None = None,
        loss: torch.Tensor | float | None = None,
        *,
        max_grad_value: float | None = None,
        skip_nonfinite: bool = False,
    ) -> torch.Tensor | None:
        """Synchronise gradients, clip, and apply the optimizer update crash-consistently;
        ``loss`` is reported in ``step_done`` (on CUDA a step late, ``leto.trainer.loss``).
        ``max_grad_value`` clamps every gradient element to ``[-max_grad_value,
        max_grad_value]`` (torch's ``clip_grad_value_``) after the mean over the ranks and
        before the norm clipping, as a torch loop that calls both does. ``skip_nonfinite``:
        where the gradients' total norm is inf or NaN, the update leaves every parameter and
        its optimizer state as they were (a torch loop's ``if norm.isfinite():
        opt.step()``); reading the norm makes the host wait for the device.
        Returns the gradients' total norm before clipping (a device scalar, as torch's
        ``clip_grad_norm_`` returns it: reading it waits for the device), or None without
        ``max_grad_norm`` and ``skip_nonfinite``."""
        step = self.marker.step
        if self._committed_this_step:
            raise ScriptError(
                "state.step() was called twice in one iteration of state.steps(): call it "
                "once in every iteration"
            )
        if skip_nonfinite and self._presence is None:
            raise ScriptError(
                "state.step(skip_nonfinite=True) needs the gradients in leto's regions: it is "
                "not supported with an integration's gradient buffers (Megatron skips a step "
                "with a non-finite norm itself)"
            )
        self._loss.stage(loss)
        self._check_groups_unchanged()
        self._check_frozen_unchanged()
        self._check_params_unwritten()
        self._phases.mark("compute")
        absent = self._absent_grads()
        self._check_grads_bound()
        if self._presence is not None:
            self._presence.mark(absent)
        self.services.injector.point("sync")
        self._allreduce_grads()
        skipped = self._skipped(absent)
        if self._loss_scale is not None:
            if self._loss_scale.unscale():  # an inf or NaN: the update leaves everything
                skipped = self._skip_all()
            self._loss_scale.update()  # before the step's record (extras.before_commit)
        if self.layout.main_grad:  # clipping and the update read .grad
            for p, grad in zip(self.params, self.grad_views(), strict=True):
                p.grad = grad
        self._phases.mark("allreduce")
        if max_grad_value is not None:
            self._clamp(max_grad_value, skipped)
        norm = self._clip(max_grad_norm, skipped)
        if skip_nonfinite:
            norm, skipped = self._skip_if_nonfinite(step, norm, skipped)
        self._rng_next_host = rng_blob(self.device)
        rng = staged(self._rng_next_host, self.device)  # page-locked on CUDA
        self._rng_next.copy_(rng)
        self._phases.mark("clip")
        self._encode_grads()  # final gradients stay recoverable until the update commits
        self._phases.mark("encode_grads")
        self.updater.join()  # the last flush's IDLE store lands before these marker writes
        self._phases.mark("join")
        if self.protected and self.buffer_undo is not None:
            self._refuse_buffer_updates()
        # What a finishing recovery restores (leto.trainer.extras); a ReduceLROnPlateau's
        # replay needs the loss on the host (the script's own float(loss) would wait as long).
        metric = None
        if loss is not None and self.extras.wants_loss:
            metric = float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        self.extras.before_commit(step, loss=metric)
        self.marker.record_lrs([float(g["lr"]) for g in self.optimizer.param_groups])
        if not self.marker.stream_ordered:
            self.memory.fence()
        self.marker.advance(Phase.GRADS_READY)
        self._commit_barrier()
        self._phases.mark("barrier")
        self._update(step, skipped, rng)
        self._rng_host = self._rng_next_host  # what the commit installed in the RNG slot
        self._phases.mark("update")
        self._check_lent_memory_returned()
        self._phases.mark("lend_check")
        self._committed_this_step = True
        self.services.preinit.report()  # memory after the step, before the agent may read it
        lender = self._compute.lender
        self.services.events.emit(
            Kind.STEP_DONE,
            rank=self.services.rank,
            step=step,
            total=self._total,
            iter_s=time.perf_counter() - self._step_started,
            **self._loss.fields(last=step + 1 == self._total),
            **self._phases.fields(),
            **(
                {}
                if self.device.type != "cuda"
                else {"device_peak_bytes": self._device_peak_bytes()}
            ),
            **({} if lender is None else {"lent_bytes": lender.arena.lent_bytes()}),
            **self._compiled_fields(),
        )
        if not self._announced:  # this generation is training: the agent ends the recovery
            # After step_done, so the agent finds this first step in the events file.
            self.services.store.set(
                contract.stepped(self.services.env.generation, self.services.rank), "1"
            )
            self._announced = True
        self.services.committed(self)  # heartbeat + fatal-failure checkpoint (leto.checkpoint)
        return norm

    def _compiled_fields(self) -> dict[str, int]:
        """``compiled_graphs``: what Dynamo compiled during this step, where it did."""
        graphs = compiled.graphs_compiled() - self._graphs_at_begin
        return {"compiled_graphs": graphs} if graphs > 0 else {}

    def _skip_if_nonfinite(
        self, step: int, norm: torch.Tensor | None, skipped: frozenset[int]
    ) -> tuple[torch.Tensor, frozenset[int]]:
        """The total norm (``norm``, or computed here without clipping) and the parameters
        the update skips: every one where that norm is not finite. The norm is taken after
        the mean over the ranks, so every rank decides alike."""
        if norm is None:
            grads = [p.grad for p in self._norm_params(skipped) if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if bool(torch.isfinite(norm)):
            return norm, skipped
        logger.warning(
            "[rank %d step %d] gradient norm %s: the update leaves the parameters and the "
            "optimizer state as they were",
            self.services.rank,
            step,
            norm.item(),
        )
        if self.updater.grad_scale is not None:
            self.updater.grad_scale.fill_(1.0)  # a NaN coefficient must not reach a kernel
        return norm, self._skip_all()

    def _norm_params(self, skipped: frozenset[int]) -> list[torch.nn.Parameter]:
        """The parameters clipping reads, in ``model.parameters()`` order (the norm's last
        bits depend on it), without the ``skipped`` ones (no gradient this step)."""
        return [self.params[i] for i in self._norm_order if i not in skipped]

    def _clamp(self, value: float, skipped: frozenset[int]) -> None:
        """torch's ``clip_grad_value_`` over the averaged gradients, in their retained memory,
        before GRADS_READY (a finishing update applies the clamped gradients)."""
        torch.nn.utils.clip_grad_value_(self._norm_params(skipped), value)

    def _clip(self, max_grad_norm: float | None, skipped: frozenset[int]) -> torch.Tensor | None:
        """Clip to ``max_grad_norm``: where the updater scales the gradients as it reads
        them (``Updater.grad_scale``), by writing the coefficient there (a pass over the
        gradients saved); else in place. Either way before GRADS_READY, so a finishing
        update applies the gradients every rank applied. The ``skipped`` parameters (no
        gradient) are left out of the norm, as torch's clipping leaves out a None ``.grad``.
        Returns the total norm before clipping, as ``clip_grad_norm_`` does (None without
        ``max_grad_norm``)."""
        scale = self.updater.grad_scale
        sync = self.services.grad_sync()
        norm = coef = None
        if max_grad_norm is not None:
            params = self._norm_params(skipped)
            folded = None
            if scale is not None and self.shards is None:  # FSDP2's norm is a DTensor
                folded = sync.clip_coef(params, max_grad_norm)
            if folded is None:
                norm = sync.clip_(params, max_grad_norm)
            else:
                norm, coef = folded
        if scale is not None and coef is not None:
            scale.copy_(coef)
        elif scale is not None:
            scale.fill_(1.0)  # the gradients arrive clipped, or unclipped on purpose
        return norm

    def _check_groups_unchanged(self) -> None:
        """Refuse parameters added to the optimizer after ``retain()`` (``add_param_group``):
        the retained layout was planned from its groups then, so leto's update would never
        apply them, silently, where torch's optimizer would."""
        if _group_sizes(self.optimizer) != self._groups:
            raise ScriptError(
                "the optimizer's parameter groups changed after ctx.retain() (add_param_group?); "
                "leto plans retained memory from them: give the optimizer every parameter "
                "before ctx.retain() (one to train later with requires_grad_(False) until then)"
            )

    def _check_frozen_unchanged(self) -> None:
        """Refuse a parameter outside the optimizer that was written in place (``ScriptError``):
        it is retained as it was built, but no update of it is crash-consistent (an EMA copy
        among the model's parameters, say), so a recovery would resume it torn or stale."""
        self._refuse_written(
            self.frozen,
            self._frozen_versions,
            "is outside the optimizer but was written in place; leto retains such parameters "
            "as built and cannot make their updates crash-consistent: give it to the "
            "optimizer, or keep it out of the model and name its owner in "
            "ctx.retain(..., stateful=...)",
        )

    def _note_param_versions(self) -> None:
        """What ``_check_params_unwritten`` compares with: the parameters' version counters
        once leto has written them (bound, updated, resumed)."""
        self._param_versions = [p._version for p in self.params]

    def _check_params_unwritten(self) -> None:
        """Refuse a parameter of the optimizer that the script wrote in place since leto's
        last update (``ScriptError``): weight clipping after ``state.step()``, an
        ``nn.Embedding(max_norm=...)`` renormalising rows in forward, a load after
        ``retain()``. No such write is crash-consistent (a trainer killed in the update
        never ran the code after it; a re-run forward writes twice) nor in the parity."""
        self._refuse_written(
            self.params,
            self._param_versions,
            "was written in place outside leto's update (weight clipping after state.step(), "
            "nn.Embedding(max_norm=...), a load after ctx.retain()?); leto cannot make such a "
            "write crash-consistent: load weights before ctx.retain(), and let only "
            "state.step() change the optimizer's parameters",
        )

    def _refuse_written(self, params: list, versions: list[int], why: str) -> None:
        """``ScriptError`` naming the first of ``params`` whose version counter moved."""
        for p, version in zip(params, versions, strict=True):
            if p._version != version:
                names = {id(q): n for n, q in self.model.named_parameters()}
                raise ScriptError(f"parameter {names.get(id(p), '?')} {why}")

    def _check_lent_memory_returned(self) -> None:
        """Refuse a tensor of the compute phase kept in the lent undo memory (``ProtocolError``).

        Checked once the update is queued, while its kernels run: the host does not wait for
        the device here (its own time still counts where the host sets the pace). A kept tensor
        may by then be overwritten by the update's undo copies; that is the script's tensor,
        never retained state (the update reads gradients and state from their regions
        only), and the error ends the step before the script sees it again."""
        if self._compute.lender is not None:
            self._compute.lender.check_returned()

    def _commit_barrier(self) -> None:
        """Once any rank passes it, every rank's GRADS_READY of this step has landed (so its
        gradients are final). NCCL with a stream-ordered marker: a one-word all-reduce on the
        current stream, which no rank's later marker write can pass, and which leaves the
        host free to queue the update; otherwise the device work is waited for and the ranks
        meet: on CPU in the same one-word all-reduce (no rank's returns before every rank's
        began, as in a barrier, and gloo runs it faster than its barrier),
        else in a barrier. Alone in the world there is no one to wait for."""
        if self.services.world_size == 1:
            return
        if self.marker.stream_ordered and dist.get_backend() == "nccl":
            dist.all_reduce(self._barrier_word, op=dist.ReduceOp.MAX)
            return
        self.memory.fence()
        if self.device.type == "cpu":
            dist.all_reduce(self._barrier_word, op=dist.ReduceOp.MAX)
            return
        dist.barrier()

    def _device_peak_bytes(self) -> int:
        """This trainer's peak device footprint over its steps so far: its retained regions
        plus the caching allocator's peak reservation since ``steps()`` began, less the lent
        bytes the allocator holds (retained memory, counted once; the lent segments stay
        cached from the first step on)."""
        lender = self._compute.lender
        lent = lender.arena.lent_bytes() if lender is not None else 0
        return self.memory.device_bytes() + probe.reserved_bytes(self.device)[1] - lent

    def _absent_grads(self) -> list[int]:
        """This rank's parameters without a gradient this step: as the landing saw them, or
        under ``fully_shard`` (which reduce-scatters into the retained shards itself) those
        FSDP2 reduced none for; none in an integration's buffers."""
        landing = self._landing or self._arrival
        return [] if landing is None else landing.settle()

    def _skipped(self, absent: list[int]) -> frozenset[int]:
        """The parameters without a gradient on any rank, which the update leaves as torch's
        optimizers leave a parameter whose ``.grad`` is None (``leto.retained.presence``).
        One that does not require a gradient has none on any rank (every rank runs the same
        script), nor one FSDP2 reduced none for (its reduce-scatter runs over the same
        parameters on every rank); the others are read from the all-reduced presence words,
        a wait for the device paid only on a step where this rank had a parameter without a
        gradient."""
        if self._presence is None or not absent:
            return frozenset()
        if self._arrival is not None or all(not self.params[i].requires_grad for i in absent):
            skipped = frozenset(absent)
        else:
            skipped = self._presence.retained_skipped()
        if skipped:
            self._presence.note_uneven()
        return skipped

    def _skip_all(self) -> frozenset[int]:
        """Every parameter skipped, in the retained record a finishing update reads too."""
        if self._presence is None:  # the scaler is refused where there is none
            raise ProtocolError("a skipped step needs the retained presence words")
        self._presence.skip_all()
        return frozenset(range(len(self.params)))

    def _update(
        self, step: int, skipped: frozenset[int] = frozenset(), rng: torch.Tensor | None = None
    ) -> None:
        self.updater.run(step, skipped, rng)
        self._gather()
        self._note_param_versions()
        self._committed()

    def _gather(self) -> None:
        """A sharded optimizer's all-gather (``GradSync.gather``): part of the update of the
        step just committed, but outside its transaction. It reads only committed shards and
        writes only the unprotected full parameter buffers, so a kill inside it is repaired
        by the gather every rank runs at resume."""
        gather = self.services.grad_sync().gather
        if gather is not None:
            gather()
        elif self.mirror_regions:
            raise ProtocolError(
                "a sharded optimizer's full parameter buffers need ctx.grad_sync.gather"
            )

    def _committed(self) -> None:
        if self.services.env.digest:
            self.emit_digest()

    def _unbound_grads(self) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Parameters whose gradient (``.grad``, or ``main_grad`` when the integration's
        buffers hold them) is not its retained view, with that view."""
        seen = self._seen_grads()
        if self._seen_grad_ptrs is None:
            self._seen_grad_ptrs = [local(g).data_ptr() for g in seen]
        main = self.layout.main_grad
        for p, grad, ptr in zip(self.params, seen, self._seen_grad_ptrs, strict=True):
            bound = getattr(p, "main_grad", None) if main else p.grad
            if bound is grad and local(bound).data_ptr() == ptr:
                continue  # the common case, checked in a fraction of the full comparison
            if bound is None or local(bound).data_ptr() != ptr or bound.shape != grad.shape:
                yield p, grad

    def check_main_grads(self) -> None:
        """Every ``param.main_grad`` is its retained view (the integration built its buffers
        from the retained regions, as planned); raises ``ProtocolError`` otherwise."""
        unbound = [tuple(p.shape) for p, _ in self._unbound_grads()]
        if unbound:
            raise ProtocolError(
                f"{len(unbound)} main_grad buffers are not the retained gradient views planned "
                f"(first shape {unbound[0]}): the integration's buffer layout differs from leto's plan"
            )

    def _check_grads_bound(self) -> None:
        if self.layout.main_grad:
            self.check_main_grads()
            return
        if self._landing is not None:  # its settle() has bound every one, or refused
            return
        if next(self._unbound_grads(), None) is not None:
            raise ScriptError(
                "a gradient no longer lives in retained memory (was optimizer.zero_grad() "
                "called inside the step?); leto zeroes gradients at the start of each step"
            )

    def _landing_stream(self) -> torch.cuda.Stream | None:
        """A stream of its own for the large gradients' landing copies, beside the rest of
        backward (on CUDA, where no bucketed mean reads the views as they land)."""
        if self.device.type != "cuda" or self._buckets is not None:
            return None
        return torch.cuda.Stream(self.device)

    def _bucketed_mean(self) -> BucketedMean | None:
        """The overlapped mean over Leto's flat gradient region: plain data parallelism over
        more than one rank, every gradient of one dtype (else the mean runs after backward,
        ``_allreduce_grads``). Its first step launches during the backward pass the marker
        says the last step ran last (a promoted trainer's: its predecessor's)."""
        sync = self.services.grad_sync()
        if (
            self.shards is not None
            or self.layout.main_grad
            or sync.reduce is not None
            or self.layout.grad_scale is None
            or self.services.world_size == 1
            or sync.size() == 1
            or len({s.dtype for s in self.layout.grads}) != 1
        ):
            return None
        dtype = self.layout.grads[0].dtype
        size = element_size(dtype)
        (nbytes,) = (n for _, n in self.layout.grad_regions)
        flat = self.grad_regions["grads"][:nbytes].view(dtype)
        end = self.layout.grad_scale.offset // size
        starts = [s.offset // size for s in self.layout.grads]
        spans = list(zip(starts, [*starts[1:], end], strict=True))
        overlap = dist.get_backend(sync.group) == "nccl"  # gloo: see grad_buckets
        buckets = BucketedMean(flat[:end], spans, flat[end:], sync, overlap=overlap)
        buckets.expected = self.marker.recorded_passes()
        return buckets

    def _allreduce_grads(self) -> None:
        """Mean over ``ctx.grad_sync``'s group (the world unless an integration set its
        data-parallel group): the flat region's buckets when every gradient has one dtype
        (``BucketedMean``), else one all-reduce per gradient; or the integration's own
        reduction of its buffers (``GradSync.reduce``)."""
        sync = self.services.grad_sync()
        if sync.reduce is not None:
            sync.reduce()
            return
        if self.layout.main_grad:
            raise ProtocolError(
                "gradients live in an integration's buffers but ctx.grad_sync has no reduce"
            )
        if self._buckets is not None:
            self.marker.record_passes(self._buckets.finish())
            return
        if self.services.world_size == 1 or sync.size() == 1:
            return
        for p in self.params:  # gradients of several dtypes (one dtype: the buckets above)
            sync.all_reduce_mean_(p.grad)
        if self._presence is not None:  # in the flat case the region's reduction carries it
            sync.all_reduce_mean_(self._presence.words)

    # -- resume ------------------------------------------------------------------------------
    def _resume(self) -> int:
        """Agree with every rank on the resume point and bring this rank to it."""
        t0 = time.perf_counter()
        points = self._recovery.points()
        decision = decide_resume(points, self.services.rank)
        step, phase = self.marker.step, self.marker.phase
        action = "none"
        t_finish = time.perf_counter()
        if decision.action == ResumeAction.FINISH:
            self.extras.load_pre(step)  # the update reads the hyperparameters of its own step
            action = self._recovery.finish_update(step)
        elif decision.action == ResumeAction.RERUN:
            action = "rerun"
            if phase == Phase.GRADS_READY:  # its gradients are computed again
                self.marker.advance(Phase.IDLE)
        resume_at = decision.step
        report_unreported(
            self.services.events,
            rank=self.services.rank,
            step=resume_at - 1,
            total=self._total,
            iter_s=time.perf_counter() - t_finish
            if decision.action == ResumeAction.FINISH
            else 0.0,
        )
        # Step resume_at's forward may have begun on this rank: its buffers back to its start.
        buffers = self.buffer_undo is not None and self.buffer_undo.restore(resume_at)
        extras = self.extras.resume(resume_at)
        self.services.events.emit(
            Kind.RESUMED,
            rank=self.services.rank,
            gen=self.services.env.generation,
            step=resume_at,
            action=action,
            points=[list(p) for p in points],
            attach_s=self.attach_s,
            decide_s=time.perf_counter() - t0,
            mapped_ahead_step=self.mapped_ahead_step,
            extras=extras,
            buffers_restored=buffers,
        )
        self._gather()  # every rank: the full parameters from every rank's committed shards
        self._note_param_versions()
        if self.services.env.digest:
            self.emit_digest()
        return resume_at

    def emit_digest(self) -> str:
        """Digest of the state region but the host generators' states (with a sharded
        optimizer: and of the full parameters) and of the stateful objects at the last
        commit (``RetainedExtras.commit_digest``)."""
        # Python's and NumPy's generators are in the RNG slot, but left out: a script that
        # never seeds them starts each process from the OS's entropy, and what it draws
        # from them shows in the model state.
        end = self.layout.rng.offset + self.layout.rng.nbytes
        host, end = end - HOST_BYTES, -(-end // 8) * 8  # to the slot's padding: whole words
        parts = [
            self.memory.digest(self.state_region[:host]),
            self.memory.digest(self.state_region[end:]),
            *(self.memory.digest(region) for region in self.mirror_regions.values()),
            self.extras.commit_digest,
        ]
        digest = hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()
        self.services.events.emit(
            Kind.DIGEST, rank=self.services.rank, step=self.marker.step, digest=digest
        )
        return digest


def _group_sizes(optimizer: torch.optim.Optimizer) -> list[int]:
    """The sizes of ``optimizer``'s parameter groups, and of a ``ChainedOptimizer``'s parts'."""
    parts = [optimizer, *getattr(optimizer, "parts", ())]
    return [len(g["params"]) for part in parts for g in part.param_groups]


def report_unreported(
    events: EventLog, *, rank: int, step: int, total: int | None, iter_s: float
) -> None:
    """Write the ``step_done`` of ``step``, the last step committed on ``rank``, unless that
    rank's last ``step_done`` in the events file already covers it: a promoted trainer
    finished it (``iter_s``: that work), or its predecessor was killed between committing
    it and saying so. Its loss died with the predecessor."""
    path = events.path
    if step < 0 or path is None:
        return
    src = events.source
    last = last_event(path, lambda e: e.get("kind") == "step_done" and e.get("src") == src)
    if last is None or last.get("step", -1) < step:
        events.emit(
            Kind.STEP_DONE,
            rank=rank,
            step=step,
            total=total,
            iter_s=iter_s,
            loss=None,
            finished_in_recovery=True,
        )
