"""Model warm-up: a shadow pays, before any failure, what its first iteration would pay.

A promoted trainer runs its first iteration in a fresh process: compiled fusions
(``torch.compile`` / TorchScript specialisations, kept per process), cuBLAS's choices for
the job's GEMM shapes, lazily loaded kernels. ``leto.init()`` warms PyTorch generically
(``leto.trainer.context.warm_up``); an integration that knows the model's real shapes
(``leto.integrations.megatron.warm_up_shadow``) passes a callable that runs a throwaway
copy of part of the model here, so the same specialisations are cached in the shadow.

Rules, so that the warm-up can neither change the run nor cost the actives memory:

* only a shadow at level 3 runs it (a lower level was chosen because memory is short);
* it runs before ``ctx.retain()``: nothing retained is mapped in this process yet, and the
  callable gets no handle on it; the RNG is forked around it (and the promoted trainer
  restores its step's RNG from retained memory anyway);
* it waits for the active trainer's first memory report and runs only if the headroom the
  actives left (``DeviceMemory.headroom_bytes``, their peak counted) covers its estimated
  transient plus the controller's margin; afterwards the caching allocator's blocks are
  returned (``torch.cuda.empty_cache``), so the shadow keeps its level's footprint;
* a promotion that arrives meanwhile wins: the shadow skips the warm-up.

A warm-up that raises is reported and skipped, never fatal (the first iteration then pays
what it would have warmed), unless the device context is broken: that shadow must die.

Every decision is one ``model_warmed`` event (``ran``, ``reason``, seconds, bytes).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from leto import compiled, contract
from leto.events import Kind
from leto.preinit import board, replay
from leto.preinit.levels import DeviceMemory, ShadowLevel, aggregate

if TYPE_CHECKING:
    from leto.preinit.site import ShadowSite

logger = logging.getLogger(__name__)

_POLL_S = 0.02


@dataclasses.dataclass(kw_only=True, slots=True)
class ModelWarmupConfig:
    """How long a shadow waits to learn the actives' memory before warming up."""

    report_wait_s: float = 300.0
    """Longest wait for the active trainer's first memory report (its first committed
    step); without one the warm-up is skipped."""
    min_level: int = ShadowLevel.L3
    """Lowest shadow level that warms up."""


@dataclasses.dataclass(frozen=True, slots=True)
class ModelWarmupResult:
    """What ``warm_model`` did (the ``model_warmed`` event carries the same fields)."""

    ran: bool
    reason: str
    warm_s: float = 0.0
    transient_bytes: int = 0
    """The caller's estimate of the warm-up's transient device memory."""
    peak_bytes: int = 0
    """Measured on a GPU: the caching allocator's peak during the warm-up, over its start."""
    kept_bytes: int = 0
    """On a GPU: free blocks the caching allocator kept afterwards (``keep_cache``)."""
    compiled_graphs: int = 0
    """``torch.compile`` graphs compiled during the warm-up (dynamo's unique graphs)."""


def warm_model(
    site: ShadowSite,
    fn: Callable[[], object],
    *,
    name: str,
    transient_bytes: int | Callable[[DeviceMemory], int] = 0,
    agree: Callable[[bool], bool] | None = None,
    config: ModelWarmupConfig | None = None,
    keep_cache: bool = False,
) -> ModelWarmupResult | None:
    """Run ``fn`` in this shadow if its level and the actives' memory allow; None in an active.

    ``fn`` builds and runs whatever it warms (throwaway modules on ``site.device``); it must
    not touch the model being retained. ``transient_bytes``: its device memory at peak, or
    how to compute it from the actives' memory report (0 without one).
    ``agree``: when ``fn`` runs collectives (tensor parallelism), turns this shadow's go/no-go
    into its group's (all or none), so no shadow waits in a collective for a peer that skipped.
    ``keep_cache``: the caching allocator keeps the blocks ``fn`` freed (at most its transient,
    which the headroom covered), for the promoted trainer's first step to reuse.
    """
    if not site.is_shadow:
        return None
    config = config or ModelWarmupConfig()
    result, transient = _decide(site, transient_bytes, config)
    if agree is not None and not agree(result is None) and result is None:
        result = ModelWarmupResult(
            ran=False,
            reason="a peer in its collectives' group skips it",
            transient_bytes=transient,
        )
    if result is None:
        result = _run(site, fn, transient, keep_cache)
    _emit(site, name, result)
    return result


def _emit(site: ShadowSite, name: str, result: ModelWarmupResult) -> None:
    site.events.emit(
        Kind.MODEL_WARMED,
        rank=site.rank,
        gen=site.env.generation,
        level=site.env.shadow_level,
        name=name,
        **dataclasses.asdict(result),
    )
    log = logger.info if result.ran else logger.warning
    log(
        "[rank %d shadow gen %d] warm-up %s %s: %s (%.2f s)",
        site.rank,
        site.env.generation,
        name,
        "ran" if result.ran else "skipped",
        result.reason,
        result.warm_s,
    )


def _decide(
    site: ShadowSite, transient: int | Callable[[DeviceMemory], int], config: ModelWarmupConfig
) -> tuple[ModelWarmupResult | None, int]:
    """A skip with its reason, or None: go ahead; and the transient bytes resolved."""
    estimate = transient if isinstance(transient, int) else 0
    level = site.env.shadow_level
    if level < config.min_level:
        return ModelWarmupResult(
            ran=False,
            reason=f"shadow level {level} < {config.min_level}: memory is short",
            transient_bytes=estimate,
        ), estimate
    report = _wait_for_report(site, config.report_wait_s)
    if isinstance(report, str):
        return ModelWarmupResult(ran=False, reason=report, transient_bytes=estimate), estimate
    if site.store.check([_promote_key(site)]):  # the first iteration will pay it now anyway
        return ModelWarmupResult(
            ran=False, reason="already promoted", transient_bytes=estimate
        ), estimate
    if report is None:  # no memory figures (CPU without emulation): nothing to respect
        return None, estimate
    device = aggregate([report])[0]
    estimate = transient if isinstance(transient, int) else transient(device)
    needed = estimate + site.env.preinit.margin_bytes
    if device.headroom_bytes < needed:
        return ModelWarmupResult(
            ran=False,
            transient_bytes=estimate,
            reason=f"headroom {device.headroom_bytes} B < warm-up {estimate} B + margin "
            f"{site.env.preinit.margin_bytes} B",
        ), estimate
    return None, estimate


def _wait_for_report(
    site: ShadowSite, wait_s: float
) -> tuple[int, int, int, int, int] | str | None:
    """The active's newest memory report (None: it reports none), or why there is none."""
    hb = site.heartbeat
    if hb is None:
        return None  # not under leto-run's agent
    key = _promote_key(site)
    deadline = time.monotonic() + wait_s
    while hb.word(board.MEM_SEQ) == 0:
        if site.store.check([key]):
            return "promoted before the active trainer reported its memory"
        if time.monotonic() > deadline:
            return f"no memory report from the active trainer in {wait_s:.0f} s"
        time.sleep(_POLL_S)
    words = tuple(hb.word(i) for i in board.MEM_WORDS)
    return None if words[1] == 0 else words  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardWarmup:
    """What a shadow's forward replay did (its ``model_warmed`` event), and the hooks the
    model's compiled graphs were traced under (None: none were compiled)."""

    result: ModelWarmupResult
    traced: compiled.TracedHooks | None = None


def warm_forward(
    site: ShadowSite, model: torch.nn.Module, *, keep_cache: bool = False
) -> ForwardWarmup | None:
    """A shadow's forward replay (``leto.preinit.replay``) under :func:`warm_model`'s rules;
    None (and no event) where it does not apply: an active trainer, CPU unless asked, an
    integration's model (its own warm-up, collectives in its forward), a sharded model."""
    if not site.is_shadow:
        return None
    if replay.skip_reason(site, model) is not None:
        return None
    config = ModelWarmupConfig()
    spec = replay.wait_for_spec(site, config.report_wait_s)
    if isinstance(spec, str):
        result = ModelWarmupResult(ran=False, reason=spec)
        _emit(site, replay.NAME, result)
        return ForwardWarmup(result)
    replayed: list[replay.ReplayResult] = []
    result = warm_model(
        site,
        lambda: replayed.append(replay.replay(model, spec, site.device)),
        name=replay.NAME,
        transient_bytes=replay.transient_bytes(model),
        config=config,
        keep_cache=keep_cache,
    )
    assert result is not None  # a shadow's
    if replayed and replayed[0].eager is not None:
        logger.info("[rank %d shadow] forward replay ran eager: %s", site.rank, replayed[0].eager)
    return ForwardWarmup(result, replayed[0].traced if replayed and result.ran else None)


COMPILER = "compiler"
"""The ``name`` of :func:`warm_compiler`'s ``model_warmed`` event."""

_COMPILER_TRANSIENT_BYTES = 1 << 20
"""The throwaway function's device memory (a few KiB of tensors), rounded up."""


def warm_compiler(
    site: ShadowSite, model: torch.nn.Module, replayed: ForwardWarmup | None = None
) -> ModelWarmupResult | None:
    """In a level-3 shadow of a model with compiled modules: ``compiled.compile_once`` with
    the model's compile settings, under :func:`warm_model`'s rules. None (and no event)
    where it does not apply: an active trainer, a model without compiled modules,
    ``preinit.warm_kernels: false``, a forward replay that compiled the model (``replayed``:
    the compiler's first use is paid)."""
    if not site.is_shadow or not site.env.preinit.warm_kernels:
        return None
    if replayed is not None and replayed.traced is not None:
        return None
    found = compiled.compiled_modules(model)
    if not found:
        return None
    settings = [c for _, c in found if c is not None]
    if not settings:
        result = ModelWarmupResult(
            ran=False, reason=f"the compile settings of {found[0][0] or 'the model'} are unreadable"
        )
        _emit(site, COMPILER, result)
        return result
    return warm_model(
        site,
        lambda: compiled.compile_once(settings[0], site.device),
        name=COMPILER,
        transient_bytes=_COMPILER_TRANSIENT_BYTES,
    )


SHARDED_CLIP = "sharded clip"
"""The ``name`` of :func:`warm_sharded_clip`'s ``model_warmed`` event."""


def warm_sharded_clip(
    site: ShadowSite, params: list[torch.nn.Parameter]
) -> ModelWarmupResult | None:
    """In a level-3 shadow of a ``fully_shard`` model: torch's ``clip_grad_norm_`` once over
    gradients on the meta device with the parameters' ``DTensor`` layouts, under
    :func:`warm_model`'s rules. A process's first clip over DTensors computes DTensor's
    sharding propagation for each op and shape (~0.1 s for a 1 B model; a steady clip takes
    a few ms); computed here, the promoted trainer's first clip finds it cached. On meta
    nothing is computed and the redistribution's all-reduce communicates nothing (its meta
    kernel). None (and no event) where it does not apply: an active trainer, parameters
    that are not DTensors, ``preinit.warm_kernels: false``."""
    from torch.distributed.tensor import DTensor

    if not site.is_shadow or not site.env.preinit.warm_kernels:
        return None
    sharded = [p for p in params if isinstance(p, DTensor) and p.requires_grad]
    if not sharded:
        return None
    return warm_model(site, lambda: _clip_on_meta(sharded), name=SHARDED_CLIP)


def _clip_on_meta(params: list[torch.nn.Parameter]) -> None:
    import types

    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grad

    grads = [
        DTensor.from_local(
            torch.empty(p.to_local().shape, dtype=p.dtype, device="meta"),
            p.device_mesh,
            p.placements,
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )
        for p in params
    ]
    supported = clip_grad._device_has_foreach_support  # refuses meta: the trainer's path is foreach
    clip_grad._device_has_foreach_support = lambda d: d.type == "meta" or supported(d)
    try:
        holders = [types.SimpleNamespace(grad=g) for g in grads]  # what the clip reads
        torch.nn.utils.clip_grad_norm_(holders, 1.0, foreach=True)  # type: ignore[arg-type]
    finally:
        clip_grad._device_has_foreach_support = supported


def cached_free(device: torch.device) -> bool:
    """Whether the caching allocator holds free blocks on ``device`` (a warm-up's, kept)."""
    if device.type != "cuda":
        return False
    return torch.cuda.memory_reserved(device) > torch.cuda.memory_allocated(device)


def _promote_key(site: ShadowSite) -> str:
    return contract.promote(
        site.env.generation, site.rank
    )  # set by the agent (Context._wait_for_promotion)


def _run(
    site: ShadowSite, fn: Callable[[], object], transient_bytes: int, keep_cache: bool
) -> ModelWarmupResult:
    from torch._dynamo.utils import counters

    device = site.device
    cuda = device.type == "cuda"
    graphs = counters["stats"]["unique_graphs"]
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
    t0 = time.perf_counter()
    ran, reason, peak, kept = True, "ok", 0, 0
    with torch.random.fork_rng(devices=[device] if cuda else []):
        try:
            fn()
            if cuda:
                torch.cuda.synchronize(device)
        except torch.OutOfMemoryError as e:  # the actives' demand grew meanwhile: they win
            ran, reason = False, f"out of memory: {str(e).splitlines()[0]}"
        except Exception as e:  # noqa: BLE001 - reported; the shadow stays promotable
            if cuda:  # unless the error broke the device context: then this raises, and the
                torch.cuda.synchronize(device)  # shadow dies rather than be promoted broken
            first = str(e).splitlines()[0] if str(e) else ""
            ran, reason = False, f"failed: {type(e).__name__}: {first}"[:300]
    if cuda:
        peak = torch.cuda.max_memory_allocated(device) - base
        # Back to the level's footprint: only where this warm-up grew the cache, so that blocks
        # an earlier warm-up kept for the first step (the forward replay's) stay kept.
        if not (keep_cache and ran) and torch.cuda.memory_reserved(device) > reserved:
            torch.cuda.empty_cache()
        kept = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return ModelWarmupResult(
        ran=ran,
        reason=reason,
        warm_s=time.perf_counter() - t0,
        transient_bytes=transient_bytes,
        peak_bytes=peak,
        kept_bytes=kept,
        compiled_graphs=counters["stats"]["unique_graphs"] - graphs,
    )
