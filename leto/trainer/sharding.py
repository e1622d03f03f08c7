"""FSDP2 (``torch.distributed.fsdp.fully_shard``) parameters retained shard by shard.

What FSDP2 (torch 2.13) keeps per parameter (``FSDPParam``): the parameter is split along
dim 0 over the mesh (``Shard(0)``); each rank holds ``_sharded_param_data``, its chunk
padded to the size of chunk 0 (flat), and the module's parameter is a ``DTensor`` whose
local tensor is the unpadded front of it. Forward all-gathers ``_sharded_param_data``
(cast to ``param_dtype`` under a ``MixedPrecisionPolicy``); backward reduce-scatters the
gradients (in ``reduce_dtype``, averaged) and adds them in place into the sharded
gradient's local tensor when ``.grad`` is already set. The optimizer's state of a
sharded parameter is a ``DTensor`` of the same placement.

Here every retained tensor of a sharded parameter has the *padded local* shape: its
slot of the "state" region is the padded chunk (``_sharded_param_data`` is that slot, the
``DTensor``'s local tensor its front), its gradient and its optimizer state slots likewise
(what the module, the optimizer and DCP see are ``DTensor`` views of the front rows, made
by FSDP's own ``to_sharded_dtensor``). The padding rows stay zero: a zero gradient leaves a
zero parameter and zero moments under every element-wise update. The layout is planned
from shapes alone, so a shadow plans from its ``meta`` model after ``fully_shard``. The RMU
updates the flat local shards chunk by chunk as for any model; the gradients need no
reduction of Leto's (FSDP2 reduce-scattered them in backward), and clipping is torch's
``clip_grad_norm_`` over the ``DTensor`` gradients, so a job trains bit for bit as the same
script with torch's optimizer step.

Refused at ``retain()`` with the reason: a mesh of more than one dimension (HSDP, FSDP +
tensor parallel), a mesh that is not the whole world, ``Shard(d > 0)`` placements, CPU
offload, parameters not sharded by ``fully_shard`` next to sharded ones, ``DTensor``
parameters of another origin, and optimizers whose update is
not element-wise (a shard would see only its rows: Muon, Adafactor).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from leto.errors import ConfigError, ScriptError
from leto.trainer.grad_sync import GradSync
from leto.trainer.rebind import rebind

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

ELEMENTWISE_OPTIMIZERS = (
    "Adam",
    "AdamW",
    "SGD",
    "Adagrad",
    "Adamax",
    "ASGD",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
)
"""``torch.optim`` classes whose update of a parameter is element-wise (a shard's rows
update as they would inside the whole parameter)."""


@dataclass(frozen=True, slots=True)
class FsdpShard:
    """One FSDP2-sharded parameter of this rank."""

    fsdp_param: FSDPParam
    padded_shape: tuple[int, ...]
    """The padded local chunk: what every retained tensor of the parameter is shaped as."""
    rows: int
    """Rows (dim 0) of this rank's chunk that belong to the parameter."""

    def front(self, padded: torch.Tensor) -> torch.Tensor:
        return padded.narrow(0, 0, self.rows)

    def dtensor(self, padded: torch.Tensor) -> torch.Tensor:
        """``padded``'s front rows as the ``DTensor`` FSDP2 gives this parameter."""
        return self.fsdp_param.to_sharded_dtensor(self.front(padded))


def has_dtensor_params(params: Sequence[torch.Tensor]) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


class FsdpShards:
    """The FSDP2 shards among an optimizer's parameters (by index into them)."""

    def __init__(self, shards: dict[int, FsdpShard], mesh_shape: tuple[int, ...]) -> None:
        self.shards = shards
        self.mesh_shape = mesh_shape

    @classmethod
    def find(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.nn.Parameter],
        world_size: int,
    ) -> FsdpShards:
        """Every parameter of ``params`` must be a ``fully_shard`` shard over the whole world
        on a 1-D mesh; raises ``ConfigError`` naming what is not."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        owners: dict[int, FSDPParam] = {}
        for module in model.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                for fp in group.fsdp_params if group is not None else ():
                    owners[id(fp.sharded_param)] = fp
        if type(optimizer).__name__ not in ELEMENTWISE_OPTIMIZERS:
            raise ConfigError(
                f"{type(optimizer).__name__} under fully_shard: leto updates each rank's "
                "shard alone, which needs an element-wise optimizer "
                f"({', '.join(ELEMENTWISE_OPTIMIZERS)})"
            )
        shards: dict[int, FsdpShard] = {}
        mesh_shape: tuple[int, ...] = ()
        for i, p in enumerate(params):
            name = names.get(id(p), f"parameter {i}")
            fp = owners.get(id(p))
            if fp is None:
                what = "a DTensor not made by fully_shard" if isinstance(p, DTensor) else "not"
                raise ConfigError(
                    f"{name} is {what} sharded by fully_shard while other parameters are: "
                    "apply fully_shard to the root module too (leto retains FSDP2 shards "
                    "of every parameter, or of none)"
                )
            mesh = fp.mesh_info.mesh
            if mesh.ndim != 1:
                raise ConfigError(
                    f"{name} is sharded over a {mesh.ndim}-D mesh {tuple(mesh.shape)} (HSDP or "
                    "FSDP with tensor parallelism): leto supports fully_shard over a 1-D mesh"
                )
            if mesh.size() != world_size:
                raise ConfigError(
                    f"{name} is sharded over {mesh.size()} of {world_size} ranks: leto supports "
                    "fully_shard over a mesh of the whole world"
                )
            if fp.fsdp_placement.dim != 0:
                raise ConfigError(
                    f"{name}: Shard({fp.fsdp_placement.dim}) placements are not supported"
                )
            if fp.offload_to_cpu:
                raise ConfigError(f"{name}: fully_shard's CPUOffloadPolicy is not supported")
            padded = tuple(fp.padded_sharded_param_size)
            rows = fp.sharded_size[0] if len(fp.sharded_size) else 0
            shards[i] = FsdpShard(fp, padded, rows)
            mesh_shape = tuple(mesh.shape)
        return cls(shards, mesh_shape)

    def stand_ins(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``meta`` tensors of each parameter's retained shape (the padded local chunk)."""
        out = []
        for i, p in enumerate(params):
            shard = self.shards.get(i)
            shape = tuple(p.shape) if shard is None else shard.padded_shape
            out.append(torch.empty(shape, dtype=p.dtype, device="meta"))
        return out

    def description(self, params: Sequence[torch.Tensor]) -> str:
        """What a reattaching trainer must match besides the local shapes: the mesh and the
        global shapes (a different world size cuts other chunks)."""
        return repr(("fsdp2", self.mesh_shape, [tuple(p.shape) for p in params]))

    def bind_param(self, i: int, p: torch.nn.Parameter, padded: torch.Tensor, fresh: bool) -> None:
        """Make parameter ``i`` (a sharded ``DTensor``) live in ``padded``, its retained slot:
        FSDP2's all-gather input is the slot, the parameter's local tensor its front rows."""
        shard = self.shards[i]
        if fresh:
            padded.zero_()
            shard.front(padded).copy_(p.to_local())
        new = torch.nn.Parameter(shard.dtensor(padded), requires_grad=p.requires_grad)
        rebind(p, new)  # the optimizer and the module keep the same object
        shard.fsdp_param._sharded_param_data = padded.view(-1)

    def seen(self, i: int, view: torch.Tensor) -> torch.Tensor:
        """A retained view of parameter ``i``'s gradient or state as torch sees it: the
        ``DTensor`` of its front rows for a sharded parameter's padded tensors, else itself."""
        shard = self.shards.get(i)
        if shard is None or tuple(view.shape) != shard.padded_shape:
            return view
        return shard.dtensor(view)

    def grad_sync(self) -> GradSync:
        """FSDP2 reduce-scattered the gradients in backward; clipping is torch's
        ``clip_grad_norm_`` over the ``DTensor`` gradients (the global norm over the shards,
        as torchtitan clips)."""
        return GradSync(reduce=_reduced_in_backward, collectives_in_backward=True)


class ShardGradArrival:
    """Which sharded parameters received a gradient this step, each kept in retained memory.

    FSDP2 reduce-scatters each gradient into the retained shard itself (adding into the
    ``.grad`` view bound at the step's start, or assigning a fresh ``DTensor`` where the
    script unset ``.grad`` with ``optimizer.zero_grad()``, which the hook copies into the
    view) and then runs the sharded parameter's post-accumulate-grad hooks. A parameter no
    rank used in the step is left out of the reduce-scatter (FSDP2 needs every rank to
    reduce the same parameters, or to send zeros for its unused ones:
    ``set_reduce_scatter_unused_params``), so torch's optimizer finds its ``.grad`` None
    and skips it. Leto's update skips the parameters without an arrival likewise
    (``leto.retained.presence``); every rank finds the same ones, with no collective.

    A parameter frozen when the job began gets its hook too (registered with
    ``requires_grad`` raised for the moment), so one unfrozen later is seen arriving.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], views: Sequence[torch.Tensor]) -> None:
        self.params, self.views = list(params), list(views)
        self.arrived = [False] * len(self.params)
        for i, p in enumerate(self.params):
            frozen = not p.requires_grad
            if frozen:
                p.requires_grad_(True)
            p.register_post_accumulate_grad_hook(self._hook(i))
            if frozen:
                p.requires_grad_(False)

    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        view, arrived = self.views[i], self.arrived

        def reduced(p: torch.Tensor) -> None:
            grad = p.grad
            if grad is not view:  # FSDP2 assigned it: the script unset .grad (zero_grad())
                local(view).copy_(local(grad))
                p.grad = view
            arrived[i] = True

        return reduced

    def begin(self) -> None:
        """At the step's start (and an OOM retry's), once the region is zeroed and the
        views bound: no gradient has arrived yet."""
        self.arrived[:] = [False] * len(self.arrived)

    def settle(self) -> list[int]:
        """After the compute phase: every ``.grad`` is its retained view again; the
        parameters FSDP2 reduced no gradient for (their views hold the zeros of the step's
        start) are returned."""
        absent = []
        for i, (p, view) in enumerate(zip(self.params, self.views, strict=True)):
            if self.arrived[i]:
                continue
            if p.grad is not None and p.grad is not view:
                raise ScriptError(
                    "a gradient no longer lives in retained memory: it was set outside "
                    "backward (p.grad = ...); only FSDP2's reduce-scatter may write a "
                    "retained gradient"
                )
            p.grad = view
            absent.append(i)
        return absent


def _reduced_in_backward() -> None:
    """Nothing to do: FSDP2's reduce-scatter has averaged each rank's shard of the gradients."""


def local(t: Any) -> torch.Tensor:
    """A ``DTensor``'s local tensor, or ``t``."""
    return getattr(t, "_local_tensor", t)
