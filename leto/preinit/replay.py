"""Forward replay: a shadow runs its model's first step before any failure, on scratch memory.

A promoted trainer is a fresh process: its first iteration pays what a process pays once —
cuBLAS's algorithm choice for every GEMM shape, CUDA modules loaded at a kernel's first
launch, attention backend selection, autograd's device threads, the clip's foreach norms.
The kernel warm-up (``leto.preinit.warmup``) covers Leto's own kernels; this covers the
model's, for any ``nn.Module``:

* the active trainer records the shapes of its model's first call (:class:`ForwardRecorder`,
  a forward pre-hook removed after one call) and publishes them in the store
  (``contract.forward_spec``);
* its level-3 shadow, whose model is still on the meta device, builds a scratch copy
  (``copy.deepcopy`` + ``to_empty``; small normal weights, zero buffers), calls it with
  inputs of those shapes (zeros; masks all true) under the recorded autocast, backpropagates
  the sum of its floating outputs and clips the gradients (:func:`replay`), through
  ``leto.preinit.model_warmup.warm_model``'s rules: level 3, within the headroom the
  actives leave, skipped once a promotion is pending, the RNG forked.

Nothing retained is read or written: the copy is made from the meta model before binding.
Compiled modules are compiled in the copy with the model's settings, so the model's graphs
are in Dynamo's caches before any failure, with the hooks they saw recorded for the
promoted trainer to check (``leto.compiled.TracedHooks``); where the settings cannot be
read or capture CUDA graphs, they run eager and the compiler is warmed apart.
A ``fully_shard`` (FSDP2) model is replayed unsharded (:func:`unsharded_copy`): the same
modules with plain parameters of the full shapes in FSDP's compute dtype and without
FSDP's hooks, so the replay runs no collective and its kernels are the ones FSDP2's
unsharded compute launches; its compiled modules run eager (Dynamo would trace the plain
classes, not the sharded ones). The copy holds the whole model, so the headroom rule skips
it where that does not fit. Inputs that are not tensors, JSON scalars, lists, tuples or
string-keyed dicts and models that are not all on the meta device are not replayed; the
``model_warmed`` event says why.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from leto import compiled, contract
from leto.preinit.levels import DeviceMemory

if TYPE_CHECKING:
    from leto.preinit.site import ShadowSite

logger = logging.getLogger(__name__)

NAME = "forward replay"
"""The ``name`` of this warm-up's ``model_warmed`` event."""

_POLL_S = 0.02


class Unsupported(Exception):
    """A call this module cannot describe or replay (the message says what)."""


@dataclass(frozen=True, slots=True)
class ForwardSpec:
    """The shapes of one call of a model: its arguments as a tree, and its autocast dtype."""

    args: list[Any]
    kwargs: dict[str, Any]
    autocast: str | None
    """The autocast dtype (``"bfloat16"``) active for the inputs' device type, or None."""

    @classmethod
    def of(cls, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> ForwardSpec:
        tensors = [t for t in leaves((args, dict(kwargs))) if isinstance(t, torch.Tensor)]
        device_type = tensors[0].device.type if tensors else "cpu"
        autocast = None
        if torch.is_autocast_enabled(device_type):
            autocast = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
        return cls(
            args=[_encode(a) for a in args],
            kwargs={k: _encode(v) for k, v in kwargs.items()},
            autocast=autocast,
        )

    def to_json(self) -> str:
        return json.dumps({"args": self.args, "kwargs": self.kwargs, "autocast": self.autocast})

    @classmethod
    def from_json(cls, text: str) -> ForwardSpec:
        raw = json.loads(text)
        if "unsupported" in raw:
            raise Unsupported(raw["unsupported"])
        return cls(args=raw["args"], kwargs=raw["kwargs"], autocast=raw["autocast"])

    def inputs(self, device: torch.device) -> tuple[list[Any], dict[str, Any]]:
        """Arguments of these shapes on ``device``: zeros, boolean masks all true."""
        return [_decode(a, device) for a in self.args], {
            k: _decode(v, device) for k, v in self.kwargs.items()
        }


def _encode(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if type(x) not in (torch.Tensor, torch.nn.Parameter) or x.layout != torch.strided:
            raise Unsupported(f"a {type(x).__name__} ({x.layout}) argument")
        dtype = str(x.dtype).removeprefix("torch.")
        return {"tensor": list(x.shape), "dtype": dtype, "grad": x.requires_grad}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"value": x}
    if isinstance(x, (list, tuple)):
        return {"list" if isinstance(x, list) else "tuple": [_encode(v) for v in x]}
    if isinstance(x, dict) and all(isinstance(k, str) for k in x):
        return {"dict": {k: _encode(v) for k, v in x.items()}}
    raise Unsupported(f"a {type(x).__name__} argument")


def _decode(node: Mapping[str, Any], device: torch.device) -> Any:
    if "tensor" in node:
        dtype = getattr(torch, node["dtype"])
        make = torch.ones if dtype == torch.bool else torch.zeros
        return make(node["tensor"], dtype=dtype, device=device).requires_grad_(node["grad"])
    if "value" in node:
        return node["value"]
    if "list" in node:
        return [_decode(v, device) for v in node["list"]]
    if "tuple" in node:
        return tuple(_decode(v, device) for v in node["tuple"])
    return {k: _decode(v, device) for k, v in node["dict"].items()}


def leaves(x: Any) -> Iterator[Any]:
    """Tensors and scalars of nested lists, tuples and mappings (a Hugging Face
    ``ModelOutput`` is an ``OrderedDict``)."""
    if isinstance(x, Mapping):
        for v in x.values():
            yield from leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from leaves(v)
    else:
        yield x


class ForwardRecorder:
    """Publishes the shapes of ``model``'s first call, then removes itself."""

    def __init__(self, model: torch.nn.Module, publish: Callable[[str], None]) -> None:
        self._publish = publish
        self._handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.remove()
        try:
            text = ForwardSpec.of(args, kwargs).to_json()
        except Unsupported as e:
            text = json.dumps({"unsupported": str(e)})
        self._publish(text)

    def remove(self) -> None:
        self._handle.remove()


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What one replay ran."""

    parameters: int
    """Parameters that received a gradient (and went through the clip)."""
    backward: bool
    """The model returned a floating tensor with a gradient, so backward ran."""
    traced: compiled.TracedHooks | None = None
    """The hooks the model's compiled graphs were traced under; None: it ran eager."""
    eager: str | None = None
    """Why a model with compiled modules ran eager, or None."""


def replay(model: torch.nn.Module, spec: ForwardSpec, device: torch.device) -> ReplayResult:
    """One forward, backward and clip of a scratch copy of the meta-device ``model``.

    Its compiled modules are compiled in the copy (``leto.compiled.compile_like``); where
    that cannot be done they run eager (``torch.compiler.set_stance``) and ``eager`` says
    why. A replay that raises leaves no graph: Dynamo's caches are dropped."""
    if _sharded(model):
        scratch, compiling = unsharded_copy(model), False
        eager = "FSDP2: replayed unsharded" if compiled.compiled_modules(model) else None
    else:
        scratch = copy.deepcopy(model)
        try:
            compiling = compiled.compile_like(model, scratch) > 0
            eager = None
        except ValueError as e:
            compiling, eager = False, str(e)
    if not compiling:
        with torch.compiler.set_stance("force_eager"):
            return dataclasses.replace(_replay(scratch, spec, device), eager=eager)
    traced = compiled.TracedHooks.of(model)  # the copy's hooks are the model's, as copied
    try:
        result = _replay(scratch, spec, device)
    except BaseException:
        torch._dynamo.reset()  # graphs of a failed replay are not kept
        raise
    return dataclasses.replace(result, traced=traced)


def _sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are ``DTensor``s (``fully_shard``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _fsdp_hook(hook: Any) -> bool:
    fn = getattr(hook, "__func__", hook)
    return getattr(fn, "__module__", "").startswith("torch.distributed.fsdp")


def unsharded_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of a ``fully_shard`` meta ``model`` (``copy.deepcopy`` refuses FSDP
    modules): each module of its original class; its parameters plain meta tensors of their
    full shapes in the compute dtype of FSDP's mixed precision (else their own), buffers
    new on meta; FSDP's state left out, and its hooks from the shared hook registries; every
    other attribute deep-copied as ``deepcopy`` would (a cache the forward fills stays the
    copy's), references to the model's modules becoming their copies; nothing compiled."""
    from torch.distributed.fsdp import FSDPModule

    dtype: torch.dtype | None = None
    if isinstance(model, FSDPModule):
        policy = getattr(model._get_fsdp_state(), "_mp_policy", None)
        dtype = getattr(policy, "param_dtype", None)
    memo: dict[int, Any] = {}
    modules = list(model.modules())
    for module in modules:  # every copy exists before any attribute refers to it
        cls = type(module)
        if issubclass(cls, FSDPModule):
            cls = next(c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule))
        memo[id(module)] = cls.__new__(cls)
    for module in modules:
        state: dict[str, Any] = {}
        for name, value in module.__dict__.items():
            if name.startswith("__composable_api_state_key"):
                continue  # FSDP's state of the module (its process groups, its streams)
            if name == "_parameters":
                value = {k: None if p is None else _plain_param(p, dtype) for k, p in value.items()}
            elif name == "_buffers":
                value = {
                    k: None if b is None else torch.empty(b.shape, dtype=b.dtype, device="meta")
                    for k, b in value.items()
                }
            elif name == "_modules":
                value = {k: None if m is None else memo[id(m)] for k, m in value.items()}
            elif name == "_compiled_call_impl":
                value = None
            elif "hooks" in name and isinstance(value, dict):
                value = type(value)((k, h) for k, h in value.items() if not _fsdp_hook(h))
            else:
                value = copy.deepcopy(value, memo)
            state[name] = value
        memo[id(module)].__dict__.update(state)
    return memo[id(model)]


def _plain_param(p: torch.Tensor, dtype: torch.dtype | None) -> torch.nn.Parameter:
    """A plain meta parameter of ``p``'s full shape, in ``dtype`` if it is floating."""
    dtype = dtype if dtype is not None and p.is_floating_point() else p.dtype
    return torch.nn.Parameter(
        torch.empty(p.shape, dtype=dtype, device="meta"), requires_grad=p.requires_grad
    )


SMALL_SLACK_BYTES = 16 << 20
"""Small-block memory (requests of at most 1 MiB, carved from 2 MiB segments) the replay
leaves free in the cache beyond its own blocks: a first step asks for some the replay did not
(FSDP2's pre-forward casts each block's floating inputs, a RoPE table, which the unsharded
copy does not), and a segment asked of the driver right after the predecessor's memory was
freed can cost milliseconds."""
PINNED_BINS = range(6, 17)
"""The caching host allocator's size classes (powers of two, 64 B to 64 KiB) the replay
leaves page-locked blocks of: a first step's multi-tensor kernels stage their metadata there
(FSDP2's ``_chunk_cat`` of each reduce-scatter), the loss and RNG copies their bytes, and a
fresh process's first request of each class costs a ``cudaHostAlloc`` (about a millisecond)."""
PINNED_PER_BIN = 8
"""Blocks per class: as many as a step keeps in flight before their copies have run."""


def _first_step_slack(device: torch.device) -> None:
    """Allocate and free what a promoted trainer's first step asks for beyond the replay's
    own blocks (``SMALL_SLACK_BYTES``, ``PINNED_BINS``): the caching allocators keep them."""
    if device.type != "cuda":
        return
    small = [
        torch.empty(1 << 20, dtype=torch.uint8, device=device)
        for _ in range(SMALL_SLACK_BYTES >> 20)
    ]
    del small
    try:  # best effort: a host that refuses page-locked memory keeps the replay's other gains
        pinned = [
            torch.empty(1 << b, dtype=torch.uint8, pin_memory=True)
            for b in PINNED_BINS
            for _ in range(PINNED_PER_BIN)
        ]
    except RuntimeError as e:
        logger.info("no page-locked blocks left for the first step: %s", str(e).splitlines()[0])
        return
    del pinned


def _replay(scratch: torch.nn.Module, spec: ForwardSpec, device: torch.device) -> ReplayResult:
    scratch.to_empty(device=device)
    with torch.no_grad():
        for p in scratch.parameters():
            if p.is_floating_point():
                p.normal_(0.0, 0.02)
            else:
                p.zero_()
        for b in scratch.buffers():
            b.zero_()
    args, kwargs = spec.inputs(device)
    dtype = getattr(torch, spec.autocast) if spec.autocast else None
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        out = scratch(*args, **kwargs)
    losses = [
        t.float().sum()
        for t in leaves(out)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad
    ]
    if losses:
        torch.stack(losses).sum().backward()
    params = [p for p in scratch.parameters() if p.grad is not None]
    if params:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    _first_step_slack(device)
    return ReplayResult(parameters=len(params), backward=bool(losses))


def setting_reason(setting: bool | None, device: torch.device) -> str | None:
    """Why ``preinit.replay_forward`` turns the replay off on ``device``, or None (on). The
    active publishes its shapes under the same rule its shadows replay them."""
    if setting is False:
        return "preinit.replay_forward: false"
    if setting is None and device.type != "cuda":
        return "off on CPU (preinit.replay_forward unset)"
    return None


def skip_reason(site: ShadowSite, model: torch.nn.Module) -> str | None:
    """Why this shadow does not replay its model's forward, or None."""
    if site.forward_collectives and not _sharded(model):  # FSDP2's are its hooks': left out
        return "an integration's gradient sync: its forward may run collectives"
    reason = setting_reason(site.env.preinit.replay_forward, site.device)
    if reason is not None:
        return reason
    tensors = [*model.parameters(), *model.buffers()]
    if not all(t.is_meta for t in tensors):
        return "the shadow's model is not on the meta device"
    return None


def scratch_bytes(model: torch.nn.Module) -> int:
    """Device bytes of the copy's parameters, their gradients and its buffers."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return 2 * params + sum(b.numel() * b.element_size() for b in model.buffers())


def transient_bytes(model: torch.nn.Module) -> Callable[[DeviceMemory], int]:
    """The replay's device memory at peak: the copy plus the active's allocator peak
    (its activations and temporaries: the replay runs the same step), and the small blocks
    it leaves for the first step (``SMALL_SLACK_BYTES``)."""
    fixed = scratch_bytes(model) + SMALL_SLACK_BYTES
    return lambda device: fixed + device.peak_bytes // max(1, device.ranks)


def wait_for_spec(site: ShadowSite, wait_s: float) -> ForwardSpec | str:
    """The active's published call shapes, or why there are none (promotion, timeout)."""
    key, promote = (
        contract.forward_spec(site.rank),
        contract.promote(site.env.generation, site.rank),
    )
    deadline = time.monotonic() + wait_s
    while not site.store.check([key]):
        if site.store.check([promote]):
            return "promoted before the active trainer's first forward"
        if time.monotonic() > deadline:
            return f"no forward shapes from the active trainer in {wait_s:.0f} s"
        time.sleep(_POLL_S)
    try:
        return ForwardSpec.from_json(site.store.get(key).decode())
    except Unsupported as e:
        return f"the model's call cannot be replayed: {e}"
