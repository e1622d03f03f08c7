"""The state manager survives any client of its own uid (a real state manager process).

Each abuse (garbage, malformed JSON with fds attached, huge messages, deep nesting, wrong
field types, foreign fds offered as deposits, a client at its own fd limit, a client
that fills the state manager's fd table with connections, a flood of connections) must
be answered or survived without leaking an fd of the state manager (counted through
``/proc/<pid>/fd``), and afterwards a normal client still allocates and looks up, and
the region written before the abuse still holds its bytes.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from leto.errors import PoolError
from leto.pool import pagemap, protocol
from leto.pool.chunks import MemfdChunks
from leto.pool.process import StateManagerProcess

PAGE = 4096
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEEP = b"retained across every abuse"


@pytest.fixture
def sm():
    proc = StateManagerProcess.start()
    pool = proc.client()
    region = pool.alloc(0, "keep", PAGE, "uint8", "host")
    region.buffer[: len(KEEP)] = KEEP
    region.close()
    pool.close()
    yield proc
    proc.stop()


def _server_fds(sm: StateManagerProcess) -> int:
    return len(os.listdir(f"/proc/{sm.proc.pid}/fd"))


def _quiet_fds(sm: StateManagerProcess) -> int:
    """The state manager's fd count once it has been steady for 0.2 s (a connection just
    closed by a client is closed there a moment later)."""
    last, steady_since = _server_fds(sm), time.monotonic()
    while time.monotonic() - steady_since < 0.2:
        time.sleep(0.02)
        if (n := _server_fds(sm)) != last:
            last, steady_since = n, time.monotonic()
    return last


def _settled_fds(sm: StateManagerProcess, expected: int, timeout_s: float = 10.0) -> int:
    """The state manager's fd count once it is back to ``expected`` (connections close
    asynchronously: their threads see the hang-up a moment after the client's close)."""
    deadline = time.monotonic() + timeout_s
    while (n := _server_fds(sm)) != expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return n


def _assert_healthy(sm: StateManagerProcess, probe: str) -> None:
    assert sm.alive(), sm.exit_status()
    pool = sm.client()
    try:
        fresh = pool.alloc(0, probe, PAGE, "uint8", "host")
        assert not fresh.existing
        fresh.close()
        kept = pool.lookup(0, "keep")
        assert kept is not None and kept.buffer[: len(KEEP)] == KEEP
        kept.close()
    finally:
        pool.close()


def _raw(sm: StateManagerProcess) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(sm.socket_path)
    return sock


def _reply(sock: socket.socket) -> dict | None:
    """The state manager's answer (None: it closed the connection without one)."""
    data, fds, _flags, _ = socket.recv_fds(sock, protocol.MAX_MESSAGE_BYTES, 8)
    for fd in fds:
        os.close(fd)
    return json.loads(data) if data else None


def _three_fds() -> list[int]:
    r, w = os.pipe()
    return [r, w, MemfdChunks().create(PAGE)]


MALFORMED = [
    b"\xff\xfe\x00garbage",
    b"\xc3\x28",  # invalid UTF-8
    b"[1, 2, 3]",
    b'"a string"',
    b"null",
    b"{not json",
    b'{"op": 5}',
    b'{"op": "no_such_op"}',
    b'{"op": "lookup", "rank": [1], "name": {}}',
    b'{"op": "fetch", "rank": 0, "name": "keep", "start": []}',
    b'{"op": "alloc", "rank": 0, "name": "x", "nbytes": "big", "dtype": "uint8", "tier": "host"}',
    b'{"op": "alloc", "rank": true, "name": "x", "nbytes": 4096, "dtype": "uint8", "tier": [1]}',
    b'{"op": "erase", "rank": 0, "name": "keep", "page_bytes": 4096, "pages": {"a": 1}}',
    b'{"op": "seal", "rank": 0, "digest": 7}',
    b'{"op": "identities", "rank": "zero"}',
]


@pytest.mark.timeout(60)
def test_malformed_messages_with_fds_are_answered_and_leak_no_fd(sm) -> None:
    baseline = _quiet_fds(sm)
    for payload in MALFORMED:
        with _raw(sm) as sock:
            fds = _three_fds()
            try:
                socket.send_fds(sock, [payload], fds)
            finally:
                for fd in fds:
                    os.close(fd)
            reply = _reply(sock)
            assert reply is not None and reply["ok"] is False and reply["error"], payload
    assert _settled_fds(sm, baseline) == baseline
    _assert_healthy(sm, "after-malformed")


@pytest.mark.timeout(60)
def test_a_malformed_message_mid_connection_is_answered_and_the_state_manager_lives_on(sm) -> None:
    """Garbage after valid requests on the same connection; then a fresh client works."""
    baseline = _quiet_fds(sm)
    with _raw(sm) as sock:
        protocol.send(sock, {"op": "ping"})
        assert _reply(sock)["ok"]
        null = os.open("/dev/null", os.O_RDONLY)
        socket.send_fds(sock, [b"\xff" * 100], [null])
        os.close(null)
        reply = _reply(sock)
        assert reply is not None and not reply["ok"]
    assert _settled_fds(sm, baseline) == baseline
    _assert_healthy(sm, "after-mid-connection")


@pytest.mark.timeout(60)
def test_huge_and_deeply_nested_messages_are_answered(sm) -> None:
    baseline = _quiet_fds(sm)
    huge = json.dumps({"op": "ping", "pad": "x" * (3 * protocol.MAX_MESSAGE_BYTES)}).encode()
    deep = b"[" * 30000 + b"]" * 30000  # under the size bound: the parser's recursion is the limit
    nested = json.dumps({"op": "ping", "x": json.loads("[" * 40 + "1" + "]" * 40)}).encode()
    for payload in (huge, deep, nested):
        with _raw(sm) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            fds = _three_fds()
            try:
                socket.send_fds(sock, [payload], fds)
            finally:
                for fd in fds:
                    os.close(fd)
            reply = _reply(sock)
            assert reply is not None and not reply["ok"], payload[:40]
    assert _settled_fds(sm, baseline) == baseline
    _assert_healthy(sm, "after-huge")


def _memfd(nbytes: int = PAGE) -> int:
    return MemfdChunks().create(nbytes)


@pytest.mark.timeout(60)
def test_only_memfds_and_device_handles_are_accepted_as_deposits(sm, tmp_path) -> None:
    pool = sm.client()
    baseline = _quiet_fds(sm)
    r, w = os.pipe()
    a, b = socket.socketpair()
    master, tty = os.openpty()
    foreign = {
        "a regular file": os.open("/etc/passwd", os.O_RDONLY),
        "a directory": os.open(str(tmp_path), os.O_RDONLY | os.O_DIRECTORY),
        "a pipe": r,
        "a socket": a.fileno(),
        "a tty": tty,
        "/dev/null": os.open("/dev/null", os.O_RDWR),
        "a memfd too small for the chunk": _memfd(PAGE // 2),
    }
    good = [_memfd(), _memfd()]
    try:
        for backing in ("memfd-chunks", "cuda"):
            for what, fd in foreign.items():
                with pytest.raises(PoolError, match="refused"):
                    pool.deposit(0, f"state-{backing}", 2 * PAGE, PAGE, backing, [good[0], fd])
                assert pool.describe(0, f"state-{backing}") is None, (
                    what
                )  # nothing kept of the batch
        assert _settled_fds(sm, baseline) == baseline
        pool.deposit(0, "state", 2 * PAGE, PAGE, "memfd-chunks", good)
        assert pool.pagemap(0, "state") == []
        assert _server_fds(sm) == baseline + 2
    finally:
        for fd in (*foreign.values(), *good, w, master):
            if fd != a.fileno():
                os.close(fd)
        a.close()
        b.close()
        pool.close()
    _assert_healthy(sm, "after-foreign")


@pytest.mark.timeout(60)
def test_deposits_never_take_the_last_fds_of_the_state_manager(sm) -> None:
    """With a low fd limit the state manager refuses a deposit that would leave it fewer
    than FD_RESERVE free fds, and keeps serving."""
    resource.prlimit(
        sm.proc.pid, resource.RLIMIT_NOFILE, (pagemap.FD_RESERVE + 40, pagemap.FD_RESERVE + 40)
    )
    pool = sm.client()
    fds = [_memfd() for _ in range(60)]
    try:
        with pytest.raises(PoolError, match="open-file limit"):
            pool.deposit(0, "state", 60 * PAGE, PAGE, "memfd-chunks", fds)
    finally:
        for fd in fds:
            os.close(fd)
        pool.close()
    _assert_healthy(sm, "after-fd-budget")


_AT_ITS_LIMIT = textwrap.dedent("""
    import os, resource, sys
    from leto.errors import LetoError
    from leto.pool.client import PoolClient
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    os.close(held.pop())  # one fd: the connection
    pool = PoolClient(sys.argv[1])
    for _ in range(5):  # each reply carries the region's fd, which cannot arrive
        try:
            pool.lookup(0, "keep")
            print("arrived")
        except LetoError as e:
            print("refused:", e)
    print("done", flush=True)
""")


@pytest.mark.timeout(60)
def test_a_client_at_its_own_fd_limit_costs_the_state_manager_nothing(sm) -> None:
    baseline = _quiet_fds(sm)
    out = subprocess.run(
        [sys.executable, "-c", _AT_ITS_LIMIT, sm.socket_path],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": REPO},
        check=False,
    )
    assert out.returncode == 0 and "done" in out.stdout, out.stderr
    assert "refused: file descriptors of a message were dropped" in out.stdout, out.stdout
    assert _settled_fds(sm, baseline) == baseline
    _assert_healthy(sm, "after-client-limit")


_HOG = textwrap.dedent("""
    import os, socket, sys, time
    resource = __import__("resource")
    resource.setrlimit(resource.RLIMIT_NOFILE, (4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    while len(held) < int(sys.argv[2]):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(2)
        try:
            s.connect(sys.argv[1])
        except OSError:
            s.close()
            time.sleep(0.01)
            continue
        held.append(s)
    print("holding", len(held), flush=True)
    sys.stdin.readline()
""")


@pytest.mark.timeout(120)
def test_a_client_that_fills_the_state_managers_fd_table_does_not_end_it(sm) -> None:
    """The state manager's fd limit lowered to 256: 400 held connections make its
    accept() fail with EMFILE; it backs off and serves again once they close."""
    resource.prlimit(sm.proc.pid, resource.RLIMIT_NOFILE, (256, 256))
    hog = subprocess.Popen(
        [sys.executable, "-c", _HOG, sm.socket_path, "400"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    try:
        deadline = time.monotonic() + 60
        while _server_fds(sm) < 250 and time.monotonic() < deadline and hog.poll() is None:
            time.sleep(0.05)
        assert _server_fds(sm) >= 250, "the hog did not fill the state manager's fd table"
        time.sleep(0.5)  # accept() keeps failing with EMFILE meanwhile
        assert sm.alive(), sm.exit_status()
    finally:
        hog.kill()
        hog.wait()
        hog.stdout.close()
        hog.stdin.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            _assert_healthy(sm, "after-hog")
            break
        except PoolError:  # the backlog of the hog's connections drains first
            time.sleep(0.2)
    else:
        _assert_healthy(sm, "after-hog")


@pytest.mark.timeout(120)
def test_a_flood_of_300_concurrent_connections_is_served(sm) -> None:
    """300 connects while the state manager cannot accept (stopped): the backlog holds
    them all, and each is served once it runs again."""
    os.kill(sm.proc.pid, signal.SIGSTOP)
    socks: list[socket.socket] = []
    refused = 0
    try:
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.setblocking(False)
            try:
                s.connect(sm.socket_path)
                socks.append(s)
            except OSError:
                refused += 1
                s.close()
    finally:
        os.kill(sm.proc.pid, signal.SIGCONT)
    try:
        assert refused == 0, f"{refused} of 300 connections refused"
        for s in socks:
            s.settimeout(60)
            protocol.send(s, {"op": "ping"})
        for s in socks:
            reply, _ = protocol.recv(s)
            assert reply is not None and reply["ok"]
    finally:
        for s in socks:
            s.close()
    _assert_healthy(sm, "after-flood")


@pytest.mark.timeout(60)
def test_the_cause_of_the_state_managers_death_is_known(sm) -> None:
    assert sm.alive() and sm.exit_status() is None
    pool = sm.client()
    old_instance = pool.identities(0).instance
    pool.close()
    os.kill(sm.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while sm.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    status = sm.exit_status()
    assert status is not None and status.signal == signal.SIGKILL and status.code is None
    assert str(status) == "killed by SIGKILL"

    old_path = sm.socket_path
    sm_new = sm.restart()  # the agent's way back: same socket path, nothing retained
    try:
        assert sm_new.socket_path == old_path and sm_new.alive()
        pool = sm_new.client()
        assert pool.lookup(0, "keep") is None
        assert pool.identities(0).instance != old_instance
        pool.close()
    finally:
        sm_new.stop()

    clean = StateManagerProcess.start()
    clean.client().shutdown()
    clean.proc.wait(10)
    assert clean.exit_status().code == 0 and str(clean.exit_status()) == "exited with code 0"
    clean.stop()


_MANY = textwrap.dedent("""
    import json, socket, sys
    socks = []
    for _ in range(int(sys.argv[2])):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(0.5)
        s.connect(sys.argv[1])
        socks.append(s)
    refused = 0
    for s in socks:
        try:
            data = s.recv(1 << 16)  # only a refused connection is sent anything
            refused += bool(data) and not json.loads(data)["ok"]
        except TimeoutError:
            pass
    print("refused", refused, flush=True)
    sys.stdin.readline()
""")


@pytest.mark.timeout(120)
def test_one_process_cannot_take_every_connection() -> None:
    """Beyond its connection limit a process's connections are answered with an error and
    closed; another process is served meanwhile."""
    sm = StateManagerProcess.start(max_connections_per_peer=16)
    hog = subprocess.Popen(
        [sys.executable, "-c", _MANY, sm.socket_path, "40"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )
    try:
        pool = sm.client()
        pool.alloc(0, "keep", PAGE, "uint8", "host").buffer[: len(KEEP)] = KEEP
        pool.close()
        assert hog.stdout.readline().split() == ["refused", "24"]
        _assert_healthy(sm, "beside-the-hog")  # while the hog holds its 16
    finally:
        hog.kill()
        hog.wait()
        hog.stdout.close()
        hog.stdin.close()
        sm.stop()


def test_the_socket_directory_goes_even_when_closing_the_regions_raises(tmp_path) -> None:
    """The state manager's exit removes its socket and directory whatever dropping its
    regions raised (e.g. a connection thread still adding one): a killed agent must leave
    no directory behind."""
    import threading

    from leto.pool.client import PoolClient
    from leto.pool.server import StateManager, serve

    class FailingClose(StateManager):
        def close(self) -> None:
            super().close()
            raise RuntimeError("dictionary changed size during iteration")

    sock_dir = tmp_path / "sm"
    sock_dir.mkdir(mode=0o700)
    path = str(sock_dir / "state-manager.sock")
    raised: list[BaseException] = []

    def run() -> None:
        try:
            serve(path, manager=FailingClose())
        except RuntimeError as e:
            raised.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 10
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    client = PoolClient(path)
    client.shutdown()
    client.close()
    thread.join(10)
    assert not thread.is_alive() and len(raised) == 1
    assert not sock_dir.exists()
