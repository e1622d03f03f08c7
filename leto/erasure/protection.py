"""Erasure protection of a retained region: its parity regions, encode, localise, rebuild.

A protected region ``name`` (device tier: model state, gradients) is cut into groups of D
pages; each group has H1 tier-1 and H2 tier-2 parity pages in two host regions,
``name.p1`` and ``name.p2``, owned by the state manager like everything else. After a
failure the trainer's page-map query localises and replaces lost chunks of the data
region (``leto.pool.chunks``) and the state manager localises and remaps failed pages of
the parity regions (``leto.pool.localize``); the promoted trainer rebuilds them here, tier 2 first, then tier 1, before it touches the
data. More failures than the code tolerates raise ``UnrecoverableStateError``: never a
resume on wrong data.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from leto.erasure.config import ErasureConfig
from leto.erasure.group import ProtectionGroup
from leto.erasure.layout import plan_groups
from leto.pool.client import MappedRegion, PoolClient


@dataclass(slots=True)
class LostPages:
    """Failed pages of one protected region and its parity regions (region page indices)."""

    data: list[int] = field(default_factory=list)
    tier1: list[int] = field(default_factory=list)
    tier2: list[int] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.data) + len(self.tier1) + len(self.tier2)


class ProtectedRegion:
    """Parity bookkeeping of one retained region (the data view is passed in)."""

    def __init__(
        self,
        pool: PoolClient,
        rank: int,
        name: str,
        data: torch.Tensor,
        cfg: ErasureConfig,
        lost_data_pages: Callable[[int], list[int]],
    ) -> None:
        """``lost_data_pages(page_bytes)`` localises the data region itself (a device region:
        the trainer's page-map query, ``RegionMemory.lost_pages``)."""
        self.pool, self.rank, self.name, self.cfg = pool, rank, name, cfg
        self.data = data
        self._lost_data_pages = lost_data_pages
        self.spans = plan_groups(data.numel(), cfg)
        pb = cfg.page_bytes
        n = len(self.spans)
        self._regions: dict[str, MappedRegion] = {
            "p1": pool.alloc(rank, f"{name}.p1", n * cfg.tier1_parity * pb, "uint8", "host"),
        }
        if cfg.tier2_parity:
            self._regions["p2"] = pool.alloc(
                rank, f"{name}.p2", n * cfg.tier2_parity * pb, "uint8", "host"
            )
        p1 = torch.frombuffer(self._regions["p1"].buffer, dtype=torch.uint8)
        p2 = (
            torch.frombuffer(self._regions["p2"].buffer, dtype=torch.uint8)
            if "p2" in self._regions
            else torch.empty(0, dtype=torch.uint8)
        )
        h1, h2 = cfg.tier1_parity * pb, cfg.tier2_parity * pb
        self.groups = [
            ProtectionGroup(
                cfg,
                data[s.byte_offset : s.byte_offset + s.num_pages * pb],
                p1[i * h1 : (i + 1) * h1],
                p2[i * h2 : (i + 1) * h2],
                backend="torch" if not data.is_cuda else "auto",
            )
            for i, s in enumerate(self.spans)
        ]

    def encode(self) -> None:
        """Recompute both parity tiers from the data (the data is at a consistent point)."""
        for group in self.groups:
            group.encode_all()

    def localize(self) -> LostPages:
        """Find failed pages (they come back remapped and zeroed): data pages by the device
        region's page-map query, parity pages by the state manager's host scan."""
        pb = self.cfg.page_bytes
        pages = self.data.numel() // pb  # pages past the data (chunk padding) hold nothing
        lost = LostPages(data=[p for p in self._lost_data_pages(pb) if p < pages])
        lost.tier1 = self.pool.localize(self.rank, f"{self.name}.p1", pb)
        if "p2" in self._regions:
            lost.tier2 = self.pool.localize(self.rank, f"{self.name}.p2", pb)
        return lost

    def rebuild(self, lost: LostPages) -> float:
        """Rebuild every lost page, group by group; raises beyond the code's tolerance."""
        t0 = time.perf_counter()
        d, h1, h2 = self.cfg.data_pages, self.cfg.tier1_parity, self.cfg.tier2_parity
        for i, group in enumerate(self.groups):
            data = [p - i * d for p in lost.data if i * d <= p < (i + 1) * d]
            t1 = [p - i * h1 for p in lost.tier1 if i * h1 <= p < (i + 1) * h1]
            t2 = [p - i * h2 for p in lost.tier2 if h2 and i * h2 <= p < (i + 1) * h2]
            if data or t1 or t2:
                group.rebuild(data, t1, t2)
        return time.perf_counter() - t0

    def rebuild_data(self, lost: LostPages, working: list[ProtectionGroup]) -> float:
        """Rebuild lost data pages from working parity (one group per protection group).

        Used mid-update, when the RMU's working parity, not the host tier 1, matches the
        data. Lost host parity pages are left alone: the update's flush rewrites them.
        """
        t0 = time.perf_counter()
        d = self.cfg.data_pages
        for i, group in enumerate(working):
            data = [p - i * d for p in lost.data if i * d <= p < (i + 1) * d]
            if data:
                group.rebuild(data)
        return time.perf_counter() - t0


def pages_to_erase(
    total_pages: int, per_group: int, group_pages: int, group: int | None, seed: int
) -> list[int]:
    """Deterministic choice of ``per_group`` pages in each group (or in one group)."""
    import random

    rng = random.Random(seed)
    groups = range((total_pages + group_pages - 1) // group_pages) if group is None else [group]
    pages: list[int] = []
    for g in groups:
        members = list(range(g * group_pages, min(total_pages, (g + 1) * group_pages)))
        pages += sorted(rng.sample(members, min(per_group, len(members))))
    return pages
