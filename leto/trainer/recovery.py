"""A reattaching rank's way back to a consistent point.

``Recovery.attach`` runs once regions are mapped and the marker reads as the predecessor
left it: a region re-made since, or another layout, is refused; lost pages are localised and
rebuilt (or refused where nothing protects them). At the first ``steps()`` the ranks gather
their markers' points (``points``) for ``leto.trainer.resume.decide_resume``, and a rank
that must finish the interrupted update does so through its updater (``finish_update``).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from leto.errors import UnrecoverableStateError
from leto.events import Kind
from leto.retained.marker import Phase
from leto.trainer.placement import Regions
from leto.trainer.services import TrainerServices

logger = logging.getLogger(__name__)


class Recovery:
    """Brings one rank's mapped regions back to a point every rank can resume from."""

    def __init__(self, regions: Regions, services: TrainerServices) -> None:
        self.services = services
        self.marker = regions.marker
        self.memory = regions.memory
        self.protected = regions.protected
        self.updater = regions.updater
        self.grad_regions = regions.grads
        self.mirror_regions = regions.mirrors

    def attach(self, layout_digest: str) -> bool:
        """Whether this rank has retained state to reattach to; if so, after checking that
        its regions are the ones its marker recorded and its layout is this plan's, with
        every lost page needed to resume rebuilt."""
        reattached = self.marker.is_valid()
        self.memory.check_identity(  # no resume on a re-made region
            self.marker, reattached, self.services.events
        )
        if reattached:
            self.marker.check_layout(layout_digest)
            self.services.injector.recovery_point("attach", self.marker.step)
            self._rebuild_lost_pages()
        return reattached

    def points(self) -> list[tuple[int, Phase]]:
        """Every rank's (step, phase), indexed by rank (one all-gather)."""
        mine = torch.tensor(
            [self.marker.step, int(self.marker.phase)],
            dtype=torch.int64,
            device=self.services.collective_device,
        )
        gathered = [torch.empty_like(mine) for _ in range(self.services.world_size)]
        dist.all_gather(gathered, mine)
        return [(int(t[0]), Phase(int(t[1]))) for t in gathered]

    def _rebuild_lost_pages(self) -> None:
        """Localise failed pages of every protected region and rebuild what is needed.

        Model state is rebuilt from its host parity between updates; mid-update under rmu,
        the torn chunk is first restored from the undo buffer and the data pages are rebuilt
        from the authoritative working parity (host parity is rewritten by the flush);
        under snapshot, the snapshot restores the state and its parity is re-encoded after
        the update. Gradients are rebuilt whenever they are final (the update may have to be
        finished with them).
        """
        phase = self.marker.phase
        self._check_update_buffers(phase)
        self.updater.prepare()  # rmu: undo a torn chunk, resync the scratch parity
        for name in self.mirror_regions:  # fresh zeroed chunks; the resume's gather refills them
            if lost := self.memory.lost_chunks(name):
                logger.info(
                    "[rank %d] %d lost chunks of %s replaced; the gather at resume refills them",
                    self.services.rank,
                    len(lost),
                    name,
                )
        if not self.protected:
            self._refuse_unprotected_losses(phase)
            self.memory.commit_replacements()
            return
        needed = {
            "state": self.updater.rebuilds_state(phase),
            **{name: phase != Phase.IDLE for name in self.grad_regions},
        }
        report: dict[str, dict[str, int]] = {}
        seconds = localize_s = 0.0
        for name, region in self.protected.items():
            t0 = time.perf_counter()
            lost = region.localize()
            localize_s += time.perf_counter() - t0
            if lost.count:  # fresh zeroed chunks are mapped now; a kill here is one mid-rebuild
                self.services.injector.recovery_point("rebuild", self.marker.step)
            report[name] = {
                "data": len(lost.data),
                "tier1": len(lost.tier1),
                "tier2": len(lost.tier2),
            }
            if lost.count and needed[name]:
                t0 = time.perf_counter()
                try:
                    groups = self.updater.rebuild_groups(phase) if name == "state" else None
                    if groups is not None:
                        region.rebuild_data(lost, groups)
                    else:
                        region.rebuild(lost)
                    self.memory.fence()  # GPU kernels run asynchronously: time them to the end
                    seconds += time.perf_counter() - t0
                except UnrecoverableStateError as e:
                    self.services.events.emit(
                        Kind.UNRECOVERABLE,
                        rank=self.services.rank,
                        region=name,
                        lost=report[name],
                        error=str(e),
                    )
                    raise
        self.memory.commit_replacements()  # only now: a kill mid-rebuild leaves the losses to the next
        self.services.events.emit(
            Kind.PAGES_REBUILT,
            rank=self.services.rank,
            gen=self.services.env.generation,
            lost=report,
            rebuild_s=seconds,
            localize_s=localize_s,
            phase=phase.name,
        )

    def _refuse_unprotected_losses(self, phase: Phase) -> None:
        """Without erasure protection nothing can rebuild a lost chunk of the model state or
        of final gradients: resuming on its zeroed replacement would silently diverge."""
        needed = {"state": True, **{name: phase != Phase.IDLE for name in self.grad_regions}}
        for name, need in needed.items():
            if need and (lost := self.memory.lost_chunks(name)):
                error = (
                    f"rank {self.services.rank}: {len(lost)} chunks of retained region {name} were lost and "
                    "nothing protects them (leto.erasure is off)"
                )
                self.services.events.emit(
                    Kind.UNRECOVERABLE, rank=self.services.rank, region=name, error=error
                )
                raise UnrecoverableStateError(error + "; restart the job from a checkpoint")

    def _check_update_buffers(self, phase: Phase) -> None:
        """The updater's buffers a resume from ``phase`` reads (rmu mid-update: the undo copy
        while a chunk is saved, and the working parity) are the only consistent record of
        the state, and nothing protects them: a lost page of one means no consistent point
        to resume from (the checkpoint path takes over)."""
        for name in self.updater.unprotected_needs(phase):
            if name in self.memory.regions and self.memory.lost_chunks(name):
                error = f"rank {self.services.rank}: device pages of {name} were lost in the middle of an update ({phase.name})"
                self.services.events.emit(
                    Kind.UNRECOVERABLE, rank=self.services.rank, region=name, error=error
                )
                raise UnrecoverableStateError(error + "; restart the job from a checkpoint")

    def finish_update(self, step: int) -> str:
        """Finish step ``step``'s interrupted update on this rank; returns how (the
        ``resumed`` event's ``action``)."""
        try:
            return self.updater.resume(step)
        except UnrecoverableStateError as e:
            self.services.events.emit(
                Kind.UNRECOVERABLE, rank=self.services.rank, region="state", error=str(e)
            )
            raise
