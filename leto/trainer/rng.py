"""A step's RNG state as one byte tensor, retained with the model state.

Every generator a step's code may draw from without naming it: torch's (CPU, and the CUDA
device's), and the host's global ones a script's own code uses (Python's ``random``,
NumPy's ``np.random``: a data mixture drawn per step, an augmentation). A re-run step draws
what the failed one drew only if all of them come back; a generator object the script made
itself (``torch.Generator``, ``np.random.default_rng``) is its own, named as a ``Stateful``.
"""

from __future__ import annotations

import ctypes
import random
import struct

import numpy as np
import torch

from leto.errors import ScriptError

_PY = struct.Struct("<625I?d")
"""Python's Mersenne Twister (``random.getstate()``, version 3): 624 words and the index,
then ``gauss_next`` (whether it is set, its value)."""
_NP = struct.Struct("<624IiId")
"""NumPy's legacy global MT19937 (``np.random.get_state()``): the key, the position, and
the cached Gaussian (whether there is one, its value)."""
_NP_RAW_BYTES = 624 * 4 + 4
"""The bit generator's C state (``mt19937_state``: the key, the position)."""
HOST_BYTES = _PY.size + _NP.size


class _NumpyGlobal:
    """NumPy's legacy global generator. ``np.random.get_state()`` costs ~0.1 ms, so a
    capture is reused while the generator's C state (read in a microsecond) is unchanged
    and no Gaussian was cached: then nothing drew from it (every draw moves the position,
    except one served from the Gaussian cache)."""

    def __init__(self) -> None:
        self._generator: object = None
        self._address = 0
        self._raw = b""
        self._packed = b""

    def _c_state(self) -> bytes:
        generator = np.random.mtrand._rand._bit_generator
        if generator is not self._generator:  # np.random.set_bit_generator replaced it
            if type(generator).__name__ != "MT19937":
                raise ScriptError(
                    f"NumPy's global generator is a {type(generator).__name__} "
                    "(np.random.set_bit_generator); leto retains its default MT19937 only"
                )
            self._generator, self._address, self._raw = (
                generator,
                generator.ctypes.state_address,
                b"",
            )
        return ctypes.string_at(self._address, _NP_RAW_BYTES)

    def capture(self) -> bytes:
        raw = self._c_state()
        if raw == self._raw:
            return self._packed
        _, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
        packed = _NP.pack(*key.tolist(), pos, has_gauss, cached)
        self._raw, self._packed = (b"", b"") if has_gauss else (raw, packed)
        return packed

    def restore(self, packed: bytes) -> None:
        state = _NP.unpack(packed)
        key = np.array(state[:624], dtype=np.uint32)
        np.random.set_state(("MT19937", key, state[624], state[625], state[626]))
        self._raw = b""


_NUMPY = _NumpyGlobal()


def _host_states() -> torch.Tensor:
    _, internal, gauss = random.getstate()
    raw = _PY.pack(*internal, gauss is not None, gauss or 0.0) + _NUMPY.capture()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def _set_host_states(blob: torch.Tensor) -> None:
    raw = blob.numpy().tobytes()
    py = _PY.unpack_from(raw)
    random.setstate((3, tuple(py[:625]), py[626] if py[625] else None))
    _NUMPY.restore(raw[_PY.size :])


def rng_blob(device: torch.device) -> torch.Tensor:
    """Every RNG state a step consumes (torch's CPU and the CUDA device's, Python's and
    NumPy's global generators), as one byte tensor."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
    parts.append(_host_states())
    return torch.cat(parts)


def staged(blob: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``blob`` where a non-blocking copy to ``device`` may read it later: page-locked on
    CUDA (the caching host allocator keeps the block until that copy has run)."""
    return blob.pin_memory() if device.type == "cuda" else blob


def set_rng_blob(blob: torch.Tensor, device: torch.device) -> None:
    blob = blob.cpu().clone()  # set_rng_state needs an owning CPU tensor
    cpu = torch.get_rng_state().numel()
    torch.set_rng_state(blob[:cpu].clone())
    if device.type == "cuda":
        torch.cuda.set_rng_state(blob[cpu : blob.numel() - HOST_BYTES].clone(), device)
    _set_host_states(blob[blob.numel() - HOST_BYTES :])
