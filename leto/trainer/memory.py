"""Retained regions of one rank as torch tensors: device tier on the model's device.

Device regions are per-chunk physical allocations mapped back to back
(``leto.pool.chunks.ChunkedRegion``): CUDA VMM chunks on GPU (``leto.pool.cuda_vmm``),
memfd chunks on CPU (and machines without a CUDA driver), created by the first trainer,
deposited with the state manager and mapped by successors; a lost chunk is found and
replaced on its own. Host regions are memfds the state manager allocates, wrapped with
``torch.frombuffer`` (zero copy) and, on GPU, page-locked (``cuda_vmm.register_host``) so
device-to-host copies run at full speed.

Every region carries the identity the state manager gave it when it was made; the
rank's marker records them when its state is initialised, and :meth:`RegionMemory.check_identity`
compares them with the state manager's before a successor resumes (a region freed,
re-created or replaced since is an ``UnrecoverableStateError``, never fresh zeros).
"""

from __future__ import annotations

import ctypes
import hashlib
import os

import torch

from leto.errors import PoolError
from leto.events import EventLog, Kind
from leto.pool import cuda_vmm, pagemap, protocol
from leto.pool.chunks import ChunkBackend, ChunkedRegion, MemfdChunks
from leto.pool.client import PoolClient, RankIdentities
from leto.pool.cuda_vmm import CudaChunks
from leto.retained.marker import IdentityRecord, Marker, RegionIdentityError

_DIGEST_CHUNK = 1 << 26  # int64 words per chunk of the on-device digest

ENV_MAPPED_MARKER = "LETO_MAPPED_MARKER"
"""Test hook: "1" gives host regions a "device view" on CPU too (a second tensor over the
same memory), so the marker takes its GPU write path without a GPU: the writer reads its
own host copy, and a shadow that mapped the marker ahead holds a copy that goes stale."""


class RegionMemory:
    """Allocates or reattaches this rank's regions and keeps their mappings alive."""

    def __init__(self, pool: PoolClient, rank: int, device: torch.device) -> None:
        self.pool, self.rank, self.device = pool, rank, device
        self.cuda = device.type == "cuda"
        if self.cuda and not cuda_vmm.available():
            raise PoolError("the model is on CUDA but the CUDA driver API is unavailable")
        pagemap.raise_nofile_limit()  # fd batches of up to SCM_MAX_FD chunks arrive at once
        self.backend: ChunkBackend = CudaChunks(device.index or 0) if self.cuda else MemfdChunks()
        self._keep: list[object] = []
        self._chunked: dict[str, tuple[ChunkedRegion, torch.Tensor]] = {}

    @property
    def regions(self) -> set[str]:
        """Names of the device regions mapped so far."""
        return set(self._chunked)

    @property
    def granularity(self) -> int:
        """Bytes a device chunk must be a multiple of (VMM granularity, or the OS page)."""
        return self.backend.granularity

    def chunk_budget(self) -> int:
        """Device chunks this rank may deposit: its share of the state manager's fd limit."""
        return pagemap.fd_budget(
            int(self.pool.stats()["fd_limit"]), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        )

    def device_region(
        self, name: str, nbytes: int, chunk_bytes: int | None = None
    ) -> tuple[torch.Tensor, bool]:
        """(uint8 tensor on the model's device, True when it was already retained).

        The region is ``chunk_bytes`` physical chunks (default: one chunk for the whole
        region) that :meth:`lost_pages` can find lost and replace one by one.
        """
        chunk = chunk_bytes or -(-nbytes // self.granularity) * self.granularity
        region = ChunkedRegion.attach(self.backend, self.pool, self.rank, name, nbytes, chunk)
        if self.cuda:
            tensor = torch.as_tensor(
                cuda_vmm.array_interface(region.ptr, region.nbytes), device=self.device
            )
            if not region.existing:
                tensor.zero_()  # cuMemCreate memory is uninitialised; padding must digest the same
        else:
            tensor = torch.frombuffer(
                (ctypes.c_ubyte * region.nbytes).from_address(region.ptr), dtype=torch.uint8
            )
        self._chunked[name] = (region, tensor)
        return tensor[:nbytes], region.existing  # the allocation is rounded up to whole chunks

    def device_bytes(self) -> int:
        """Bytes of every device region mapped (whole chunks)."""
        return sum(region.nbytes for region, _ in self._chunked.values())

    def lost_chunks(self, name: str) -> list[int]:
        """Chunks of device region ``name`` that were lost, now fresh and zeroed."""
        region, tensor = self._chunked[name]
        self.fence()  # no kernel may run on a chunk while it is swapped
        chunks = region.localize()
        if self.cuda:
            for c in chunks:
                tensor[c * region.table.chunk_bytes : (c + 1) * region.table.chunk_bytes].zero_()
        return chunks

    def commit_replacements(self, names: set[str] | None = None) -> None:
        """Hand the state manager the fresh chunks that replaced lost ones (of ``names``,
        default every region): call once their contents are rebuilt (``ChunkedRegion.commit``)."""
        self.fence()
        for name, (region, _) in self._chunked.items():
            if names is None or name in names:
                region.commit()

    def lost_pages(self, name: str, page_bytes: int) -> list[int]:
        """Pages of device region ``name`` that were lost, now on fresh zeroed chunks."""
        return self._chunked[name][0].table.pages_of(self.lost_chunks(name), page_bytes)

    def host_region(self, name: str, nbytes: int) -> tuple[torch.Tensor, bool]:
        """(uint8 CPU tensor over a memfd the state manager allocates, True when retained)."""
        region = self.pool.alloc(self.rank, name, nbytes, "uint8", "host")
        self._keep.append(region)
        tensor = torch.frombuffer(region.buffer, dtype=torch.uint8)
        if self.cuda and nbytes >= 1 << 20:
            cuda_vmm.register_host(tensor.data_ptr(), nbytes, self.device.index or 0)
        return tensor, region.existing

    def mapped_on_device(self, host: torch.Tensor) -> torch.Tensor | None:
        """``host`` (a host region, page-aligned) as a CUDA tensor over the same memory, so
        kernels write it in stream order (the marker); None on CPU (unless
        ``LETO_MAPPED_MARKER=1``: then a second CPU view of the same memory).

        The region is page-locked and mapped (``cuda_vmm.register_host``) and addressed
        through ``cuMemHostGetDevicePointer``: device stores travel over PCIe into the memfd
        pages the state manager keeps, visible to a successor once this process is gone.
        """
        if not self.cuda:
            return host[:] if os.environ.get(ENV_MAPPED_MARKER) == "1" else None
        cuda_vmm.register_host(host.data_ptr(), host.numel(), self.device.index or 0, mapped=True)
        ptr = cuda_vmm.host_device_pointer(host.data_ptr())
        return torch.as_tensor(cuda_vmm.array_interface(ptr, host.numel()), device=self.device)

    def fence(self) -> None:
        """Wait for queued device work: a marker written after it then tells the truth."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    # -- identity ----------------------------------------------------------------------------
    def identity_record(self) -> IdentityRecord:
        """The identities of every region of this rank, as the marker keeps them."""
        return _record(self.pool.identities(self.rank))

    def seal(self, record: IdentityRecord) -> None:
        """Tell the state manager this rank's state is initialised (after the marker landed):
        a successor that finds the seal but no marker knows the marker region was lost."""
        self.fence()
        self.pool.seal(self.rank, f"{record.digest:016x}")

    def check_identity(self, marker: Marker, reattached: bool, events: EventLog) -> None:
        """Refuse retained state whose regions are not the ones it was initialised over.

        ``reattached``: the marker is valid. Then every region this process mapped must
        still be held, unchanged, and the rank's regions must match the marker's record (none
        made since). Otherwise no seal may exist (the marker itself was lost). A mismatch is
        an ``unrecoverable_state`` event naming the region and a ``RegionIdentityError``.
        """
        now = self.pool.identities(self.rank)
        if reattached:
            problem = identity_problem(marker.identity(), now, self.pool.seen(self.rank))
        elif now.sealed is not None:
            problem = (
                "marker",
                "was lost, though the rank's state was initialised (the state manager holds its seal)",
            )
        else:
            return
        if problem is not None:
            region, what = problem
            error = (
                f"rank {self.rank}: retained region {region!r} {what}; refusing to resume on it "
                "(restart the job from a checkpoint)"
            )
            events.emit(Kind.UNRECOVERABLE, rank=self.rank, region=region, error=error)
            raise RegionIdentityError(region, error)

    def digest(self, region: torch.Tensor) -> str:
        """A digest of a region's bytes (blake2b on CPU; two wrapping int64 sums on GPU)."""
        if not region.is_cuda:
            return hashlib.blake2b(region.numpy().tobytes(), digest_size=16).hexdigest()
        words = region[: region.numel() // 8 * 8].view(torch.int64)
        plain = torch.zeros((), dtype=torch.int64, device=region.device)
        weighted = torch.zeros((), dtype=torch.int64, device=region.device)
        for start in range(0, words.numel(), _DIGEST_CHUNK):
            chunk = words[start : start + _DIGEST_CHUNK]
            weights = (
                torch.arange(start, start + chunk.numel(), device=region.device, dtype=torch.int64)
                * 2
                + 1
            )
            plain += chunk.sum()
            weighted += (chunk * weights).sum()
        return f"{int(plain) & (2**64 - 1):016x}{int(weighted) & (2**64 - 1):016x}"


def _record(ids: RankIdentities) -> IdentityRecord:
    serials = [protocol.ident_parts(ident)[1] for ident in ids.regions.values()]
    return IdentityRecord(int(ids.digest(), 16), int(ids.instance, 16), max(serials, default=0))


def identity_problem(
    record: IdentityRecord, now: RankIdentities, seen: dict[str, str]
) -> tuple[str, str] | None:
    """(region, what is wrong) when the regions of a rank are not those its state was
    initialised over (``record``), judged from the state manager's view ``now`` and the
    identities this process received when it mapped them (``seen``); None when they are."""
    for name, ident in sorted(seen.items()):
        if name not in now.regions:
            return name, "is no longer held by the state manager (freed or lost)"
        if now.regions[name] != ident:
            return name, "was replaced after this process mapped it"
    if int(now.instance, 16) != record.instance:
        return min(
            now.regions, default="marker"
        ), "was made by another state manager (it was restarted)"
    for name, ident in sorted(now.regions.items()):
        if protocol.ident_parts(ident)[1] > record.last_serial:
            return (
                name,
                "was made after the rank's state was initialised (it holds none of that state)",
            )
    if int(now.digest(), 16) != record.digest:
        return "regions", "differ from the marker's record of them (one was freed)"
    if now.sealed is not None and now.sealed != f"{record.digest:016x}":
        return "marker", "does not carry the identity the state manager sealed"
    return None
