"""Host page-failure localisation and remap, on a real memfd mapping.

What is emulated: hardware poison cannot be injected here (``MADV_HWPOISON`` returns
EINVAL on these kernels and would need CAP_SYS_ADMIN), so failed pages are made
inaccessible with ``mprotect(PROT_NONE)`` (probe answers EINVAL) or ``munmap`` (probe
answers ENOMEM), the way the OS takes a page away. The scan, the bisection and the remap
(``fallocate(PUNCH_HOLE)`` + ``mmap(MAP_FIXED)`` of the same memfd offsets) are the
production code paths; the kernel's memory-failure handling is not exercised.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
from pathlib import Path

import pytest

from leto.pool import localize

PAGE = 4 * mmap.PAGESIZE  # a small "pool page" (production: 2 MiB)


@pytest.fixture
def region():
    n_pages = 200
    fd = os.memfd_create("leto-test-localize")
    os.ftruncate(fd, n_pages * PAGE)
    addr = localize.map_memfd(fd, n_pages * PAGE)
    ctypes.memset(addr, 0x7E, n_pages * PAGE)
    yield fd, addr, n_pages
    localize.unmap(addr, n_pages * PAGE)
    os.close(fd)


def test_healthy_region_reports_nothing(region) -> None:
    _, addr, n = region
    assert localize.scan_failed_pages(addr, n * PAGE, PAGE) == []


@pytest.mark.parametrize("how", ["mprotect", "munmap"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bisection_finds_exactly_the_failed_pages(region, how: str, seed: int) -> None:
    _, addr, n = region
    rng = random.Random(seed)
    bad = sorted(rng.sample(range(n), rng.randint(1, 12)) + [n - 1])  # last page too
    localize.make_inaccessible(addr, PAGE, bad, how=how)
    found = localize.scan_failed_pages(addr, n * PAGE, PAGE, coarse_bytes=32 * PAGE)
    assert found == sorted(set(bad))


def test_remap_gives_zeroed_usable_pages_and_keeps_the_rest(region) -> None:
    fd, addr, n = region
    bad = [3, 4, 5, 77, 199]
    localize.make_inaccessible(addr, PAGE, bad, how="munmap")
    assert localize.scan_failed_pages(addr, n * PAGE, PAGE) == bad
    localize.remap_pages(addr, fd, 0, PAGE, bad)
    assert localize.scan_failed_pages(addr, n * PAGE, PAGE) == []
    buf = (ctypes.c_ubyte * (n * PAGE)).from_address(addr)
    for p in range(n):
        first, last = buf[p * PAGE], buf[(p + 1) * PAGE - 1]
        want = 0 if p in bad else 0x7E
        assert (first, last) == (want, want), p
    buf[3 * PAGE] = 0x11  # the new page is writable and shared with the memfd
    assert os.pread(fd, 1, 3 * PAGE) == b"\x11"


def test_rejects_misaligned_arguments(region) -> None:
    _, addr, n = region
    with pytest.raises(ValueError, match="multiples"):
        localize.scan_failed_pages(addr, n * PAGE + 1, PAGE)


def test_module_does_not_import_torch() -> None:
    src = Path(localize.__file__).read_text()
    assert "import torch" not in src
