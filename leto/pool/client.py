"""Client side of the state manager: connect, allocate or reattach, map.

Used by trainers (and by the agent for control requests). No torch here either: a
region is returned as an ``mmap``; the trainer wraps it with ``torch.frombuffer``,
which is zero-copy.
"""

from __future__ import annotations

import mmap
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from leto.errors import PoolError, ProtocolError
from leto.pool import pagemap, protocol
from leto.pool.protocol import RegionSpec, Tier


@dataclass(frozen=True, slots=True)
class RankIdentities:
    """The state manager's view of one rank: every region's identity, and the rank's seal."""

    instance: str
    """The state manager instance (random per process: a restarted one holds nothing old)."""
    regions: dict[str, str]
    """Region name -> identity ``<instance>:<serial>``."""
    sealed: str | None
    """The identity digest recorded when the rank's state was initialised (None: never)."""

    def digest(self) -> str:
        return protocol.identity_digest(self.regions)


@dataclass(slots=True)
class MappedRegion:
    """A retained region mapped into this process."""

    spec: RegionSpec
    existing: bool
    """True when the region was already retained (a reattach after a failure)."""
    buffer: mmap.mmap

    def close(self) -> None:
        self.buffer.close()


@dataclass(slots=True)
class FetchedRegion:
    """A deposited device region as the state manager holds it: one fd per chunk."""

    spec: RegionSpec
    backing: str
    chunk_bytes: int
    fds: list[int | None]
    """None where the chunk is lost."""

    @property
    def lost(self) -> list[int]:
        return [i for i, fd in enumerate(self.fds) if fd is None]

    def close(self) -> None:
        for i, fd in enumerate(self.fds):
            if fd is not None:
                os.close(fd)
                self.fds[i] = None


class PoolClient:
    """One connection to this node's state manager."""

    def __init__(self, socket_path: str, timeout_s: float = 30.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(socket_path)
        except OSError as e:
            self._sock.close()
            raise PoolError(f"cannot reach the state manager at {socket_path}: {e}") from None
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, str], str] = {}
        """(rank, name) -> the identity of the region as this client last received it."""

    def seen(self, rank: int) -> dict[str, str]:
        """Identities of ``rank``'s regions as this client allocated, looked up, fetched or
        deposited them (what this process maps, unless a region changed since)."""
        return {name: ident for (r, name), ident in self._seen.items() if r == rank}

    def _saw(self, rank: int, name: str, reply: dict[str, Any]) -> None:
        ident = reply.get("ident")
        if not isinstance(ident, str):
            raise ProtocolError(
                f"the state manager's reply for region {name!r} carries no identity"
            )
        self._seen[(rank, name)] = ident

    def request(
        self, message: dict[str, Any], fds: list[int] | None = None
    ) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            try:
                protocol.send(self._sock, message, fds)
                reply, fds = protocol.recv(self._sock)
            except OSError as e:
                raise PoolError(f"state manager connection failed: {e}") from None
        if reply is None:
            raise PoolError("the state manager closed the connection (is it still alive?)")
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise PoolError(str(reply.get("error", "request refused")))
        return reply, fds

    def alloc(self, rank: int, name: str, nbytes: int, dtype: str, tier: Tier) -> MappedRegion:
        """Allocate (first trainer) or reattach to (successor) the region ``name`` of ``rank``."""
        spec = RegionSpec(rank=rank, name=name, nbytes=nbytes, dtype=dtype, tier=tier)
        reply, fds = self.request({"op": "alloc", **_asdict(spec)})
        self._saw(rank, name, reply)
        return MappedRegion(spec=spec, existing=bool(reply["existing"]), buffer=_map(fds, nbytes))

    def lookup(self, rank: int, name: str) -> MappedRegion | None:
        """Map an existing region, or return None when nothing of that name is retained."""
        reply, fds = self.request({"op": "lookup", "rank": rank, "name": name})
        if not reply["found"]:
            return None
        self._saw(rank, name, reply)
        spec = RegionSpec(**reply["spec"])
        return MappedRegion(spec=spec, existing=True, buffer=_map(fds, spec.nbytes))

    def deposit(
        self,
        rank: int,
        name: str,
        nbytes: int,
        chunk_bytes: int,
        backing: str,
        fds: list[int],
        start: int = 0,
        replace: bool = False,
    ) -> None:
        """Hand chunks ``start ..`` of a device region (one fd each) to the state manager.

        Sent in batches of at most SCM_MAX_FD fds; the caller keeps (and closes) its fds.
        """
        spec = RegionSpec(rank=rank, name=name, nbytes=nbytes, dtype="uint8", tier="device")
        for offset, batch in pagemap.batches(fds):
            reply, _ = self.request(
                {
                    "op": "deposit",
                    **_asdict(spec),
                    "chunk_bytes": chunk_bytes,
                    "backing": backing,
                    "start": start + offset,
                    "replace": replace,
                },
                list(batch),
            )
            self._saw(rank, name, reply)

    def fetch(self, rank: int, name: str) -> FetchedRegion | None:
        """A deposited region's chunk fds, without mapping them; the caller owns the fds.

        One request per window of SCM_MAX_FD chunks; a chunk with no fd is lost.
        """
        found: FetchedRegion | None = None
        start, ident = 0, None
        while found is None or start < len(found.fds):
            reply, fds = self.request({"op": "fetch", "rank": rank, "name": name, "start": start})
            if found is None:
                if not reply["found"]:
                    return None  # (a reply without the region carries no fds)
                self._saw(rank, name, reply)
                ident = reply["ident"]
                spec = RegionSpec(**reply["spec"])
                chunk_bytes = int(reply["chunk_bytes"])
                found = FetchedRegion(
                    spec, str(reply["backing"]), chunk_bytes, [None] * (spec.nbytes // chunk_bytes)
                )
            if (
                not reply["found"]
                or reply.get("ident") != ident
                or len(fds) != len(reply["indices"])
            ):
                for fd in fds:
                    os.close(fd)
                found.close()
                raise ProtocolError(
                    f"fetch of {name!r} from chunk {start}: the region changed or fds went missing"
                )
            for i, fd in zip(reply["indices"], fds, strict=True):
                found.fds[i] = fd
            start = int(reply["end"])
        return found

    def pagemap(self, rank: int, name: str) -> list[int]:
        """Chunks of a deposited region whose fd the state manager no longer holds (lost)."""
        return pagemap.from_runs(
            self.request({"op": "pagemap", "rank": rank, "name": name})[0]["lost"]
        )

    def describe(self, rank: int, name: str) -> RegionSpec | None:
        spec = self.request({"op": "describe", "rank": rank, "name": name})[0]["spec"]
        return None if spec is None else RegionSpec(**spec)

    def localize(self, rank: int, name: str, page_bytes: int) -> list[int]:
        """Failed pages of a region, found and remapped (zeroed) by the state manager."""
        reply, _ = self.request(
            {"op": "localize", "rank": rank, "name": name, "page_bytes": page_bytes}
        )
        return [int(p) for p in reply["pages"]]

    def erase(self, rank: int, name: str, page_bytes: int, pages: list[int]) -> list[int]:
        """Fault injection: lose these pages of a region (see the state manager); returns the
        pages lost, which for a chunked region are all pages of the chunks that held them."""
        reply, _ = self.request(
            {"op": "erase", "rank": rank, "name": name, "page_bytes": page_bytes, "pages": pages}
        )
        return [int(p) for p in reply["pages"]]

    def free(self, rank: int, name: str) -> bool:
        """Drop a region (its memory is gone once no process maps it); False when none was held."""
        self._seen.pop((rank, name), None)
        return bool(self.request({"op": "free", "rank": rank, "name": name})[0]["freed"])

    def identities(self, rank: int) -> RankIdentities:
        """Every region of ``rank`` the state manager holds, with its identity, and the seal."""
        reply = self.request({"op": "identities", "rank": rank})[0]
        return RankIdentities(
            str(reply["instance"]),
            {str(k): str(v) for k, v in reply["regions"].items()},
            None if reply["sealed"] is None else str(reply["sealed"]),
        )

    def seal(self, rank: int, digest: str) -> None:
        """Record that ``rank``'s state was initialised over regions of this identity digest."""
        self.request({"op": "seal", "rank": rank, "digest": digest})

    def stats(self) -> dict[str, Any]:
        return self.request({"op": "stats"})[0]

    def reset(self) -> int:
        return int(self.request({"op": "reset"})[0]["freed"])

    def shutdown(self) -> None:
        self.request({"op": "shutdown"})

    def close(self) -> None:
        self._sock.close()


def _asdict(spec: RegionSpec) -> dict[str, Any]:
    return {f: getattr(spec, f) for f in spec.__slots__}


def _map(fds: list[int], nbytes: int) -> mmap.mmap:
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"expected one region fd, got {len(fds)}")
    try:
        return mmap.mmap(fds[0], nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fds[0])  # the mapping keeps the memory; the state manager keeps the region
