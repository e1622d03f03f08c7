"""Lend the RMU's undo buffer to the compute phase's activations (paper §5.3, "Minimizing
memory and transfer overhead").

The undo buffer is needed only between ``GRADS_READY`` and ``IDLE``; activations only
between the start of a step and the end of backward. So, as the paper does with Megatron,
the compute phase allocates from a ``torch.cuda.MemPool`` whose allocator (a
``CUDAPluggableAllocator``, ``lend.c``, compiled once per source with the system C
compiler) places large requests first-fit inside the undo region and takes the rest from
``cuMemAlloc``. The caching allocator keeps those segments cached in the pool between
steps; the update then writes its undo copies over blocks the allocator holds *free*.

What makes that safe:

* every allocation of the compute phase, from every thread (the autograd engine's device
  threads included), goes to the pool (``torch._C._cuda_beginAllocateToPool``, the
  all-threads form of ``torch.cuda.use_mem_pool``); nothing outside the compute phase does;
* :meth:`ActivationLender.check_returned` walks the pool's segments inside the arena and
  raises ``ProtocolError`` if a block there is still live: a tensor made in the compute
  phase and kept past it (only requests of more than 2 MiB go to the arena, so a returned
  loss never lands there). ``RetainedState.step`` calls it once the update is queued, while
  the device runs it (host time only: where the host sets a step's pace it counts, hence
  the lookup of live segments only); such a tensor may then hold undo bytes, but it is the
  script's, never retained state, and the step ends with the error;
* the undo region is pool memory: a trainer killed mid-update leaves it to its successor,
  which finishes the update before its own compute phase lends it again.

The working parity (``rmu.parity``) is not lent: its copy to host overlaps the next step's
compute on the copy stream (``ResumableUpdater.join``), and activations over it would
corrupt the host parity.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch

from leto.errors import LetoError, ProtocolError

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("lend.c")
MIN_LENT_BYTES = (2 << 20) + 1
"""Smallest request placed in the arena: above the caching allocator's 2 MiB small-block
segments, so small tensors (a loss, a norm) never sit in lent memory."""
ENV_CACHE_DIR = "LETO_CACHE_DIR"


def cache_dir() -> Path:
    """Where compiled helpers go (``$LETO_CACHE_DIR``, else ``~/.cache/leto``)."""
    return Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "leto")


@functools.cache
def library_path() -> Path:
    """``lend.c`` compiled to a shared object, once per source (keyed by its hash)."""
    source = SOURCE.read_bytes()
    out = cache_dir() / f"lend-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise LetoError(
            "leto.lend_activation_memory needs a C compiler (cc, gcc or clang) to build its "
            "allocator; install one or set lend_activation_memory: false"
        )
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), "-ldl", "-lpthread"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode:
            raise LetoError(
                f"compiling {SOURCE.name} with {cc} failed: {proc.stderr.strip().splitlines()[-1:]}"
            )
        os.replace(tmp, out)  # atomic: ranks compiling at once each install a whole file
    except OSError as e:  # an unwritable cache directory, a compiler that cannot run
        raise LetoError(
            f"building the lending allocator in {out.parent} failed ({e}); set {ENV_CACHE_DIR} "
            "to a writable directory"
        ) from None
    return out


class Arena:
    """The shared object's arena bookkeeping (one per process: the library is loaded once)."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        self.lib.leto_lend_add.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.lib.leto_lend_set_min_bytes.argtypes = [ctypes.c_size_t]
        self.lib.leto_lend_lent_bytes.restype = ctypes.c_size_t
        self.lib.leto_lend_fallback_bytes.restype = ctypes.c_size_t
        self.lib.leto_lend_segment.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
        ]
        self.lib.leto_lend_alloc.restype = ctypes.c_void_p
        self.lib.leto_lend_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.lib.leto_lend_free.argtypes = [
            ctypes.c_void_p,
            ctypes.c_ssize_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]

    def add(self, ptr: int, nbytes: int) -> None:
        if self.lib.leto_lend_add(ptr, nbytes):
            raise LetoError("too many lent arenas in one process")

    def set_min_bytes(self, nbytes: int) -> None:
        self.lib.leto_lend_set_min_bytes(nbytes)

    def lent_bytes(self) -> int:
        """Arena bytes the caching allocator holds now (cached or live)."""
        return int(self.lib.leto_lend_lent_bytes())

    def fallback_bytes(self) -> int:
        """Bytes of the pool that came from ``cuMemAlloc`` (did not fit the arena)."""
        return int(self.lib.leto_lend_fallback_bytes())

    def segments(self) -> list[tuple[int, int]]:
        """(address, bytes) of every segment placed in the arena."""
        out, i = [], 0
        ptr, nbytes = ctypes.c_size_t(), ctypes.c_size_t()
        while self.lib.leto_lend_segment(i, ctypes.byref(ptr), ctypes.byref(nbytes)) == 0:
            out.append((ptr.value, nbytes.value))
            i += 1
        return out

    def alloc(self, nbytes: int) -> int:
        """The allocator's entry point, for tests: an address, or 0 when nothing fits."""
        return self.lib.leto_lend_alloc(nbytes, 0, None) or 0

    def free(self, ptr: int, nbytes: int) -> None:
        self.lib.leto_lend_free(ptr, nbytes, 0, None)


@functools.cache
def _arena() -> Arena:
    return Arena(library_path())


def warm_library_workspaces(device: torch.device) -> None:
    """Allocate, outside the lending pool, what CUDA libraries keep for the life of the
    process once first used: cuBLAS / cuBLASLt hold a workspace per (handle, stream), a
    handle per thread (the autograd engine's device thread has its own), taken from the
    caching allocator and never freed (32 MiB each with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``).
    First made inside a compute phase, one would sit in the lent memory for good (the 1.1 B
    GPT's first step did exactly that on an H200). A matmul with and without bias, a batched
    one, in fp32 and under bf16 autocast, forward here and backward on the engine's thread,
    as CUDA graph capture asks for warm-up iterations before it takes a private pool."""
    # No RNG draw: the lender is built inside a step's compute phase, after its RNG was set.
    x = torch.ones(16, 16, device=device, requires_grad=True)
    w = torch.ones(16, 16, device=device, requires_grad=True)
    b = torch.ones(16, device=device, requires_grad=True)
    for autocast in (False, True):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            y = torch.nn.functional.linear(x, w, b) + torch.nn.functional.linear(x, w)
            z = torch.bmm(y[None], y[None].transpose(1, 2))
        z.float().sum().backward()
    torch.cuda.synchronize(device)


class ActivationLender:
    """Routes one trainer's compute-phase allocations to memory shared with ``regions``."""

    def __init__(self, device: torch.device, regions: dict[str, torch.Tensor]) -> None:
        if device.type != "cuda":
            raise LetoError("lending activation memory needs a CUDA device")
        if not hasattr(torch.cuda, "MemPool"):
            raise LetoError(
                f"lending activation memory needs torch.cuda.MemPool (torch {torch.__version__} has none)"
            )
        self.device = device
        self.regions = {
            name: (t.data_ptr(), t.numel() * t.element_size()) for name, t in regions.items()
        }
        owned = [
            (int(seg["address"]), int(seg["total_size"])) for seg in torch.cuda.memory_snapshot()
        ]
        for name, (
            ptr,
            nbytes,
        ) in self.regions.items():  # its segments would overlap its own blocks
            for start, size in owned:
                if start < ptr + nbytes and ptr < start + size:
                    raise LetoError(
                        f"{name} lies in the caching allocator's own memory: only memory mapped "
                        "outside it (the pool's CUDA VMM regions) can be lent"
                    )
        self.arena = _arena()
        self.arena.set_min_bytes(MIN_LENT_BYTES)
        for ptr, nbytes in self.regions.values():
            self.arena.add(ptr, nbytes)
        allocator = torch.cuda.memory.CUDAPluggableAllocator(
            str(library_path()), "leto_lend_alloc", "leto_lend_free"
        )
        self.pool = torch.cuda.MemPool(allocator.allocator())
        self._allocator = allocator  # the pool's allocator lives as long as the pool
        rng = torch.cuda.get_rng_state(device)
        warm_library_workspaces(device)
        if not torch.equal(rng, torch.cuda.get_rng_state(device)):
            raise ProtocolError("the library warm-up drew from the CUDA RNG inside a compute phase")
        logger.info(
            "lending %s (%.0f MiB) to the compute phase's activations",
            ", ".join(self.regions),
            sum(n for _, n in self.regions.values()) / 2**20,
        )

    @contextlib.contextmanager
    def lending(self) -> Iterator[None]:
        """Every CUDA allocation inside goes to the lending pool, from every thread."""
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        torch._C._cuda_beginAllocateToPool(index, self.pool.id)
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(index, self.pool.id)
            torch._C._cuda_releasePool(index, self.pool.id)

    def _segments(self) -> list[dict]:
        try:  # no allocation traces needed (and they are off unless memory history records)
            return torch.cuda.memory_snapshot(self.pool.id, include_traces=False)
        except TypeError:  # a torch without the keyword
            return torch.cuda.memory_snapshot(self.pool.id)

    def check_returned(self) -> None:
        """Raise ``ProtocolError`` if a block in the lent regions is still in use: the update
        is about to write them. Only segments with live bytes (``active_size``: allocated or
        awaiting a stream) are looked up among the arena's, so the walk costs a step little
        more than the snapshot itself."""
        lent = sorted(self.arena.segments())
        if not lent:
            return
        starts = [p for p, _ in lent]
        for segment in self._segments():
            if segment.get("active_size", 1) == 0:  # nothing live (a torch without the field: look)
                continue
            start = int(segment["address"])
            i = bisect.bisect_right(starts, start) - 1
            if i >= 0 and start < lent[i][0] + lent[i][1]:
                _refuse(segment)  # raises if a block is live


def _refuse(segment: dict) -> None:
    """``ProtocolError`` naming the first live block of a lent segment."""
    offset = int(segment["address"])
    for block in segment["blocks"]:
        if block["state"] != "inactive":
            raise ProtocolError(
                f"a {block['size']}-byte tensor allocated in the compute phase is still in use after "
                f"it (at {offset:#x}, in memory lent from the RMU's undo buffer, which the update "
                "overwrites): release it before RetainedState.step(); if a library keeps it (a "
                "workspace made on first use), "
                "make that first use before training, or set leto.lend_activation_memory: false"
            )
        offset += int(block["size"])
