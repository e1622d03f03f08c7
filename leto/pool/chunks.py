"""Device-tier regions as per-chunk physical allocations in one reserved address range.

A :class:`ChunkedRegion` is what a trainer maps for a device region: ``num_chunks``
allocations of ``chunk_bytes`` (see ``leto.pool.pagemap`` for the granule), each exported
as one fd that the state manager holds, mapped back to back so the trainer sees one flat
buffer (zero copy). Because every chunk is its own allocation, one chunk can be unmapped
and replaced in place, which a single allocation cannot (``cuMemMap`` maps an allocation
from offset 0 only).

Localisation (:meth:`ChunkedRegion.localize`) takes the union of two queries per chunk:
the state manager's page map (a slot without an fd: the chunk's memory is gone, as after
a fault that made the state manager drop it) and this process's own mapping (a chunk that
no longer answers: ``cuMemGetAccess`` on GPU, the ``madvise`` probe on CPU). Lost chunks
are replaced by fresh zeroed allocations at the same addresses and deposited in their
slots; their contents are the erasure code's job.

Two backends share the protocol: :class:`MemfdChunks` (CPU: memfds, ``mmap(MAP_FIXED)``
into a ``PROT_NONE`` reservation) and ``leto.pool.cuda_vmm.CudaChunks`` (GPU). No torch.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from typing import Protocol

from leto.errors import PoolError
from leto.pool import localize, pagemap
from leto.pool.client import PoolClient
from leto.pool.pagemap import PageTable

logger = logging.getLogger(__name__)

_MAP_FIXED, _MAP_NORESERVE = 0x10, 0x4000


class ChunkBackend(Protocol):
    """Physical chunks and their mappings: CUDA VMM on GPU, memfds on CPU."""

    backing: str
    granularity: int

    def create(self, chunk_bytes: int) -> int:
        """A new zeroed-or-uninitialised chunk, as an fd the caller owns."""

    def reserve(self, nbytes: int) -> int:
        """An address range for ``nbytes``, nothing mapped."""

    def map(self, addr: int, fd: int, chunk_bytes: int) -> None:
        """Map the chunk ``fd`` at ``addr`` (the fd stays the caller's)."""

    def enable(self, addr: int, nbytes: int) -> None:
        """Make mapped chunks in ``[addr, addr + nbytes)`` readable and writable."""

    def unmap(self, addr: int, chunk_bytes: int) -> None:
        """Drop the chunk mapped at ``addr``; the address stays reserved."""

    def failed(self, addr: int, nbytes: int, chunk_bytes: int) -> list[int]:
        """Indices of the chunks of ``[addr, addr + nbytes)`` this process cannot access."""


class MemfdChunks:
    """CPU chunks: one memfd each, mapped shared into an anonymous PROT_NONE reservation."""

    backing = "memfd-chunks"
    granularity = mmap.PAGESIZE

    def create(self, chunk_bytes: int) -> int:
        fd = os.memfd_create("leto:chunk", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, chunk_bytes)
        except OSError:
            os.close(fd)
            raise
        return fd

    def reserve(self, nbytes: int) -> int:
        return _mmap(
            None,
            nbytes,
            localize.PROT_NONE,
            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
            -1,
        )

    def map(self, addr: int, fd: int, chunk_bytes: int) -> None:
        _mmap(addr, chunk_bytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd)

    def enable(self, addr: int, nbytes: int) -> None:
        pass  # mapped read-write already

    def unmap(self, addr: int, chunk_bytes: int) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
        _mmap(addr, chunk_bytes, localize.PROT_NONE, flags, -1)  # back to reserved, not a hole

    def failed(self, addr: int, nbytes: int, chunk_bytes: int) -> list[int]:
        return localize.scan_failed_pages(addr, nbytes, chunk_bytes)


def _mmap(addr: int | None, nbytes: int, prot: int, flags: int, fd: int) -> int:
    got = localize._libc.mmap(addr, nbytes, prot, flags, fd, 0)
    if got in (None, localize.MAP_FAILED) or (addr is not None and got != addr):
        err = ctypes.get_errno()
        raise PoolError(f"mmap of {nbytes} bytes failed: {os.strerror(err)}")
    return int(got)


class ChunkedRegion:
    """One device region of one rank: a page table over chunks, mapped at ``ptr``."""

    def __init__(
        self,
        backend: ChunkBackend,
        pool: PoolClient,
        rank: int,
        name: str,
        table: PageTable,
        ptr: int,
        existing: bool,
    ) -> None:
        self.backend, self.pool, self.rank, self.name = backend, pool, rank, name
        self.table, self.ptr, self.existing = table, ptr, existing
        self._replaced: set[int] = set()
        """Chunks found lost and replaced since the last :meth:`localize` (e.g. at attach)."""
        self._pending: dict[int, int] = {}
        """Replacement chunks (index → fd) not yet deposited: see :meth:`commit`."""

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    @classmethod
    def attach(
        cls,
        backend: ChunkBackend,
        pool: PoolClient,
        rank: int,
        name: str,
        nbytes: int,
        chunk_bytes: int,
    ) -> ChunkedRegion:
        """Create the region (first trainer) or map the retained one (successor, shadow).

        A successor takes the retained chunk size; chunks already lost are replaced now
        and reported by the next :meth:`localize`.
        """
        if chunk_bytes % backend.granularity:
            raise PoolError(
                f"chunk of {chunk_bytes} B is not a multiple of the {backend.granularity}-byte granularity"
            )
        found = pool.fetch(rank, name)
        if found is not None:
            chunk_bytes = found.chunk_bytes
        table = PageTable(-(-nbytes // chunk_bytes) * chunk_bytes, chunk_bytes)
        try:
            if found is not None and (found.backing, found.spec.nbytes) != (
                backend.backing,
                table.nbytes,
            ):
                raise PoolError(
                    f"reattach of rank {rank} region {name!r} does not match: retained "
                    f"{found.spec.nbytes} B {found.backing}, asked {table.nbytes} B {backend.backing}"
                )
            ptr = backend.reserve(table.nbytes)
            region = cls(backend, pool, rank, name, table, ptr, existing=found is not None)
            if found is None:
                region._create_all()
            else:
                for i, fd in enumerate(found.fds):
                    if fd is not None:
                        backend.map(region._addr(i), fd, chunk_bytes)
                for i in found.lost:
                    region._replace(i)
                backend.enable(ptr, table.nbytes)  # (cuMemSetAccess wants the range fully mapped)
        finally:
            if found is not None:
                found.close()
        if region._replaced:
            logger.warning(
                "rank %d region %s: %d chunks were lost before attach",
                rank,
                name,
                len(region._replaced),
            )
        return region

    def _addr(self, chunk: int) -> int:
        return self.ptr + chunk * self.table.chunk_bytes

    def _create_all(self) -> None:
        """Create every chunk, map it and deposit it, SCM_MAX_FD chunks per message."""
        chunk = self.table.chunk_bytes
        for start, indices in pagemap.batches(range(self.table.num_chunks)):
            fds: list[int] = []
            try:
                for i in indices:
                    fds.append(self.backend.create(chunk))
                    self.backend.map(self._addr(i), fds[-1], chunk)
                self.pool.deposit(
                    self.rank,
                    self.name,
                    self.table.nbytes,
                    chunk,
                    self.backend.backing,
                    fds,
                    start=start,
                )
            finally:
                for fd in fds:
                    os.close(fd)
        self.backend.enable(self.ptr, self.table.nbytes)

    def _replace(self, chunk_index: int) -> None:
        """A fresh chunk in place of a lost one, mapped at the same address; it is deposited
        in the same slot by :meth:`commit`, once the caller has rebuilt its contents."""
        addr, chunk = self._addr(chunk_index), self.table.chunk_bytes
        fd = self.backend.create(chunk)
        try:
            self.backend.unmap(addr, chunk)
            self.backend.map(addr, fd, chunk)
            self.backend.enable(addr, chunk)
        except BaseException:
            os.close(fd)
            raise
        old = self._pending.pop(chunk_index, None)
        if old is not None:
            os.close(old)
        self._pending[chunk_index] = fd
        self._replaced.add(chunk_index)

    def commit(self) -> None:
        """Deposit the replacement chunks: the state manager holds them from now on.

        Until then the state manager still holds those slots as lost, so a process that
        dies while rebuilding them leaves its successor the same losses to rebuild, never
        a zeroed chunk that reads as intact. Call after the rebuild has landed (device
        work fenced)."""
        pending, self._pending = self._pending, {}
        try:
            for index in sorted(pending):
                self.pool.deposit(
                    self.rank,
                    self.name,
                    self.table.nbytes,
                    self.table.chunk_bytes,
                    self.backend.backing,
                    [pending[index]],
                    start=index,
                    replace=True,
                )
        finally:
            for fd in pending.values():
                os.close(fd)

    def localize(self) -> list[int]:
        """Lost chunks (state manager's page map ∪ failed mappings), now replaced fresh.

        Also reports the chunks replaced at attach. Fresh chunks read zero on CPU and are
        uninitialised on GPU (the caller zeroes them); rebuilding them is the caller's job.
        """
        lost = set(self.pool.pagemap(self.rank, self.name)) - set(
            self._pending
        )  # ours, being rebuilt
        lost |= set(self.backend.failed(self.ptr, self.table.nbytes, self.table.chunk_bytes))
        for i in sorted(lost):
            self._replace(i)
        found, self._replaced = sorted(self._replaced), set()
        if found:
            logger.info("rank %d region %s: replaced lost chunks %s", self.rank, self.name, found)
        return found

    def lost_pages(self, page_bytes: int) -> list[int]:
        """:meth:`localize`, in pages of ``page_bytes`` (every page of a lost chunk)."""
        return self.table.pages_of(self.localize(), page_bytes)
