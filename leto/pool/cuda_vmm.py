"""CUDA virtual-memory allocations shared through POSIX file descriptors (device tier on GPU).

The first trainer of a rank creates each device region as per-chunk ``cuMemCreate``
allocations (handle type POSIX fd), exports one fd per chunk and deposits them with the
state manager, which only holds the fds: it never initialises CUDA, so it costs no
context and no HBM. An exported allocation stays alive while any process holds its fd or
maps it, so it survives the SIGKILL of the trainer that made it. A successor imports each
fd (``cuMemImportFromShareableHandle``), maps the chunks back to back in one reserved
address range and wraps it as a torch tensor through ``__cuda_array_interface__`` — zero
copies. The region logic (page table, lost chunks, replacement) is
``leto.pool.chunks.ChunkedRegion``; :class:`CudaChunks` is its GPU backend.

``available()`` is False on machines without a driver (``cuInit`` raises
``DynamicLibNotFoundError``): callers take the memfd path there.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Any

from leto.errors import PoolError

logger = logging.getLogger(__name__)


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
    prop.requestedHandleTypes = (
        cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    return prop


def granularity(device: int) -> int:
    cu = _driver()
    return int(
        _check(
            cu.cuMemGetAllocationGranularity(
                _prop(device), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
            "cuMemGetAllocationGranularity",
        )
    )


def round_up(nbytes: int, device: int) -> int:
    g = granularity(device)
    return (nbytes + g - 1) // g * g


def create(nbytes: int, device: int) -> int:
    """Create a physical allocation of ``nbytes`` (a granularity multiple); returns its fd."""
    cu = _driver()
    handle = _check(cu.cuMemCreate(nbytes, _prop(device), 0), "cuMemCreate")
    try:
        fd = _check(
            cu.cuMemExportToShareableHandle(
                handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
            ),
            "cuMemExportToShareableHandle",
        )
    finally:
        _check(cu.cuMemRelease(handle), "cuMemRelease")  # the fd keeps the memory alive
    return int(fd)


class CudaChunks:
    """GPU chunks for ``leto.pool.chunks.ChunkedRegion``: one ``cuMemCreate`` each.

    Every chunk is imported and mapped on its own (``cuMemMap`` takes offset 0 only, so a
    single allocation could not be unmapped page by page); the reservation spans them all.
    """

    backing = "cuda"

    def __init__(self, device: int) -> None:
        self.device = device
        self.granularity = granularity(device)

    def create(self, chunk_bytes: int) -> int:
        return create(chunk_bytes, self.device)

    def reserve(self, nbytes: int) -> int:
        return int(
            _check(
                _driver().cuMemAddressReserve(nbytes, self.granularity, 0, 0), "cuMemAddressReserve"
            )
        )

    def map(self, addr: int, fd: int, chunk_bytes: int) -> None:
        cu = _driver()
        handle = _check(
            cu.cuMemImportFromShareableHandle(
                fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            ),
            "cuMemImportFromShareableHandle",
        )
        try:
            _check(cu.cuMemMap(addr, chunk_bytes, 0, handle, 0), "cuMemMap")
        finally:
            _check(cu.cuMemRelease(handle), "cuMemRelease")  # the mapping holds it now

    def enable(self, addr: int, nbytes: int) -> None:
        cu = _driver()
        access = cu.CUmemAccessDesc()
        access.location = self._location()
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(addr, nbytes, [access], 1), "cuMemSetAccess")

    def unmap(self, addr: int, chunk_bytes: int) -> None:
        cu = _driver()
        (err,) = cu.cuMemUnmap(addr, chunk_bytes)
        if err != cu.CUresult.CUDA_SUCCESS:  # nothing mapped there any more: already gone
            logger.info("cuMemUnmap of a lost chunk at %#x: %s", addr, getattr(err, "name", err))

    def failed(self, addr: int, nbytes: int, chunk_bytes: int) -> list[int]:
        """Chunks whose mapping no longer answers: no allocation, or not read-write here."""
        cu = _driver()
        location, rw = self._location(), cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        lost = []
        for i in range(nbytes // chunk_bytes):
            err, flags = cu.cuMemGetAccess(location, addr + i * chunk_bytes)
            if err != cu.CUresult.CUDA_SUCCESS or int(flags) != int(rw):
                lost.append(i)
        return lost

    def _location(self) -> Any:
        cu = _driver()
        location = cu.CUmemLocation()
        location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        location.id = self.device
        return location


def _current_context(device: int) -> None:
    """Make ``device``'s primary context (the one the CUDA runtime, and so torch, uses)
    current on this thread if none is: the driver's calls need one, which the runtime's
    would have created on their own."""
    cu = _driver()
    if int(_check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")) != 0:
        return
    ctx = _check(
        cu.cuDevicePrimaryCtxRetain(_check(cu.cuDeviceGet(device), "cuDeviceGet")),
        "cuDevicePrimaryCtxRetain",
    )
    _check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def register_host(host_ptr: int, nbytes: int, device: int, *, mapped: bool = False) -> None:
    """Page-lock host memory (``cuMemHostRegister``; ``mapped``: portable and mapped for
    the device too), through the driver so that a failure leaves no error for the runtime's
    next check to find. A registration already at this address was made for memory this
    process has since unmapped (a released region at the same address: the driver still
    pins its old pages, and copies or a device view would reach those): it is dropped and
    the range registered again."""
    cu = _driver()
    _current_context(device)
    flags = 0x01 | 0x02 if mapped else 0  # CU_MEMHOSTREGISTER_PORTABLE | _DEVICEMAP
    (err,) = cu.cuMemHostRegister(host_ptr, nbytes, flags)
    if err == cu.CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
        _check(cu.cuMemHostUnregister(host_ptr), "cuMemHostUnregister")
        (err,) = cu.cuMemHostRegister(host_ptr, nbytes, flags)
    _check((err,), f"cuMemHostRegister of {nbytes} bytes")


def host_device_pointer(host_ptr: int) -> int:
    """The device address of page-locked, mapped host memory (``register_host(mapped=True)``)."""
    return int(
        _check(_driver().cuMemHostGetDevicePointer(host_ptr, 0), "cuMemHostGetDevicePointer")
    )


def array_interface(ptr: int, nbytes: int) -> Any:
    """An object torch.as_tensor wraps as ``nbytes`` uint8 of device memory at ``ptr``."""
    interface = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}
    return types.SimpleNamespace(__cuda_array_interface__=interface)
