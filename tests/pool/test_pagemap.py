"""Page-table arithmetic, fd batching and the open-file limit of chunked device regions."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from leto.errors import ProtocolError
from leto.pool import pagemap, protocol
from leto.pool.pagemap import PageTable

MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_batches_cover_every_item_once_in_scm_sized_windows() -> None:
    items = list(range(600))
    got = list(pagemap.batches(items))
    assert [(s, len(b)) for s, b in got] == [(0, 253), (253, 253), (506, 94)]
    assert [x for _, b in got for x in b] == items
    assert list(pagemap.batches([])) == []
    with pytest.raises(ValueError, match="positive"):
        list(pagemap.batches(items, 0))


def test_runs_round_trip() -> None:
    idx = [9, 1, 2, 3, 7, 8, 3, 20]
    assert pagemap.runs(idx) == [(1, 3), (7, 3), (20, 1)]
    assert pagemap.from_runs(pagemap.runs(idx)) == sorted(set(idx))


def test_one_billion_parameters_fit_at_two_mib_chunks_under_usual_limits() -> None:
    """The numbers behind the default granule (leto/pool/pagemap.py's docstring)."""
    params = 10**9
    total = 16 * params + 4 * params  # state (fp32 params + AdamW moments + master) + fp32 grads
    per_rank = -(-total // (2 * MiB))
    assert 9_500 <= per_rank <= 9_600  # ~7.6k state + ~1.9k gradient chunks
    # systemd's default hard limit, 8 ranks per node: one erasure page per chunk.
    assert (
        pagemap.plan_chunk_bytes(total, 2 * MiB, 2 * MiB, pagemap.fd_budget(524_288, 8)) == 2 * MiB
    )
    # This development box's hard limit (20,000), 8 ranks: 2,436 chunks each -> 8 MiB chunks.
    budget = pagemap.fd_budget(20_000, 8)
    assert budget == 2_436
    chunk = pagemap.plan_chunk_bytes(total, 2 * MiB, 2 * MiB, budget)
    assert chunk == 8 * MiB and -(-total // chunk) <= budget
    # A full H200 (141 GB of state per rank) under systemd's limit: 4 MiB.
    assert (
        pagemap.plan_chunk_bytes(141 * 10**9, 2 * MiB, 2 * MiB, pagemap.fd_budget(524_288, 8))
        == 4 * MiB
    )


def test_chunk_is_a_multiple_of_page_and_granularity() -> None:
    assert (
        pagemap.plan_chunk_bytes(10 * MiB, 4096, 2 * MiB, 1000) == 2 * MiB
    )  # GPU, small test pages
    assert pagemap.plan_chunk_bytes(10 * 4096, 4096, 4096, 1000) == 4096  # CPU
    assert pagemap.plan_chunk_bytes(100 * 4096, 4096, 4096, 30) == 4 * 4096
    with pytest.raises(ValueError, match="positive"):
        pagemap.plan_chunk_bytes(0, 4096, 4096, 1)


def test_page_table_translates_pages_and_chunks() -> None:
    table = PageTable(nbytes=8 * 16384, chunk_bytes=16384)  # 8 chunks of 4 pages of 4 KiB
    assert table.num_chunks == 8
    assert table.chunks_of([0, 3, 5, 31], 4096) == [0, 1, 7]
    assert table.pages_of([1, 7], 4096) == [4, 5, 6, 7, 28, 29, 30, 31]
    assert table.pages_of([2], 16384) == [2]
    with pytest.raises(ValueError, match="outside"):
        table.chunks_of([32], 4096)
    with pytest.raises(ValueError, match="does not divide"):
        table.pages_of([0], 3 * 4096)
    with pytest.raises(ValueError, match="whole number"):
        PageTable(nbytes=16384 + 4096, chunk_bytes=16384)


def test_nofile_soft_limit_is_raised_to_the_hard_limit() -> None:
    code = textwrap.dedent("""
        import resource
        from leto.pool import pagemap
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        print(pagemap.raise_nofile_limit() == hard == resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": REPO},
        check=False,
    )
    assert out.stdout.strip() == "True", out.stderr


def test_more_fds_than_scm_max_fd_in_one_message_are_refused() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds = [os.dup(0) for _ in range(pagemap.SCM_MAX_FD + 1)]
    try:
        with pytest.raises(ProtocolError, match="batches"):
            protocol.send(a, {"op": "x"}, fds)
        protocol.send(a, {"op": "x"}, fds[: pagemap.SCM_MAX_FD])  # the limit itself passes
        message, got = protocol.recv(b)
        assert message == {"op": "x"} and len(got) == pagemap.SCM_MAX_FD
        for fd in got:
            os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)
        a.close()
        b.close()


def test_fds_dropped_at_the_receivers_limit_are_an_error_not_a_short_list() -> None:
    """The kernel drops SCM_RIGHTS fds beyond the receiver's RLIMIT_NOFILE (MSG_CTRUNC)."""
    code = textwrap.dedent("""
        import os, resource, socket
        from leto.errors import ProtocolError
        from leto.pool import protocol
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [os.dup(0) for _ in range(40)]
        protocol.send(a, {"op": "x"}, fds)
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 10, hard))  # room for 10 of the 40
        try:
            protocol.recv(b)
            print("no error")
        except ProtocolError as e:
            print("refused:", e)
    """)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": REPO},
        check=False,
    )
    assert "refused: file descriptors of a message were dropped (MSG_CTRUNC" in out.stdout, (
        out.stdout + out.stderr
    )
