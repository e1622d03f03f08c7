"""A miniature of the trainer's optimizer update, run by a shadow before it can be promoted.

A fresh process pays for each kernel the first time it launches it: CUDA loads modules
lazily, Triton loads its binaries. The kernel warm-up (``leto.preinit.warmup``) covers the
Triton kernels; the update also launches torch's own (the gaps' gather and scatter, the
step counters' ``_foreach_add_``, the marker's stream-ordered fills, the RNG install, the
optimizer's own step under the ``torch`` rule), which a promoted trainer would otherwise
load during its first update. The rehearsal runs the same :class:`ResumableUpdater` over
the same optimizer class and group settings, on one small parameter per dimensionality and
dtype of each group, in scratch memory of the trainer's device, for two steps (torch
creates lazy state in the first): the same code paths and kernels, none of the retained
memory. Unprotected: the erasure kernels have their own warmers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SHAPES = {0: (), 1: (256,), 2: (4, 256), 3: (2, 4, 128)}
"""A small parameter of each dimensionality (more: its trailing dimensions flattened)."""
CHUNK_BYTES = 4096
"""Several chunks, so chunks split parameters and parameters share chunks."""
STEPS = 2


@dataclass(frozen=True, slots=True)
class UpdateRehearsal:
    """The trainer's optimizer class, its groups' settings and its update path."""

    optimizer: type[torch.optim.Optimizer]
    groups: tuple[dict[str, Any], ...]
    """Each parameter group's settings, without its parameters."""
    kinds: tuple[tuple[tuple[int, torch.dtype], ...], ...]
    """Each group's distinct (dimensionality, dtype) of parameters: one stand-in each."""
    fused: bool
    """The fused RMU kernel (``leto.rmu_fused`` as resolved for the trainer)."""

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, fused: bool) -> UpdateRehearsal:
        groups = tuple(
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        )
        kinds = tuple(
            tuple(dict.fromkeys((min(p.dim(), 3), p.dtype) for p in g["params"]))
            for g in optimizer.param_groups
        )
        return cls(type(optimizer), groups, kinds, fused)

    def run(self, device: torch.device) -> int:
        """The update ``STEPS`` times on scratch memory of ``device``; returns the steps."""
        from leto.events import EventLog
        from leto.faults import FaultInjector
        from leto.retained.layout import Layout
        from leto.retained.marker import MARKER_BYTES, Marker, Phase
        from leto.retained.optim_state import StateSlots
        from leto.updater.rmu import ResumableUpdater, buffer_bytes

        params, groups = [], []
        for settings, kinds in zip(self.groups, self.kinds, strict=True):
            ps = [
                torch.nn.Parameter(torch.full(SHAPES[dim], 0.5, dtype=dtype, device=device))
                for dim, dtype in kinds
            ]
            if ps:
                params += ps
                groups.append({**settings, "params": ps})
        opt = self.optimizer(groups)
        layout = Layout.plan(params, [], opt)
        state = torch.zeros(layout.state_bytes, dtype=torch.uint8, device=device)
        grads = torch.zeros(layout.grad_bytes, dtype=torch.uint8, device=device)
        for p, slot in zip(params, layout.params, strict=True):
            slot.view(state).copy_(p.detach())
        for slot in layout.grads:
            slot.view(grads).fill_(1e-3)
        StateSlots(opt.state, params, layout.optim, state).capture()
        undo_nbytes, _ = buffer_bytes(
            layout, layout.state_bytes, CHUNK_BYTES, None, fused=self.fused
        )
        cuda = device.type == "cuda"
        marker = Marker(
            torch.zeros(MARKER_BYTES, dtype=torch.uint8),
            torch.zeros(MARKER_BYTES // 8, dtype=torch.int64, device=device) if cuda else None,
        )
        marker.initialise(layout.digest)
        rng_next = torch.zeros(layout.rng.nbytes, dtype=torch.uint8, pin_memory=cuda)
        updater = ResumableUpdater(
            layout=layout,
            state=state,
            grads=grads,
            rng_next=rng_next,
            optimizer=opt,
            marker=marker,
            undo=torch.zeros(undo_nbytes, dtype=torch.uint8, device=device),
            parity=None,
            protected=None,
            injector=FaultInjector(0, [], EventLog(None, "rehearsal"), claim=lambda _i: True),
            chunk_bytes=CHUNK_BYTES,
            fused=self.fused,
        )
        lrs = [float(g["lr"]) for g in opt.param_groups]
        for step in range(STEPS):
            marker.record_lrs(lrs)
            marker.advance(Phase.GRADS_READY)
            updater.run(step)
        if cuda:
            torch.cuda.synchronize(device)
        return STEPS
