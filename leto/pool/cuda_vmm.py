"""CUDA virtual-memory allocations shared through POSIX file descriptors (device tier on GPU).

The first trainer of a rank creates each device region with ``cuMemCreate`` (handle type
POSIX fd), exports the fd and deposits it with the state manager, which only holds the fd:
it never initialises CUDA, so it costs no context and no HBM. An exported allocation stays
alive while any process holds its fd, so it survives the SIGKILL of the trainer that made
it. A successor imports the fd (``cuMemImportFromShareableHandle``), reserves an address
range, maps it and wraps it as a torch tensor through ``__cuda_array_interface__`` — zero copies.

``available()`` is False on machines without a driver (``cuInit`` raises
``DynamicLibNotFoundError``): callers take the memfd path there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from leto.errors import PoolError


@functools.cache
def _driver() -> Any:
    from cuda.bindings import driver

    return driver


@functools.cache
def available() -> bool:
    """True when a CUDA driver and at least one device are present."""
    try:
        cu = _driver()
        (err,) = cu.cuInit(0)
        if err != cu.CUresult.CUDA_SUCCESS:
            return False
        err, count = cu.cuDeviceGetCount()
        return err == cu.CUresult.CUDA_SUCCESS and count > 0
    except Exception:  # noqa: BLE001 - ImportError, DynamicLibNotFoundError, ...
        return False


def _check(result: Any, what: str) -> Any:
    cu = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise PoolError(f"{what} failed: {err.name if hasattr(err, 'name') else err}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def _prop(device: int) -> Any:
    cu = _driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def granularity(device: int) -> int:
    cu = _driver()
    return int(_check(
        cu.cuMemGetAllocationGranularity(_prop(device), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity",
    ))


def round_up(nbytes: int, device: int) -> int:
    g = granularity(device)
    return (nbytes + g - 1) // g * g


def create(nbytes: int, device: int) -> int:
    """Create a physical allocation of ``nbytes`` (a granularity multiple); returns its fd."""
    cu = _driver()
    handle = _check(cu.cuMemCreate(nbytes, _prop(device), 0), "cuMemCreate")
    try:
        fd = _check(
            cu.cuMemExportToShareableHandle(handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle",
        )
    finally:
        _check(cu.cuMemRelease(handle), "cuMemRelease")  # the fd keeps the memory alive
    return int(fd)


@dataclass(slots=True)
class Mapping:
    """A device region mapped into this process at ``ptr`` ."""

    ptr: int
    nbytes: int
    page_bytes: int
    device: int

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}


def map_fd(fd: int, nbytes: int, device: int, page_bytes: int | None = None) -> Mapping:
    """Import an exported allocation and map it read-write on ``device``."""
    cu = _driver()
    page = page_bytes or granularity(device)
    if nbytes % page:
        raise PoolError(f"device region of {nbytes} bytes is not a multiple of the {page}-byte page")
    handle = _check(
        cu.cuMemImportFromShareableHandle(fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        "cuMemImportFromShareableHandle",
    )
    try:
        ptr = int(_check(cu.cuMemAddressReserve(nbytes, page, 0, 0), "cuMemAddressReserve"))
        # cuMemMap takes offset 0 only (NOT_SUPPORTED otherwise, seen on CUDA 13): one
        # mapping per allocation. Per-page localisation will need per-page allocations.
        _check(cu.cuMemMap(ptr, nbytes, 0, handle, 0), "cuMemMap")
    finally:
        _check(cu.cuMemRelease(handle), "cuMemRelease")  # the mappings hold it now
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _check(cu.cuMemSetAccess(ptr, nbytes, [access], 1), "cuMemSetAccess")
    return Mapping(ptr=ptr, nbytes=nbytes, page_bytes=page, device=device)
