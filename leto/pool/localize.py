"""Host page-failure localisation and remapping for memfd-backed pool memory (paper §4.2).

After a failure the state manager must find which host pages are unreadable *without
touching them* (a load from a hardware-poisoned page kills the reader with SIGBUS). It
asks the kernel instead: ``madvise(MADV_POPULATE_READ)`` over a range fails with
``EHWPOISON`` if the range holds a poisoned page. :func:`scan_failed_pages` probes
coarse ranges and bisects the failing ones down to pool pages, so a healthy region costs
one system call per coarse range and each failed page about ``log2(range / page)`` more.

Emulation on machines where poison cannot be injected (``MADV_HWPOISON`` needs
CAP_SYS_ADMIN and a kernel built with memory-failure injection; it returns ``EINVAL``
here): :func:`make_inaccessible` takes pages away the way the OS would, with
``mprotect(PROT_NONE)`` (``MADV_POPULATE_READ`` then fails with ``EINVAL``) or
``munmap`` (``ENOMEM``). The scan treats ``EHWPOISON``, ``EFAULT``, ``ENOMEM`` and, for
``MADV_POPULATE_READ`` only, ``EINVAL`` as "this range holds a failed page", after
checking once that the kernel knows the advice at all.

:func:`remap_pages` then gives the failed pages healthy, zeroed memory at the same
addresses: it punches the old pages out of the memfd (``fallocate(PUNCH_HOLE)``) and
maps the same file offsets again with ``MAP_FIXED``. Contents are not restored; that is
the erasure code's job. This module never imports torch: the state manager does not.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
from typing import Literal

from leto.pool.pagemap import runs

logger = logging.getLogger(__name__)

MADV_POPULATE_READ = 22
MADV_WILLNEED = 3
EHWPOISON = getattr(errno, "EHWPOISON", 133)
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MAP_FAILED = ctypes.c_void_p(-1).value
PROT_NONE = 0
MAP_FIXED = 0x10

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

_probe_advice: int | None = None


def _madvise(addr: int, length: int, advice: int) -> int:
    """0 on success, else errno."""
    if _libc.madvise(addr, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def _advice() -> int:
    """MADV_POPULATE_READ where the kernel has it (5.14+), else MADV_WILLNEED."""
    global _probe_advice
    if _probe_advice is None:
        page = mmap.PAGESIZE
        addr = _libc.mmap(None, page, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        ok = _madvise(addr, page, MADV_POPULATE_READ) == 0
        _libc.munmap(addr, page)
        _probe_advice = MADV_POPULATE_READ if ok else MADV_WILLNEED
        if not ok:
            logger.warning(
                "MADV_POPULATE_READ unsupported; localisation sees only unmapped "
                "ranges, not poisoned pages (kernel older than 5.14)"
            )
    return _probe_advice


def _failed(err: int, advice: int) -> bool:
    if err in (EHWPOISON, errno.EFAULT, errno.ENOMEM):
        return True
    if err == errno.EINVAL and advice == MADV_POPULATE_READ:
        return True  # PROT_NONE range: the probe found the advice valid on a healthy page
    if err:
        raise OSError(err, f"madvise probe failed unexpectedly: {os.strerror(err)}")
    return False


def scan_failed_pages(
    addr: int, length: int, page_bytes: int, coarse_bytes: int | None = None
) -> list[int]:
    """Indices of the ``page_bytes`` pages in ``[addr, addr + length)`` that fail a probe.

    Probes ranges of ``coarse_bytes`` (default 64 pages) and bisects any failing one
    down to single pages. ``page_bytes`` must be a multiple of the OS page size.
    """
    if page_bytes % mmap.PAGESIZE or length % page_bytes or addr % mmap.PAGESIZE:
        raise ValueError(
            "addr, length and page_bytes must be multiples of the OS page size, "
            "and length a multiple of page_bytes"
        )
    coarse = coarse_bytes or 64 * page_bytes
    coarse -= coarse % page_bytes
    advice = _advice()
    failed: list[int] = []
    calls = 0

    def probe(lo: int, n_pages: int) -> None:
        nonlocal calls
        calls += 1
        if not _failed(_madvise(addr + lo * page_bytes, n_pages * page_bytes, advice), advice):
            return
        if n_pages == 1:
            failed.append(lo)
            return
        half = n_pages // 2
        probe(lo, half)
        probe(lo + half, n_pages - half)

    step = max(1, coarse // page_bytes)
    total = length // page_bytes
    for lo in range(0, total, step):
        probe(lo, min(step, total - lo))
    logger.info(
        "scanned host pages", extra={"pages": total, "failed": failed, "madvise_calls": calls}
    )
    return failed


def punch_hole(fd: int, offset: int, nbytes: int) -> None:
    """Drop ``nbytes`` of the memfd at ``offset``: its physical pages are freed, reads give 0."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, nbytes):
        err = ctypes.get_errno()
        raise OSError(
            err, f"fallocate(PUNCH_HOLE) of {nbytes} bytes at {offset} failed: {os.strerror(err)}"
        )


def remap_pages(addr: int, fd: int, fd_offset: int, page_bytes: int, pages: list[int]) -> None:
    """Replace failed pages of a shared memfd mapping with healthy zeroed memory, in place.

    ``addr`` maps ``fd`` from ``fd_offset``; ``pages`` are page indices from ``addr``.
    Each run of pages is punched out of the file (dropping the failed physical pages) and
    mapped again at the same address with ``MAP_FIXED``, read-write and shared, so other
    processes that map the same memfd see the new pages too.
    """
    for first, count in runs(pages):
        off, n = first * page_bytes, count * page_bytes
        punch_hole(fd, fd_offset + off, n)
        got = _libc.mmap(
            addr + off,
            n,
            mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_SHARED | MAP_FIXED,
            fd,
            fd_offset + off,
        )
        if got in (None, MAP_FAILED) or got != addr + off:
            err = ctypes.get_errno()
            raise OSError(
                err,
                f"mmap(MAP_FIXED) of pages {first}..{first + count - 1} failed: {os.strerror(err)}",
            )
    logger.info("remapped host pages", extra={"pages": sorted(set(pages))})


def make_inaccessible(
    addr: int, page_bytes: int, pages: list[int], how: Literal["mprotect", "munmap"] = "mprotect"
) -> None:
    """Fault injection for CPU tests: make pages fail the probe as poisoned pages would.

    ``mprotect`` sets ``PROT_NONE`` (a read would fault, ``MADV_POPULATE_READ`` returns
    ``EINVAL``); ``munmap`` removes the mapping (``ENOMEM``). Neither is hardware poison:
    the kernel's memory-failure path is not exercised, only the localisation logic.
    """
    for first, count in runs(pages):
        a, n = addr + first * page_bytes, count * page_bytes
        rc = _libc.mprotect(a, n, PROT_NONE) if how == "mprotect" else _libc.munmap(a, n)
        if rc:
            err = ctypes.get_errno()
            raise OSError(err, f"{how} of pages {first}..{first + count - 1}: {os.strerror(err)}")


def map_memfd(fd: int, length: int, offset: int = 0) -> int:
    """Map ``length`` bytes of ``fd`` shared and read-write; returns the address."""
    addr = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, offset)
    if addr in (None, MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of memfd failed: {os.strerror(err)}")
    return addr


def unmap(addr: int, length: int) -> None:
    """Undo :func:`map_memfd`."""
    if _libc.munmap(addr, length):
        err = ctypes.get_errno()
        raise OSError(err, f"munmap failed: {os.strerror(err)}")
