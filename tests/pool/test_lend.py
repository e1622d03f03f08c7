"""The lending allocator's arena (``leto/pool/lend.c``), driven directly on CPU.

On CPU there is no CUDA caching allocator to hand it to (tests/gpu/test_lend_gpu.py runs it
under a real ``torch.cuda.MemPool``); here the shared object's first-fit placement and its
bookkeeping run over a host buffer standing in for the undo region, and its fallback
(``cuMemAlloc``) finds no CUDA driver, so a request that does not fit returns NULL.
"""

from __future__ import annotations

import ctypes
import mmap
import shutil

import pytest

from leto.config import LetoConfig
from leto.errors import ConfigError, LetoError
from leto.pool import lend
from leto.pool.lend import MIN_LENT_BYTES, Arena, library_path

MIB = 1 << 20


@pytest.fixture
def arena(tmp_path):
    # A private copy of the library: its arena table is process-global, one per loaded file.
    path = tmp_path / "lend.so"
    shutil.copy(library_path(), path)
    lib = Arena(path)
    buf = mmap.mmap(-1, 20 * MIB)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    lib.add(base, 20 * MIB)
    lib.set_min_bytes(MIN_LENT_BYTES)
    yield lib, base


def test_large_requests_are_placed_first_fit_in_the_arena(arena) -> None:
    lib, base = arena
    a = lib.alloc(4 * MIB)
    b = lib.alloc(6 * MIB)
    assert base <= a < b < base + 20 * MIB and a % (2 * MIB) == 0 and b % (2 * MIB) == 0
    assert b >= a + 4 * MIB
    assert lib.segments() == [(a, 4 * MIB), (b, 6 * MIB)]
    assert lib.lent_bytes() == 10 * MIB
    lib.free(a, 4 * MIB)
    assert lib.segments() == [(b, 6 * MIB)] and lib.lent_bytes() == 6 * MIB
    c = lib.alloc(3 * MIB)  # the first hole that fits is where `a` was
    assert c == a


def test_what_does_not_fit_falls_back_and_small_requests_never_land_in_the_arena(arena) -> None:
    lib, base = arena
    big = lib.alloc(16 * MIB)
    assert base <= big < base + 20 * MIB
    assert lib.alloc(8 * MIB) == 0  # no room left; no CUDA driver here for the fallback
    assert lib.alloc(MIB) == 0  # below MIN_LENT_BYTES: straight to the fallback
    assert lib.alloc(2 * MIB) == 0  # the caching allocator's small-block segment size
    assert lib.segments() == [(big, 16 * MIB)]
    lib.free(big, 16 * MIB)
    assert lib.segments() == [] and lib.lent_bytes() == 0


def test_lending_needs_the_rmu() -> None:
    with pytest.raises(ConfigError, match="lend_activation_memory"):
        LetoConfig(consistency="snapshot", lend_activation_memory=True)
    assert LetoConfig().lend_activation_memory is None  # auto: on with rmu on a CUDA device


def test_an_unwritable_cache_directory_is_a_leto_error(tmp_path, monkeypatch) -> None:
    """What lets the trainer fall back to no lending when left to its default."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(lend.ENV_CACHE_DIR, str(blocker / "sub"))  # a directory under a file
    lend.library_path.cache_clear()
    try:
        with pytest.raises(LetoError, match="LETO_CACHE_DIR"):
            lend.library_path()
    finally:
        lend.library_path.cache_clear()
