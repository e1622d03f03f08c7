"""The state manager: owns every retained region of this node's ranks.

Run as ``python -m leto.pool.server SOCKET_PATH``. It allocates named, sized regions
(memfd on CPU; the device tier becomes CUDA VMM on GPU), keeps them open for the life of
the job and hands them to trainers as file descriptors over a Unix socket. A trainer's
death therefore loses nothing: its successor reattaches by name. The server never maps
or reads the regions it owns (it must not touch potentially faulty pages) and never
imports torch, so it starts in milliseconds and stays small.

Security: the socket lives in a 0700 directory made by the agent, and every peer's uid
(SO_PEERCRED) must equal ours.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import signal
import socket
import struct
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Any

from leto.errors import LetoError, PoolError
from leto.pool import localize, pagemap, protocol
from leto.pool.protocol import RegionSpec

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
DEFAULT_MAX_REGION_BYTES = 1 << 40


@dataclass(slots=True)
class _Region:
    spec: RegionSpec
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
            raise PoolError(f"region {self.spec.name!r} is {self.backing} memory: the trainer localises it")
        if self.addr is None:
            self.addr = localize.map_memfd(self.fd, self.spec.nbytes)
        return self.addr

    def drop(self, chunks: list[int]) -> None:
        """Close these chunks' fds: once no process maps them, their memory is gone."""
        for i in chunks:
            fd, self.fds[i] = self.fds[i], None
            if fd is not None:
                os.close(fd)

    def close(self) -> None:
        if self.addr is not None:
            localize.unmap(self.addr, self.spec.nbytes)
            self.addr = None
        self.drop(list(range(len(self.fds))))


class StateManager:
    """Region table plus the request handlers; transport-independent for unit tests."""

    def __init__(self, max_region_bytes: int = DEFAULT_MAX_REGION_BYTES) -> None:
        self._max_region_bytes = max_region_bytes
        self._regions: dict[tuple[int, str], _Region] = {}
        self._lock = threading.Lock()

    def handle(self, request: dict[str, Any], fds: list[int] | None = None) -> tuple[dict[str, Any], list[int]]:
        """Serve one request; returns the reply and the fds to attach to it.

        Only ``deposit`` takes fds from the peer; any other fd sent is closed.
        """
        fds = list(fds or [])
        op = request.get("op")
        handler = getattr(self, f"_op_{op}", None) if isinstance(op, str) else None
        try:
            if handler is None:
                raise PoolError(f"unknown request op {op!r}")
            with self._lock:
                if op == "deposit":
                    return handler(request, fds)
                return handler(request)
        finally:
            for fd in fds:
                os.close(fd)

    def _op_deposit(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """Retain chunks of a device region a trainer made (CUDA VMM or memfd, one fd each).

        ``start`` is the first chunk index the attached fds fill (at most SCM_MAX_FD per
        message). The first deposit creates the region with every slot empty; later ones
        fill empty slots (the rest of a region, or fresh chunks replacing lost ones), or,
        with ``replace``, slots whose chunk the trainer found failed.
        """
        spec = self._spec(request)
        chunk_bytes, start, backing = request.get("chunk_bytes"), request.get("start", 0), request.get("backing")
        if backing not in ("cuda", "memfd-chunks"):
            raise PoolError(f"deposit of {spec.name!r}: backing {backing!r} is not cuda or memfd-chunks")
        try:
            table = pagemap.PageTable(spec.nbytes, chunk_bytes)
        except (TypeError, ValueError) as e:
            raise PoolError(f"deposit of {spec.name!r}: {e}") from None
        if not fds or not isinstance(start, int) or not 0 <= start <= table.num_chunks - len(fds):
            raise PoolError(f"deposit of {spec.name!r}: {len(fds)} fds from chunk {start!r} do not fit "
                            f"its {table.num_chunks} chunks")
        key = (spec.rank, spec.name)
        region = self._regions.get(key)
        if region is None:
            region = self._regions[key] = _Region(spec, [None] * table.num_chunks, chunk_bytes, backing=backing)
        elif (region.spec, region.chunk_bytes, region.backing) != (spec, chunk_bytes, backing):
            raise PoolError(f"deposit does not match rank {spec.rank} region {spec.name!r}: retained "
                            f"{region.spec.nbytes} B in {region.chunk_bytes}-byte {region.backing} chunks")
        slots = range(start, start + len(fds))
        if not request.get("replace") and any(region.fds[i] is not None for i in slots):
            raise PoolError(f"rank {spec.rank} region {spec.name!r}: chunks {start}..{slots[-1]} are already retained")
        region.drop(list(slots))
        for i in slots:
            region.fds[i] = fds.pop(0)
        return {"ok": True}, []

    def _deposited(self, request: dict[str, Any]) -> _Region | None:
        region = self._regions.get((request.get("rank"), request.get("name")))
        if region is not None and not region.deposited:
            raise PoolError(f"region {region.spec.name!r} was allocated here (memfd): use lookup, not fetch")
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
        if not isinstance(start, int) or not 0 <= start < len(region.fds):
            raise PoolError(f"fetch of {region.spec.name!r}: start {start!r} outside its {len(region.fds)} chunks")
        window = range(start, min(len(region.fds), start + pagemap.SCM_MAX_FD))
        indices = [i for i in window if region.fds[i] is not None]
        reply = {"ok": True, "found": True, "spec": asdict(region.spec), "backing": region.backing,
                 "chunk_bytes": region.chunk_bytes, "indices": indices, "end": window.stop}
        return reply, [region.fds[i] for i in indices]  # type: ignore[misc]

    def _op_pagemap(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """The lost (empty) chunk slots of a deposited region, as (first, count) runs."""
        region = self._deposited(request)
        if region is None:
            raise PoolError(f"rank {request.get('rank')} has no deposited region {request.get('name')!r}")
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
        spec.validate(self._max_region_bytes)
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
            return {"ok": True, "existing": True}, [region.fd]
        fd = os.memfd_create(f"leto:r{spec.rank}:{spec.name}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, spec.nbytes)
        except OSError:
            os.close(fd)
            raise
        self._regions[key] = _Region(spec, [fd], spec.nbytes)
        return {"ok": True, "existing": False}, [fd]

    def _op_lookup(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        region = self._regions.get((request.get("rank"), request.get("name")))
        if region is None:
            return {"ok": True, "found": False}, []
        return {"ok": True, "found": True, "spec": asdict(region.spec)}, [region.fd]

    def _op_describe(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        region = self._regions.get((request.get("rank"), request.get("name")))
        return {"ok": True, "spec": None if region is None else asdict(region.spec)}, []

    def _op_free(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        region = self._regions.pop((request.get("rank"), request.get("name")), None)
        if region is not None:
            region.close()
        return {"ok": True, "freed": region is not None}, []

    def _op_reset(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        """Drop every region (a group restart begins from a checkpoint, never stale state)."""
        count = len(self._regions)
        self.close()
        return {"ok": True, "freed": count}, []

    def _op_stats(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        by_tier = {tier: 0 for tier in protocol.TIERS}
        for region in self._regions.values():
            by_tier[region.spec.tier] += region.spec.nbytes
        fds = sum(fd is not None for region in self._regions.values() for fd in region.fds)
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return {"ok": True, "regions": len(self._regions), "bytes": by_tier, "fds": fds, "fd_limit": fd_limit}, []

    def _paged_region(self, request: dict[str, Any]) -> tuple[_Region, int]:
        region = self._regions.get((request.get("rank"), request.get("name")))
        if region is None:
            raise PoolError(f"rank {request.get('rank')} has no region {request.get('name')!r}")
        page_bytes = request.get("page_bytes")
        if not isinstance(page_bytes, int) or page_bytes <= 0 or region.spec.nbytes % page_bytes:
            raise PoolError(f"page_bytes {page_bytes!r} does not divide region {region.spec.name!r}")
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
        if not isinstance(pages, list) or not all(isinstance(p, int) and 0 <= p < total for p in pages):
            raise PoolError(f"erase: pages must be indices below {total}")
        if region.deposited:
            try:
                chunks = region.table.chunks_of(pages, page_bytes)
            except ValueError as e:
                raise PoolError(f"erase: {e}") from None
            region.drop(chunks)
            return {"ok": True, "pages": region.table.pages_of(chunks, page_bytes)}, []
        addr = region.mapping()
        for p in pages:
            localize.punch_hole(region.fd, p * page_bytes, page_bytes)
        localize.make_inaccessible(addr, page_bytes, pages)
        return {"ok": True, "pages": sorted(set(pages))}, []

    def close(self) -> None:
        for region in self._regions.values():
            region.close()
        self._regions.clear()


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _serve_connection(manager: StateManager, conn: socket.socket) -> None:
    with conn:
        if _peer_uid(conn) != os.getuid():
            logger.warning("rejected a peer with a foreign uid")
            return
        while True:
            try:
                request, fds = protocol.recv(conn)
            except (OSError, LetoError):
                return
            if request is None:
                return
            try:
                reply, reply_fds = manager.handle(request, fds)
            except (LetoError, OSError) as e:
                reply, reply_fds = {"ok": False, "error": str(e)}, []
            try:
                protocol.send(conn, reply, reply_fds)
            except OSError:
                return
            if request.get("op") == "shutdown":
                return


def serve(socket_path: str, manager: StateManager | None = None) -> None:
    """Accept connections until SIGTERM/SIGINT or a ``shutdown`` request."""
    manager = manager or StateManager()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    os.chmod(socket_path, 0o600)
    listener.listen(64)
    stop = threading.Event()

    def on_request_shutdown(request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        stop.set()
        return {"ok": True}, []

    manager._op_shutdown = on_request_shutdown  # type: ignore[attr-defined]
    listener.settimeout(0.2)
    print("ready", flush=True)
    try:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            threading.Thread(target=_serve_connection, args=(manager, conn), daemon=True).start()
    finally:
        listener.close()
        manager.close()
        try:
            os.unlink(socket_path)
            os.rmdir(os.path.dirname(socket_path))  # ours alone; also when the agent died
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m leto.pool.server SOCKET_PATH", file=sys.stderr)
        return 2
    # Die with the agent: an orphaned state manager would pin memory forever.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    pagemap.raise_nofile_limit()  # one fd per device chunk of every local rank
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the agent, which stops us
    try:
        serve(argv[0])
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
