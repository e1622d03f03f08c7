"""An in-process rig for the RMU: retained state in plain tensors, kills as exceptions.

It builds the same layout, marker and protection groups a trainer does, but over ordinary
CPU tensors, so a "kill" (an exception from the fault point) followed by a fresh
:class:`ResumableUpdater` over the same memory is exactly what a promoted trainer sees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import nn

from leto.config import FaultSpec
from leto.erasure import ErasureConfig, ProtectionGroup, padded_bytes, plan_groups
from leto.events import EventLog
from leto.faults import FaultInjector
from leto.retained.layout import Layout
from leto.retained.marker import MARKER_BYTES, Marker, Phase
from leto.retained.optim_state import StateSlots
from leto.updater.rmu import ResumableUpdater, buffer_bytes


class Killed(Exception):
    """Raised at a fault point instead of SIGKILL."""


def _raise(fault: FaultSpec) -> None:
    raise Killed(f"{fault.point} {fault.chunk}")


def no_faults() -> FaultInjector:
    """The shipped injector of rank 0, in process: nothing scheduled, a kill raises
    :class:`Killed` (see :func:`kill_at`)."""
    injector = FaultInjector(0, [], EventLog(None, "rig"), claim=lambda _i: True)
    injector.stop = _raise
    return injector


def kill_at(step: int, point: str | None = None, chunk: int | None = None) -> FaultInjector:
    """A kill inside step ``step``'s update at ``point`` (None: the plain update point, after
    the last chunk), in chunk ``chunk`` (None: the first one reached); it raises
    :class:`Killed`. The step runs through a helper that sets ``injector.step``, as the
    trainer does."""
    return no_faults().fail_at(0, step, "update", point=point, chunk=chunk)


def model(seed: int = 0, dim: int = 24) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(dim, 3 * dim), nn.GELU(), nn.LayerNorm(3 * dim), nn.Linear(3 * dim, dim)
    )


@dataclasses.dataclass
class Rig:
    """One rank's retained state; ``updater()`` makes a fresh updater (a promoted trainer)."""

    layout: Layout
    opt: torch.optim.Optimizer
    state: torch.Tensor
    grads: torch.Tensor
    rng_next: torch.Tensor
    marker_mem: torch.Tensor
    undo: torch.Tensor
    parity: torch.Tensor | None
    protected: SimpleNamespace | None
    chunk_bytes: int
    incremental: bool = True
    fused: bool = False

    @classmethod
    def build(
        cls,
        net: nn.Module,
        *,
        erasure: ErasureConfig | None,
        chunk_bytes: int,
        lr: float = 1e-2,
        incremental: bool = True,
        fused: bool = False,
        backend: str = "torch",
        device: str = "cpu",
        optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    ) -> Rig:
        """``device="cuda"`` puts the state, gradients and RMU buffers on the GPU and the
        parity tiers in pinned host memory, as a trainer does.
        ``backend="triton"`` runs the groups' page arithmetic (the working parity's fold
        and the flush's tier-2 encode) in Triton's interpreter (``TRITON_INTERPRET=1``).
        ``optimizer`` builds the optimizer over ``net`` (default: AdamW, weight decay 0.1)."""
        opt = (
            optimizer(net)
            if optimizer is not None
            else torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1, foreach=True)
        )
        params = [p for g in opt.param_groups for p in g["params"]]
        layout = Layout.plan(params, [], opt)
        nbytes = padded_bytes(layout.state_bytes, erasure) if erasure else layout.state_bytes
        state = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        grads = torch.zeros(layout.grad_bytes, dtype=torch.uint8, device=device)
        layout.grad_scale.view(grads).fill_(1.0)  # what a trainer writes when it does not clip
        pin = torch.device(device).type == "cuda"
        for p, slot in zip(params, layout.params, strict=True):
            slot.view(state).copy_(p.detach())
        StateSlots(opt.state, params, layout.optim, state).capture()  # what a fresh trainer binds
        undo_n, par_n = buffer_bytes(layout, nbytes, chunk_bytes, erasure, fused=fused)
        protected = None
        if erasure is not None:
            pb = erasure.page_bytes
            spans = plan_groups(nbytes, erasure)
            p1 = torch.zeros(
                len(spans) * erasure.tier1_parity * pb, dtype=torch.uint8, pin_memory=pin
            )
            p2 = torch.zeros(
                len(spans) * erasure.tier2_parity * pb, dtype=torch.uint8, pin_memory=pin
            )
            h1, h2 = erasure.tier1_parity * pb, erasure.tier2_parity * pb
            groups = [
                ProtectionGroup(
                    erasure,
                    state[s.byte_offset : s.byte_offset + s.nbytes],
                    p1[i * h1 : (i + 1) * h1],
                    p2[i * h2 : (i + 1) * h2],
                    backend=backend,
                )  # type: ignore[arg-type]
                for i, s in enumerate(spans)
            ]
            for g in groups:
                g.encode_all()
            protected = SimpleNamespace(cfg=erasure, groups=groups)
        rig = cls(
            layout,
            opt,
            state,
            grads,
            torch.get_rng_state().clone(),
            torch.zeros(MARKER_BYTES, dtype=torch.uint8),
            torch.zeros(undo_n, dtype=torch.uint8, device=device),
            torch.zeros(par_n, dtype=torch.uint8, device=device) if par_n else None,
            protected,
            chunk_bytes,
            incremental,
            fused,
        )
        Marker(rig.marker_mem).initialise(layout.digest)
        return rig

    @property
    def marker(self) -> Marker:
        return Marker(self.marker_mem)

    def updater(self, injector: FaultInjector) -> ResumableUpdater:
        return ResumableUpdater(
            layout=self.layout,
            state=self.state,
            grads=self.grads,
            rng_next=self.rng_next,
            optimizer=self.opt,
            marker=self.marker,
            undo=self.undo,
            parity=self.parity,
            protected=self.protected,  # type: ignore[arg-type]
            injector=injector,
            chunk_bytes=self.chunk_bytes,
            incremental_parity=self.incremental,  # type: ignore[arg-type]
            fused=self.fused,
        )

    def set_grads(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for slot in self.layout.grads:
            slot.view(self.grads).copy_(torch.randn(slot.shape, generator=g))
        self.rng_next.copy_(
            torch.randint(0, 256, self.rng_next.shape, dtype=torch.uint8, generator=g)
        )

    def grads_ready(self, lr: float) -> None:
        m = self.marker
        m.record_lrs([lr] * len(self.opt.param_groups))
        m.advance(Phase.GRADS_READY)

    def erase_pages(self, per_group: int, seed: int) -> list[int]:
        """Zero ``per_group`` data pages of every group (their contents are lost)."""
        assert self.protected is not None
        cfg = self.protected.cfg
        g = torch.Generator().manual_seed(seed)
        lost = []
        for i, grp in enumerate(self.protected.groups):
            pages = torch.randperm(grp.num_pages, generator=g)[:per_group].tolist()
            for p in pages:
                grp.data_page(p).zero_()
            lost += [i * cfg.data_pages + p for p in sorted(pages)]
        return lost
