"""Chunked device regions on CPU (memfd chunks) against a real state manager process.

What is emulated: a lost device page is what the fault injector makes it on GPU too: the
state manager closes the fd of the chunk that holds it, so the chunk's memory is gone once
no trainer maps it. A chunk that still has an fd but fails this process's probe is made
so with ``mprotect(PROT_NONE)`` (hardware poison cannot be injected here). The page-map
query, the probe, the replacement and the deposit of the fresh chunk are production code;
the GPU twin (CUDA VMM chunks) is tests/gpu/test_vmm_pool.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from leto.errors import PoolError
from leto.pool import localize
from leto.pool.chunks import ChunkedRegion, MemfdChunks
from leto.pool.process import StateManagerProcess
from leto.pool.server import StateManager

PAGE = 4096
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def sm():
    proc = StateManagerProcess.start()
    yield proc
    proc.stop()


def _fill(region: ChunkedRegion, seed: int) -> None:
    import ctypes

    buf = (ctypes.c_ubyte * region.nbytes).from_address(region.ptr)
    for i in range(0, region.nbytes, PAGE):
        ctypes.memset(region.ptr + i, (i // PAGE + seed) % 251 + 1, PAGE)
    assert buf[0] == seed % 251 + 1


def _page_byte(region: ChunkedRegion, page: int) -> tuple[int, int]:
    import ctypes

    buf = (ctypes.c_ubyte * region.nbytes).from_address(region.ptr)
    return buf[page * PAGE], buf[(page + 1) * PAGE - 1]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_region_of_more_chunks_than_one_message_carries_round_trips(sm) -> None:
    """600 chunks: deposit and fetch go in windows of SCM_MAX_FD; no fd leaks here."""
    pool = sm.client()
    before = _open_fds()
    first = ChunkedRegion.attach(MemfdChunks(), pool, 0, "state", 600 * PAGE - 100, PAGE)
    assert not first.existing and first.table.num_chunks == 600 and first.nbytes == 600 * PAGE
    _fill(first, seed=3)
    second = ChunkedRegion.attach(MemfdChunks(), pool, 0, "state", 600 * PAGE - 100, PAGE)
    assert second.existing and second.ptr != first.ptr
    assert [_page_byte(second, p) for p in range(600)] == [_page_byte(first, p) for p in range(600)]
    assert _open_fds() == before  # chunk fds are mapped, then closed
    stats = pool.stats()
    assert stats["fds"] == 600 and stats["bytes"]["device"] == 600 * PAGE
    assert second.localize() == [] and pool.pagemap(0, "state") == []


def test_chunks_lost_after_mapping_are_found_and_replaced_zeroed(sm) -> None:
    """The shadow path: mapped ahead, then the writer dies and chunks are lost."""
    pool = sm.client()
    writer = textwrap.dedent("""
        import ctypes, os, signal, sys
        from leto.pool.chunks import ChunkedRegion, MemfdChunks
        from leto.pool.client import PoolClient
        r = ChunkedRegion.attach(MemfdChunks(), PoolClient(sys.argv[1]), 0, "state", 64 * 4096, 2 * 4096)
        for i in range(64):
            ctypes.memset(r.ptr + i * 4096, i + 1, 4096)
        print("written", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = subprocess.run(
        [sys.executable, "-c", writer, sm.socket_path],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": REPO},
        check=False,
    )
    assert out.returncode == -signal.SIGKILL and "written" in out.stdout, out.stderr
    shadow = ChunkedRegion.attach(
        MemfdChunks(), pool, 0, "state", 64 * PAGE, PAGE
    )  # takes the retained 8 KiB
    assert shadow.table.chunk_bytes == 2 * PAGE and shadow.existing
    assert pool.erase(0, "state", PAGE, [5, 40, 41]) == [
        4,
        5,
        40,
        41,
    ]  # a chunk loses both its pages
    assert pool.pagemap(0, "state") == [2, 20]
    assert shadow.localize() == [2, 20]
    for p in range(64):
        want = 0 if p in (4, 5, 40, 41) else p + 1
        assert _page_byte(shadow, p) == (want, want), p
    # Until the rebuild is committed the state manager still holds them as lost.
    assert pool.pagemap(0, "state") == [2, 20] and shadow.localize() == []
    import ctypes

    ctypes.memset(shadow.ptr + 4 * PAGE, 0x5A, PAGE)  # the rebuild
    shadow.commit()
    assert pool.pagemap(0, "state") == []
    # The fresh chunks are retained: a successor sees the shadow's writes to them.
    successor = ChunkedRegion.attach(MemfdChunks(), pool, 0, "state", 64 * PAGE, PAGE)
    assert _page_byte(successor, 4) == (0x5A, 0x5A) and successor.lost_pages(PAGE) == []


def test_chunks_lost_before_attach_are_replaced_and_reported_once(sm) -> None:
    pool = sm.client()
    first = ChunkedRegion.attach(MemfdChunks(), pool, 0, "grads", 32 * PAGE, PAGE)
    _fill(first, seed=0)
    pool.erase(0, "grads", PAGE, [0, 31])
    del first  # (its mapping stays until exit: a dead writer's would not)
    successor = ChunkedRegion.attach(MemfdChunks(), pool, 0, "grads", 32 * PAGE, PAGE)
    assert pool.pagemap(0, "grads") == [
        0,
        31,
    ]  # replaced at attach, not deposited before the rebuild
    assert successor.lost_pages(PAGE) == [0, 31]
    assert successor.lost_pages(PAGE) == []
    assert _page_byte(successor, 0) == (0, 0) and _page_byte(successor, 1) == (2, 2)
    successor.commit()
    assert pool.pagemap(0, "grads") == []


def test_a_successor_that_dies_before_committing_its_rebuild_leaves_the_losses(sm) -> None:
    """A kill in the middle of a page rebuild: the replacement chunks were never deposited,
    so the next successor finds the same chunks lost (not zeroed chunks that read as intact)."""
    pool = sm.client()
    first = ChunkedRegion.attach(MemfdChunks(), pool, 0, "state", 32 * PAGE, PAGE)
    _fill(first, seed=0)
    pool.erase(0, "state", PAGE, [3])
    del first
    dying = textwrap.dedent(f"""
        import os, signal, sys
        from leto.pool.chunks import ChunkedRegion, MemfdChunks
        from leto.pool.client import PoolClient
        region = ChunkedRegion.attach(MemfdChunks(), PoolClient(sys.argv[1]), 0, "state", {32 * PAGE}, {PAGE})
        assert region.localize() == [3]
        os.kill(os.getpid(), signal.SIGKILL)  # mid-rebuild
    """)
    out = subprocess.run(
        [sys.executable, "-c", dying, sm.socket_path],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": REPO},
        check=False,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    assert pool.pagemap(0, "state") == [3]
    successor = ChunkedRegion.attach(MemfdChunks(), pool, 0, "state", 32 * PAGE, PAGE)
    assert successor.lost_pages(PAGE) == [3]


def test_a_chunk_that_fails_the_probe_is_replaced_though_its_fd_is_held(sm) -> None:
    """Poison is emulated with PROT_NONE on this process's view of one chunk."""
    pool = sm.client()
    region = ChunkedRegion.attach(MemfdChunks(), pool, 0, "state", 16 * PAGE, PAGE)
    _fill(region, seed=1)
    localize.make_inaccessible(region.ptr, PAGE, [9])
    assert pool.pagemap(0, "state") == []
    assert region.localize() == [9]
    assert _page_byte(region, 9) == (0, 0) and _page_byte(region, 8) == (10, 10)
    assert pool.stats()["fds"] == 16


def test_reattach_with_another_size_is_refused(sm) -> None:
    pool = sm.client()
    ChunkedRegion.attach(MemfdChunks(), pool, 0, "state", 4 * PAGE, PAGE)
    with pytest.raises(PoolError, match="reattach of rank 0 region 'state' does not match"):
        ChunkedRegion.attach(MemfdChunks(), pool, 0, "state", 8 * PAGE, PAGE)


def _deposit(manager: StateManager, fds: list[int], **fields) -> dict:
    request = {
        "op": "deposit",
        "rank": 0,
        "name": "state",
        "nbytes": 4 * PAGE,
        "dtype": "uint8",
        "tier": "device",
        "chunk_bytes": PAGE,
        "backing": "memfd-chunks",
        "start": 0,
        **fields,
    }
    return manager.handle(request, fds)[0]


def test_state_manager_validates_deposits_and_closes_refused_fds() -> None:
    manager = StateManager()
    memfds = MemfdChunks()
    try:
        with pytest.raises(PoolError, match="backing 'gpu'"):
            _deposit(manager, [memfds.create(PAGE)], backing="gpu")
        with pytest.raises(PoolError, match="do not fit"):
            _deposit(manager, [memfds.create(PAGE) for _ in range(2)], start=3)
        with pytest.raises(PoolError, match="whole number"):
            _deposit(manager, [memfds.create(PAGE)], chunk_bytes=3 * PAGE)
        assert _deposit(manager, [memfds.create(PAGE) for _ in range(2)])["ok"]
        with pytest.raises(PoolError, match="already retained"):
            _deposit(manager, [memfds.create(PAGE)], start=1)
        assert _deposit(manager, [memfds.create(PAGE)], start=1, replace=True)["ok"]
        with pytest.raises(PoolError, match="does not match"):
            _deposit(manager, [memfds.create(PAGE)], chunk_bytes=2 * PAGE, replace=True)
        assert manager.handle({"op": "pagemap", "rank": 0, "name": "state"})[0]["lost"] == [
            (2, 2)
        ]  # (first, count) runs
        with pytest.raises(PoolError, match="per chunk"):
            manager.handle({"op": "lookup", "rank": 0, "name": "state"})
        with pytest.raises(PoolError, match="the trainer localises it"):
            manager.handle({"op": "localize", "rank": 0, "name": "state", "page_bytes": PAGE})
        manager.handle(
            {
                "op": "alloc",
                "rank": 0,
                "name": "p1",
                "nbytes": PAGE,
                "dtype": "uint8",
                "tier": "host",
            }
        )
        with pytest.raises(PoolError, match="use lookup, not fetch"):
            manager.handle({"op": "fetch", "rank": 0, "name": "p1"})
        fds_held = manager.handle({"op": "stats"})[0]["fds"]
        assert fds_held == 3  # two chunks (one replaced: the old fd closed) + the memfd
    finally:
        manager.close()
