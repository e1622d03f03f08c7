"""Cut a flat protected region into protection groups and pages.

A region of ``N`` bytes becomes ``ceil(N / page_bytes)`` pages (the pool allocates whole
pages, so the tail of the last page is padding the trainer never writes) and groups of
``data_pages`` pages; the last group may be short, and the code treats its missing pages
as logical zero pages (they contribute nothing to parity and are never lost).
"""

from __future__ import annotations

from dataclasses import dataclass

from leto.erasure.config import ErasureConfig


@dataclass(frozen=True, slots=True)
class GroupSpan:
    """One protection group of a region."""

    index: int
    byte_offset: int
    """Offset of the group's first page in the region."""
    num_pages: int
    """Pages present (``<= data_pages``; fewer in a short last group)."""
    page_bytes: int

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes


@dataclass(frozen=True, slots=True)
class PageSpan:
    """A byte range inside one page: what one incremental parity update covers."""

    group: int
    page: int
    """Page index within the group."""
    offset: int
    """Byte offset within the page."""
    nbytes: int
    region_offset: int
    """Offset of the range's first byte in the region."""


def padded_bytes(nbytes: int, config: ErasureConfig) -> int:
    """Bytes the pool must allocate for ``nbytes`` of state: rounded up to whole pages."""
    return -(-nbytes // config.page_bytes) * config.page_bytes


def plan_groups(nbytes: int, config: ErasureConfig) -> list[GroupSpan]:
    """The protection groups covering a region of ``nbytes`` bytes."""
    if nbytes < 0:
        raise ValueError(f"region size must be non-negative, got {nbytes}")
    pages = -(-nbytes // config.page_bytes)
    groups = []
    for g, first in enumerate(range(0, pages, config.data_pages)):
        n = min(config.data_pages, pages - first)
        groups.append(GroupSpan(g, first * config.page_bytes, n, config.page_bytes))
    return groups


def split_range(start: int, nbytes: int, config: ErasureConfig) -> list[PageSpan]:
    """Split region bytes ``[start, start + nbytes)`` at page boundaries.

    The updater calls this per chunk and passes each span to
    :meth:`ProtectionGroup.update`; spans inherit the chunk's alignment, so chunk
    boundaries must be multiples of 2048 bytes (one tile).
    """
    spans = []
    pos, end = start, start + nbytes
    while pos < end:
        page_global, off = divmod(pos, config.page_bytes)
        n = min(end - pos, config.page_bytes - off)
        g, page = divmod(page_global, config.data_pages)
        spans.append(PageSpan(g, page, off, n, pos))
        pos += n
    return spans
