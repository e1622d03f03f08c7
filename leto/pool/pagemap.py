"""Page tables of chunked device regions: chunk granule, fd batches, lost-page reports.

A device-tier region is ``num_chunks`` physical allocations of ``chunk_bytes`` each (one
``cuMemCreate`` per chunk on GPU, one memfd per chunk on CPU), mapped back to back into
one reserved address range, so the trainer sees one flat tensor while a single chunk can
be lost, found and replaced on its own. The state manager holds one fd per chunk; a lost
chunk is an empty slot (its fd closed). This module holds the arithmetic both sides
share; it imports neither torch nor CUDA.

Why 2 MiB chunks (the erasure page) by default, by numbers: a 1B-parameter model keeps
about 16 B/param of state (fp32 params + AdamW moments + master copy) = 16 GB = 7,630
chunks of 2 MiB, plus 4 B/param of fp32 gradients = 1,908 chunks: about 9.5k fds per
rank, 76k for 8 ranks in one state manager. Linux allows up to ``fs.nr_open`` (1,048,576
by default) per process and the usual hard ``RLIMIT_NOFILE`` is 524,288 (systemd) or
1,048,576 (Docker), so 76k fits once the soft limit (often 1,024) is raised to the hard
one, which the state manager and trainers do at start. A full H200 (141 GB of state per
rank, 8 ranks: 538k chunks) or a tight hard limit (20,000 on the development box) does
not fit: then :func:`plan_chunk_bytes` doubles the chunk until the rank's share of the
state manager's fd limit holds it, and pages are localised at that coarser granule (a
lost chunk loses all its erasure pages, which count against the group's H1).
"""

from __future__ import annotations

import math
import resource
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

SCM_MAX_FD = 253
"""The kernel's limit of fds per SCM_RIGHTS message (``include/net/scm.h``)."""
FD_RESERVE = 512
"""fds of the state manager's limit kept for host regions, sockets and libraries."""

T = TypeVar("T")


def batches(items: Sequence[T], size: int = SCM_MAX_FD) -> Iterator[tuple[int, Sequence[T]]]:
    """``(start, items[start:start + size])`` for consecutive windows of ``items``."""
    if size <= 0:
        raise ValueError(f"batch size must be positive, got {size}")
    for start in range(0, len(items), size):
        yield start, items[start : start + size]


def raise_nofile_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit; returns the new soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # e.g. above fs.nr_open: keep what we have
            pass
    return soft


def fd_budget(fd_limit: int, local_ranks: int) -> int:
    """Chunks one rank may deposit with a state manager whose fd limit is ``fd_limit``."""
    return max(1, (fd_limit - FD_RESERVE) // max(1, local_ranks))


def plan_chunk_bytes(total_bytes: int, page_bytes: int, granularity: int, max_chunks: int) -> int:
    """The physical chunk size for ``total_bytes`` of protected device memory.

    The smallest ``lcm(page_bytes, granularity) * 2**k`` that needs at most
    ``max_chunks`` chunks: one erasure page per chunk whenever the fd budget allows.
    """
    if min(total_bytes, page_bytes, granularity, max_chunks) <= 0:
        raise ValueError("total_bytes, page_bytes, granularity and max_chunks must be positive")
    chunk = math.lcm(page_bytes, granularity)
    while -(-total_bytes // chunk) > max_chunks:
        chunk *= 2
    return chunk


def runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted indices as ``(first, count)`` runs (compact on the wire)."""
    out: list[tuple[int, int]] = []
    for i in sorted(set(indices)):
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def from_runs(pairs: Sequence[Sequence[int]]) -> list[int]:
    return [i for first, count in pairs for i in range(first, first + count)]


@dataclass(frozen=True, slots=True)
class PageTable:
    """Chunk geometry of one region and the page <-> chunk translation."""

    nbytes: int
    chunk_bytes: int

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.nbytes <= 0 or self.nbytes % self.chunk_bytes:
            raise ValueError(
                f"region of {self.nbytes} B is not a whole number of {self.chunk_bytes}-byte chunks"
            )

    @property
    def num_chunks(self) -> int:
        return self.nbytes // self.chunk_bytes

    def _pages_per_chunk(self, page_bytes: int) -> int:
        if page_bytes <= 0 or self.chunk_bytes % page_bytes:
            raise ValueError(
                f"page of {page_bytes} B does not divide the {self.chunk_bytes}-byte chunk"
            )
        return self.chunk_bytes // page_bytes

    def pages_of(self, chunks: Sequence[int], page_bytes: int) -> list[int]:
        """Every page of these chunks (a lost chunk loses all its pages)."""
        k = self._pages_per_chunk(page_bytes)
        return [c * k + j for c in sorted(set(chunks)) for j in range(k)]

    def chunks_of(self, pages: Sequence[int], page_bytes: int) -> list[int]:
        """The chunks that hold these pages."""
        k = self._pages_per_chunk(page_bytes)
        chunks = sorted({p // k for p in pages})
        if chunks and not 0 <= chunks[0] <= chunks[-1] < self.num_chunks:
            raise ValueError(
                f"pages {list(pages)} lie outside the region's {self.num_chunks * k} pages"
            )
        return chunks
