"""The state manager: owns every retained region of this node's ranks.

Run as ``python -m leto.pool.server SOCKET_PATH``. It allocates named, sized regions
(memfd on CPU; the device tier becomes CUDA VMM on GPU), keeps them open for the life of
the job and hands them to trainers as file descriptors over a Unix socket. A trainer's
death therefore loses nothing: its successor reattaches by name. The server never maps
or reads the regions it owns (it must not touch potentially faulty pages) and never
imports torch, so it starts in milliseconds and stays small.

Security: the socket lives in a 0700 directory made by the agent, and every peer's uid
(SO_PEERCRED) must equal ours. Robustness against those peers: a malformed request is
answered with an error (and its connection closed), fds received and not kept are
closed, only memfds (and, for CUDA regions, device handles) are accepted as deposits,
deposits never take the last ``FD_RESERVE`` fds, one process holds at most
``MAX_CONNECTIONS_PER_PEER`` connections, and neither a failing ``accept()`` nor
a failing connection ends the server: only SIGTERM or a ``shutdown`` request does.

Identity: every region gets one when it is created, ``<instance>:<serial>`` (the server's
random instance id, a creation counter), returned with every alloc, lookup, fetch and
deposit. A region freed and made again is a new identity, so a trainer can tell retained
memory from a fresh region of the same name (``leto.trainer.memory``). ``seal`` records a
rank's initialised state (kept until ``reset``): a successor that finds the seal but no
marker knows the marker region itself was lost.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import fcntl
import itertools
import logging
import os
import resource
import secrets
import signal
import socket
import stat
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from leto.errors import LetoError, PoolError, ProtocolError
from leto.lifetime import die_with_agent
from leto.pool import localize, pagemap, protocol
from leto.pool.protocol import RegionSpec

logger = logging.getLogger(__name__)

DEFAULT_MAX_REGION_BYTES = 1 << 40
LISTEN_BACKLOG = 4096
"""Connections queued before accept (capped by ``net.core.somaxconn``): a node's trainers,
shadows and agent all connect at once around a recovery."""
MAX_CONNECTIONS_PER_PEER = 1024
"""Connections one peer process may hold open (a trainer holds one or two): no client can
take every fd and thread of the state manager from the others."""
ACCEPT_BACKOFF_S = 0.05
"""Pause after an accept() that failed for lack of fds or memory (the listener stays
readable, so retrying at once would spin)."""
_ACCEPT_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_MEM_CHAR_MAJOR = 1
"""Character devices of major 1 (/dev/null, /dev/zero, /dev/mem, ...) hold no memory to retain."""


@dataclass(slots=True)
class _Region:
    spec: RegionSpec
    ident: str
    """``<instance>:<serial>``, given when the region was created (never reused)."""
    fds: list[int | None]
    """One fd (memfd made here), or one per chunk of a deposited region (None: lost)."""
    chunk_bytes: int
    backing: str = "memfd"
    """memfd: made here; cuda / memfd-chunks: a trainer's per-chunk allocations, deposited."""
    addr: int | None = None
    """The state manager's own mapping, made only for localisation (never read)."""

    @property
    def deposited(self) -> bool:
        return self.backing != "memfd"

    @property
    def fd(self) -> int:
        if self.deposited or self.fds[0] is None:
            raise PoolError(f"region {self.spec.name!r} is {self.backing} memory, held per chunk")
        return self.fds[0]

    @property
    def table(self) -> pagemap.PageTable:
        return pagemap.PageTable(self.spec.nbytes, self.chunk_bytes)

    def lost_chunks(self) -> list[int]:
        return [i for i, fd in enumerate(self.fds) if fd is None]

    def mapping(self) -> int:
        if self.deposited:
            raise PoolError(
                f"region {self.spec.name!r} is {self.backing} memory: the trainer localises it"
            )
        if self.addr is None:
            self.addr = localize.map_memfd(self.fd, self.spec.nbytes)
        return self.addr

    def drop(self, chunks: list[int]) -> int:
        """Close these chunks' fds: once no process maps them, their memory is gone.
        Returns the number of fds closed."""
        closed = 0
        for i in chunks:
            fd, self.fds[i] = self.fds[i], None
            if fd is not None:
                os.close(fd)
                closed += 1
        return closed

    def close(self) -> int:
        if self.addr is not None:
            localize.unmap(self.addr, self.spec.nbytes)
            self.addr = None
        return self.drop(list(range(len(self.fds))))


class StateManager:
    """Region table plus the request handlers; transport-independent for unit tests."""

    def __init__(self, max_region_bytes: int = DEFAULT_MAX_REGION_BYTES) -> None:
        self._max_region_bytes = max_region_bytes
        self._regions: dict[tuple[int, str], _Region] = {}
        self._held = 0
        """fds held for regions (the deposit budget's count)."""
        self._sealed: dict[int, str] = {}
        """rank -> the identity digest its trainer recorded when it initialised its state."""
        self._lock = threading.Lock()
        self.instance = secrets.token_hex(8)
        self._serial = itertools.count(1)

    def _new_ident(self) -> str:
        return f"{self.instance}:{next(self._serial)}"

    def handle(
        self, request: dict[str, Any], fds: list[int] | None = None
    ) -> tuple[dict[str, Any], list[int]]:
        """Serve one request; returns the reply and the fds to attach to it, which the
        caller owns and closes after sending (duplicates, taken under the lock: a region
        freed meanwhile can neither close them nor have their numbers reused).

        Only ``deposit`` takes fds from the peer; every fd received and not kept is
        closed, whatever the outcome.
        """
        fds = list(fds or [])
        op = request.get("op")
        handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        try:
            if handler is None:
                raise PoolError(f"unknown request op {op!r}")
            if fds and op != "deposit":
                raise PoolError(f"request {op!r} takes no file descriptors ({len(fds)} sent)")
            with self._lock:
                reply, held = handler(request, fds) if op == "deposit" else handler(request)
                return reply, _dup_all(held)
        finally:
            protocol.close_all(fds)

    def _op_deposit(
        self, request: dict[str, Any], fds: list[int]
    ) -> tuple[dict[str, Any], list[int]]:
        """Retain chunks of a device region a trainer made (CUDA VMM or memfd, one fd each).

        ``start`` is the first chunk index the attached fds fill (at most SCM_MAX_FD per
        message). The first deposit creates the region with every slot empty; later ones
        fill empty slots (the rest of a region, or fresh chunks replacing lost ones), or,
        with ``replace``, slots whose chunk the trainer found failed.
        """
        spec = self._spec(request)
        chunk_bytes, start, backing = (
            request.get("chunk_bytes"),
            request.get("start", 0),
            request.get("backing"),
        )
        if backing not in ("cuda", "memfd-chunks"):
            raise PoolError(
                f"deposit of {spec.name!r}: backing {backing!r} is not cuda or memfd-chunks"
            )
        if not _is_int(chunk_bytes):
            raise PoolError(f"deposit of {spec.name!r}: chunk_bytes {chunk_bytes!r} is not an int")
        try:
            table = pagemap.PageTable(spec.nbytes, chunk_bytes)
        except ValueError as e:
            raise PoolError(f"deposit of {spec.name!r}: {e}") from None
        if not fds or not _is_int(start) or not 0 <= start <= table.num_chunks - len(fds):
            raise PoolError(
                f"deposit of {spec.name!r}: {len(fds)} fds from chunk {start!r} do not fit "
                f"its {table.num_chunks} chunks"
            )
        key = (spec.rank, spec.name)
        region = self._regions.get(key)
        if region is not None and (region.spec, region.chunk_bytes, region.backing) != (
            spec,
            chunk_bytes,
            backing,
        ):
            raise PoolError(
                f"deposit does not match rank {spec.rank} region {spec.name!r}: retained "
                f"{region.spec.nbytes} B in {region.chunk_bytes}-byte {region.backing} chunks"
            )
        slots = range(start, start + len(fds))
        if (
            region is not None
            and not request.get("replace")
            and any(region.fds[i] is not None for i in slots)
        ):
            raise PoolError(
                f"rank {spec.rank} region {spec.name!r}: chunks {start}..{slots[-1]} are already retained"
            )
        for fd in fds:
            _check_deposit_fd(fd, spec.name, backing, chunk_bytes)
        added = len(fds) - (0 if region is None else sum(region.fds[i] is not None for i in slots))
        if self._held + added > _fd_limit() - pagemap.FD_RESERVE:
            raise PoolError(
                f"deposit of {spec.name!r}: {added} more fds would leave the state manager fewer than "
                f"{pagemap.FD_RESERVE} free of its open-file limit ({self._held} held); raise the hard "
                "`ulimit -n` of leto-run, or use larger chunks"
            )
        if region is None:
            region = _Region(
                spec, self._new_ident(), [None] * table.num_chunks, chunk_bytes, backing=backing
            )
            self._regions[key] = region
        self._held -= region.drop(list(slots))
        for i in slots:
            region.fds[i] = fds.pop(0)
        self._held += len(slots)
        return {"ok": True, "ident": region.ident}, []

    def _deposited(self, request: dict[str, Any]) -> _Region | None:
        region = self._regions.get(_key(request))
        if region is not None and not region.deposited:
            raise PoolError(
                f"region {region.spec.name!r} was allocated here (memfd): use lookup, not fetch"
            )
        return region

    def _op_fetch(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """fds of a deposited region's chunks ``start .. start + SCM_MAX_FD - 1`` (the held ones).

        ``indices`` names the chunk of each attached fd; a chunk of the window not named
        is lost. The caller owns the fds it receives.
        """
        region = self._deposited(request)
        if region is None:
            return {"ok": True, "found": False}, []
        start = request.get("start", 0)
        if not _is_int(start) or not 0 <= start < len(region.fds):
            raise PoolError(
                f"fetch of {region.spec.name!r}: start {start!r} outside its {len(region.fds)} chunks"
            )
        window = range(start, min(len(region.fds), start + pagemap.SCM_MAX_FD))
        indices = [i for i in window if region.fds[i] is not None]
        reply = {
            "ok": True,
            "found": True,
            "spec": asdict(region.spec),
            "ident": region.ident,
            "backing": region.backing,
            "chunk_bytes": region.chunk_bytes,
            "indices": indices,
            "end": window.stop,
        }
        return reply, [region.fds[i] for i in indices]  # type: ignore[misc]

    def _op_pagemap(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """The lost (empty) chunk slots of a deposited region, as (first, count) runs."""
        region = self._deposited(request)
        if region is None:
            raise PoolError(
                f"rank {request.get('rank')} has no deposited region {request.get('name')!r}"
            )
        return {"ok": True, "lost": pagemap.runs(region.lost_chunks())}, []

    def _spec(self, request: dict[str, Any]) -> RegionSpec:
        try:
            spec = RegionSpec(
                rank=request["rank"],
                name=request["name"],
                nbytes=request["nbytes"],
                dtype=request["dtype"],
                tier=request["tier"],
            )
        except KeyError as e:
            raise PoolError(f"alloc request lacks field {e.args[0]!r}") from None
        if isinstance(spec.rank, bool) or isinstance(spec.nbytes, bool):
            raise PoolError(f"region {spec.name!r}: rank and nbytes must be ints")
        try:
            spec.validate(self._max_region_bytes)
        except TypeError as e:  # (a dtype or tier that is not hashable)
            raise PoolError(f"region {spec.name!r}: malformed field: {e}") from None
        return spec

    def _op_ping(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        return {"ok": True, "pid": os.getpid()}, []

    def _op_alloc(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Create a region, or reattach to it; a reattach must match the original exactly."""
        spec = self._spec(request)
        key = (spec.rank, spec.name)
        region = self._regions.get(key)
        if region is not None:
            if region.spec != spec:
                raise PoolError(
                    f"reattach of rank {spec.rank} region {spec.name!r} does not match: "
                    f"retained {region.spec.nbytes} B {region.spec.dtype} {region.spec.tier}, "
                    f"asked {spec.nbytes} B {spec.dtype} {spec.tier}"
                )
            return {"ok": True, "existing": True, "ident": region.ident}, [region.fd]
        fd = os.memfd_create(f"leto:r{spec.rank}:{spec.name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, spec.nbytes)
        except OSError:
            os.close(fd)
            raise
        region = self._regions[key] = _Region(spec, self._new_ident(), [fd], spec.nbytes)
        self._held += 1
        return {"ok": True, "existing": False, "ident": region.ident}, [fd]

    def _op_lookup(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        region = self._regions.get(_key(request))
        if region is None:
            return {"ok": True, "found": False}, []
        return {"ok": True, "found": True, "spec": asdict(region.spec), "ident": region.ident}, [
            region.fd
        ]

    def _op_describe(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        region = self._regions.get(_key(request))
        if region is None:
            return {"ok": True, "spec": None}, []
        return {"ok": True, "spec": asdict(region.spec), "ident": region.ident}, []

    def _op_free(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        region = self._regions.pop(_key(request), None)
        if region is not None:
            self._held -= region.close()
        return {"ok": True, "freed": region is not None}, []

    def _op_identities(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Every region of a rank with its identity, and the rank's seal (None: unsealed)."""
        rank = _rank(request)
        regions = {name: region.ident for (r, name), region in self._regions.items() if r == rank}
        return {
            "ok": True,
            "instance": self.instance,
            "regions": regions,
            "sealed": self._sealed.get(rank),
        }, []

    def _op_seal(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Record that a rank's state was initialised over regions of this identity digest."""
        rank, digest = _rank(request), request.get("digest")
        if not isinstance(digest, str) or not 0 < len(digest) <= 64:
            raise PoolError(f"seal: digest {digest!r} is not a short string")
        self._sealed[rank] = digest
        return {"ok": True}, []

    def _op_reset(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Drop every region (a group restart begins from a checkpoint, never stale state)."""
        count = len(self._regions)
        self._drop_all()  # handle() holds the lock
        return {"ok": True, "freed": count}, []

    def _op_stats(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        by_tier = {tier: 0 for tier in protocol.TIERS}
        for region in self._regions.values():
            by_tier[region.spec.tier] += region.spec.nbytes
        return {
            "ok": True,
            "regions": len(self._regions),
            "bytes": by_tier,
            "fds": self._held,
            "fd_limit": _fd_limit(),
        }, []

    def _paged_region(self, request: dict[str, Any]) -> tuple[_Region, int]:
        region = self._regions.get(_key(request))
        if region is None:
            raise PoolError(f"rank {request.get('rank')} has no region {request.get('name')!r}")
        page_bytes = request.get("page_bytes")
        if not _is_int(page_bytes) or page_bytes <= 0 or region.spec.nbytes % page_bytes:
            raise PoolError(
                f"page_bytes {page_bytes!r} does not divide region {region.spec.name!r}"
            )
        return region, page_bytes

    def _op_localize(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Find the region's failed pages (madvise scan + bisection) and remap them healthy.

        Contents of remapped pages are zero; rebuilding them is the trainer's job.
        """
        region, page_bytes = self._paged_region(request)
        addr = region.mapping()
        pages = localize.scan_failed_pages(addr, region.spec.nbytes, page_bytes)
        if pages:
            localize.remap_pages(addr, region.fd, 0, page_bytes, pages)
        return {"ok": True, "pages": pages}, []

    def _op_erase(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Fault injection: lose pages the way a memory failure would; replies the pages lost.

        memfd regions: their contents are dropped (hole punched: every mapping reads zeros)
        and they become inaccessible to the localisation probe (PROT_NONE here). Deposited
        regions: the fds of the chunks holding them are closed, so the chunks are gone once
        no trainer maps them (a chunk loses all its pages) and the trainer's page-map query
        finds the empty slots.
        """
        region, page_bytes = self._paged_region(request)
        pages = request.get("pages")
        total = region.spec.nbytes // page_bytes
        if not isinstance(pages, list) or not all(_is_int(p) and 0 <= p < total for p in pages):
            raise PoolError(f"erase: pages must be indices below {total}")
        if region.deposited:
            try:
                chunks = region.table.chunks_of(pages, page_bytes)
            except ValueError as e:
                raise PoolError(f"erase: {e}") from None
            self._held -= region.drop(chunks)
            return {"ok": True, "pages": region.table.pages_of(chunks, page_bytes)}, []
        addr = region.mapping()
        for p in pages:
            localize.punch_hole(region.fd, p * page_bytes, page_bytes)
        localize.make_inaccessible(addr, page_bytes, pages)
        return {"ok": True, "pages": sorted(set(pages))}, []

    def close(self) -> None:
        """Drop every region. Under the lock: connection threads may still be serving
        requests (a shadow mapping its regions) when the state manager is told to stop."""
        with self._lock:
            self._drop_all()

    def _drop_all(self) -> None:
        """Close every region (the caller holds the lock)."""
        for region in self._regions.values():
            region.close()
        self._regions.clear()
        self._held = 0
        self._sealed.clear()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rank(request: dict[str, Any]) -> int:
    rank = request.get("rank")
    if not _is_int(rank) or rank < 0:
        raise PoolError(f"rank must be a non-negative int, got {rank!r}")
    return rank


def _key(request: dict[str, Any]) -> tuple[int, str]:
    """(rank, name) of a request that names a region (types checked: the table's key)."""
    name = request.get("name")
    if not isinstance(name, str):
        raise PoolError(f"region name must be a string, got {name!r}")
    return _rank(request), name


def _fd_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _dup_all(fds: list[int]) -> list[int]:
    out: list[int] = []
    try:
        for fd in fds:
            out.append(os.dup(fd))
    except OSError:
        protocol.close_all(out)
        raise
    return out


def _has_seals(fd: int) -> bool:
    """True for shared memory files (memfd, tmpfs), which answer F_GET_SEALS; a file on disk does not."""
    try:
        fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return True


def _check_deposit_fd(fd: int, name: str, backing: str, chunk_bytes: int) -> None:
    """Accept only memory: a memfd of at least one chunk (memfd-chunks, or CUDA on CPU
    tests), or for ``cuda`` a device handle (an anonymous inode or a driver's character
    device): never a file, directory, socket, pipe, tty or /dev/null-like device."""
    st = os.fstat(fd)
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        link = "?"
    if stat.S_ISREG(st.st_mode) and (link.startswith("/memfd:") or _has_seals(fd)):
        if st.st_size < chunk_bytes:
            raise PoolError(
                f"deposit of {name!r} refused: a memfd of {st.st_size} B cannot hold a "
                f"{chunk_bytes}-byte chunk"
            )
        return
    kind = stat.S_IFMT(st.st_mode)
    device_handle = kind == 0 or (  # anon_inode fds have no file type
        kind == stat.S_IFCHR and os.major(st.st_rdev) != _MEM_CHAR_MAJOR and not os.isatty(fd)
    )
    if backing == "cuda" and device_handle:
        return
    what = "a memfd or a CUDA device handle" if backing == "cuda" else "a memfd"
    raise PoolError(f"deposit of {name!r} refused: {link} is not {what}")


def _peer(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the connected process."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


class _PeerConnections:
    """Open connections per peer process, at most ``limit`` each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()

    def enter(self, pid: int) -> bool:
        with self._lock:
            if self._open[pid] >= self.limit:
                return False
            self._open[pid] += 1
            return True

    def leave(self, pid: int) -> None:
        with self._lock:
            self._open[pid] -= 1
            if self._open[pid] <= 0:
                del self._open[pid]


def _serve_connection(manager: StateManager, conn: socket.socket, peers: _PeerConnections) -> None:
    """Requests of one peer until it hangs up; a malformed one is answered, then the
    connection is closed. Nothing a peer sends ends more than its own connection."""
    try:
        with conn:
            pid, uid = _peer(conn)
            if uid != os.getuid():
                logger.warning("rejected a peer with a foreign uid")
                return
            if not peers.enter(pid):
                _send_error(
                    conn,
                    PoolError(
                        f"process {pid} already holds {peers.limit} connections to the "
                        "state manager; close some (one per process is enough)"
                    ),
                )
                return
            try:
                while _serve_request(manager, conn):
                    pass
            finally:
                peers.leave(pid)
    except Exception:  # a bug: cost this connection only, and say so once
        logger.exception("a connection failed; closed it")


def _serve_request(manager: StateManager, conn: socket.socket) -> bool:
    """Serve one request; False when the connection should end."""
    try:
        request, fds = protocol.recv(conn)
    except ProtocolError as e:
        _send_error(conn, e)
        return False
    except OSError:
        return False
    if request is None:
        return False
    keep = request.get("op") != "shutdown"
    try:
        reply, reply_fds = manager.handle(request, fds)
    except (LetoError, OSError) as e:
        reply, reply_fds = {"ok": False, "error": str(e)}, []
    except Exception as e:  # a request nobody foresaw: answer it, log it, close
        logger.exception("request %r failed; closed its connection", request.get("op"))
        reply, reply_fds, keep = (
            {"ok": False, "error": f"state manager error: {type(e).__name__}: {e}"},
            [],
            False,
        )
    try:
        protocol.send(conn, reply, reply_fds)
    except ProtocolError as e:  # (a reply too large to send)
        _send_error(conn, e)
        return False
    except OSError:
        return False
    finally:
        protocol.close_all(reply_fds)
    return keep


def _send_error(conn: socket.socket, error: Exception) -> None:
    try:
        protocol.send(conn, {"ok": False, "error": str(error)})
    except (OSError, LetoError):
        pass


def serve(
    socket_path: str,
    manager: StateManager | None = None,
    max_connections_per_peer: int = MAX_CONNECTIONS_PER_PEER,
) -> None:
    """Accept connections until SIGTERM/SIGINT or a ``shutdown`` request.

    A failing accept() (out of fds or memory, an aborted connection) is logged and
    retried, never the end: this loop's ``finally`` drops every region of the node.
    """
    manager = manager or StateManager()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    os.chmod(socket_path, 0o600)
    listener.listen(LISTEN_BACKLOG)
    stop = threading.Event()
    peers = _PeerConnections(max_connections_per_peer)

    def on_request_shutdown(request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        stop.set()
        return {"ok": True}, []

    manager._op_shutdown = on_request_shutdown  # type: ignore[attr-defined]
    listener.settimeout(0.2)
    print("ready", flush=True)
    failing: int | None = (
        None  # the errno accept() last failed with, logged once per run of failures
    )
    try:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as e:
                if e.errno != failing:
                    logger.warning("accept() failed (%s); retrying", os.strerror(e.errno or 0))
                    failing = e.errno
                if e.errno in _ACCEPT_RESOURCE_ERRORS:
                    time.sleep(ACCEPT_BACKOFF_S)
                continue
            if failing is not None:
                logger.warning("accepting connections again")
                failing = None
            _start_connection(manager, conn, peers)
    finally:
        listener.close()
        try:
            manager.close()
        finally:  # the socket and its directory go whatever closing the regions raised
            with contextlib.suppress(OSError):
                os.unlink(socket_path)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(socket_path))  # ours alone; also when the agent died


def _start_connection(manager: StateManager, conn: socket.socket, peers: _PeerConnections) -> None:
    try:
        conn.settimeout(None)
        threading.Thread(target=_serve_connection, args=(manager, conn, peers), daemon=True).start()
    except (OSError, RuntimeError, MemoryError) as e:  # RuntimeError: no thread can be started
        logger.warning("cannot serve a connection (%s); closed it", e)
        conn.close()
        time.sleep(ACCEPT_BACKOFF_S)


def _stop(*_: object) -> None:
    """SIGTERM: leave ``serve``'s loop once; a second signal must not cut its cleanup short."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m leto.pool.server", description="The node's state manager."
    )
    parser.add_argument("socket_path", metavar="SOCKET_PATH")
    parser.add_argument(
        "--max-connections-per-peer",
        type=int,
        default=MAX_CONNECTIONS_PER_PEER,
        help="connections one process may hold open (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.max_connections_per_peer < 1:
        parser.error("--max-connections-per-peer must be >= 1")
    # Die with the agent: an orphaned state manager would pin memory forever (also at once
    # when the agent died before this: re-parented, maybe to a subreaper, not to init).
    die_with_agent(signal.SIGTERM)
    pagemap.raise_nofile_limit()  # one fd per device chunk of every local rank
    logging.basicConfig(
        level=logging.WARNING, format="[leto state manager %(process)d] %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the agent, which stops us
    try:
        serve(args.socket_path, max_connections_per_peer=args.max_connections_per_peer)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
