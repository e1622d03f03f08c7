"""Wire protocol between trainers / agent and the state manager.

One request or reply per SOCK_SEQPACKET message: a UTF-8 JSON object, with file
descriptors attached as SCM_RIGHTS ancillary data. Message boundaries are kept by the
socket type, so there is no framing to get wrong. A message is at most
``MAX_MESSAGE_BYTES`` long and nests at most ``MAX_DEPTH`` containers deep; anything else
(truncated, not UTF-8, not JSON, not an object) is a ``ProtocolError`` whose received fds
are already closed. This module never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from dataclasses import dataclass
from typing import Any, Literal

from leto.errors import PoolError, ProtocolError
from leto.pool.pagemap import SCM_MAX_FD

MAX_MESSAGE_BYTES = 1 << 16
MAX_DEPTH = 8
"""Containers a message may nest (requests and replies use 3)."""
NAME_RE = re.compile(r"^[A-Za-z0-9_.:/-]{1,128}$")
DTYPES = frozenset(
    {"uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64"}
)
Tier = Literal["device", "host"]
TIERS: tuple[str, ...] = ("device", "host")


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """What a region is: the identity a reattach must match exactly."""

    rank: int
    name: str
    nbytes: int
    dtype: str
    tier: Tier

    def validate(self, max_region_bytes: int) -> None:
        if not isinstance(self.rank, int) or self.rank < 0:
            raise PoolError(f"rank must be a non-negative int, got {self.rank!r}")
        if not isinstance(self.name, str) or not NAME_RE.match(self.name):
            raise PoolError(f"region name {self.name!r} must match {NAME_RE.pattern}")
        if not isinstance(self.nbytes, int) or not 0 < self.nbytes <= max_region_bytes:
            raise PoolError(
                f"region {self.name!r}: size {self.nbytes!r} must be in (0, {max_region_bytes}] bytes"
            )
        if self.dtype not in DTYPES:
            raise PoolError(f"region {self.name!r}: dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if self.tier not in TIERS:
            raise PoolError(f"region {self.name!r}: tier {self.tier!r} not in {TIERS}")


def identity_digest(regions: dict[str, str]) -> str:
    """64-bit digest (16 hex digits) of a rank's regions and their identities."""
    text = "".join(f"{name}={ident}\n" for name, ident in sorted(regions.items()))
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def ident_parts(ident: str) -> tuple[str, int]:
    """(state manager instance, creation serial) of a region identity ``<instance>:<serial>``."""
    instance, _, serial = ident.partition(":")
    return instance, int(serial)


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    if fds and len(fds) > SCM_MAX_FD:
        raise ProtocolError(
            f"{len(fds)} fds in one message exceed SCM_MAX_FD={SCM_MAX_FD}: send them in batches"
        )
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def recv(sock: socket.socket, max_fds: int = SCM_MAX_FD) -> tuple[dict[str, Any] | None, list[int]]:
    """Receive one message; ``(None, [])`` when the peer closed the connection.

    A message whose fds did not all arrive (the kernel drops the excess when the receiver
    is at its ``RLIMIT_NOFILE``, and flags MSG_CTRUNC) is an error, never a short list.
    """
    data, fds, flags, _addr = socket.recv_fds(sock, MAX_MESSAGE_BYTES, max_fds)
    try:
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError(
                f"file descriptors of a message were dropped (MSG_CTRUNC, {len(fds)} arrived): "
                "this process is at its open-file limit; raise `ulimit -n`"
            )
        if flags & socket.MSG_TRUNC:
            raise ProtocolError(f"message exceeds {MAX_MESSAGE_BYTES} bytes")
        if not data:
            close_all(fds)
            return None, []
        return decode(data), fds
    except ProtocolError:
        close_all(fds)
        raise


def decode(data: bytes) -> dict[str, Any]:
    """One message's JSON object."""
    try:
        message = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProtocolError("malformed message from peer: not UTF-8") from None
    except RecursionError:
        raise ProtocolError(f"message nests deeper than {MAX_DEPTH} containers") from None
    except ValueError as e:
        raise ProtocolError(f"malformed message from peer: {e}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"message must be a JSON object, got {type(message).__name__}")
    if _depth(message) > MAX_DEPTH:
        raise ProtocolError(f"message nests deeper than {MAX_DEPTH} containers")
    return message


def _depth(value: Any) -> int:
    """Nesting depth of containers (iterative: a deep value must not recurse here either)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        children = (
            item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        )
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            return deepest
        todo.extend((child, depth + 1) for child in children)
    return deepest


def close_all(fds: list[int]) -> None:
    """Close received fds, ignoring ones already gone."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
