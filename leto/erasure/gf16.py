"""GF(2^16) arithmetic: tables, scalar ops, bit matrices and small matrix inversion.

The field is GF(2)[x] / (x^16 + x^12 + x^3 + x + 1), i.e. the primitive polynomial
0x1100B, so ``x`` (written ``ALPHA = 2``) generates the multiplicative group and the
log/antilog tables below cover every non-zero element. Scalar arithmetic here serves
the code construction (Cauchy coefficients, decode matrices of at most H x H) and the
test oracle; bulk page arithmetic lives in :mod:`leto.erasure.bitslice` and works on
bit matrices of constants, which :func:`bitmatrix_rows` provides.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import numpy as np
import torch

from leto.erasure.config import ORDER
from leto.errors import UnrecoverableStateError

logger = logging.getLogger(__name__)

POLY = 0x1100B
"""The primitive polynomial x^16 + x^12 + x^3 + x + 1."""
ALPHA = 2
"""The generator ``x``."""


def _build_tables() -> tuple[np.ndarray, np.ndarray]:
    """Return ``(exp, log)``; ``exp`` has 2 * (ORDER - 1) entries so sums of logs need no mod."""
    exp = np.zeros(2 * (ORDER - 1), dtype=np.int64)
    log = np.zeros(ORDER, dtype=np.int64)
    v = 1
    for i in range(ORDER - 1):
        exp[i] = v
        log[v] = i
        v <<= 1
        if v & ORDER:
            v ^= POLY
    if v != 1:  # pragma: no cover - guards a wrong POLY constant
        raise AssertionError("0x1100B is not primitive: the table does not close")
    exp[ORDER - 1 :] = exp[: ORDER - 1]
    return exp, log


EXP_NP, LOG_NP = _build_tables()
EXP = torch.from_numpy(EXP_NP)
"""Antilog table (int64, 2 * 65535 entries): ``EXP[i] = alpha^i``."""
LOG = torch.from_numpy(LOG_NP)
"""Log table (int64, 65536 entries); ``LOG[0]`` is meaningless (0 has no log)."""


def mul(a: int, b: int) -> int:
    """Product of two field elements."""
    if a == 0 or b == 0:
        return 0
    return int(EXP_NP[LOG_NP[a] + LOG_NP[b]])


def inv(a: int) -> int:
    """Multiplicative inverse of a non-zero element."""
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^16)")
    return int(EXP_NP[(ORDER - 1 - LOG_NP[a]) % (ORDER - 1)])


def div(a: int, b: int) -> int:
    """``a / b`` for non-zero ``b``."""
    return mul(a, inv(b))


def mul_symbols(x: torch.Tensor, c: int) -> torch.Tensor:
    """Multiply every 16-bit symbol of ``x`` (any int dtype) by the constant ``c``.

    Log/antilog on whole tensors: the test oracle for the bit-sliced arithmetic.
    """
    xi = x.to(torch.int64) & 0xFFFF
    if c == 0:
        return torch.zeros_like(xi)
    prod = EXP[LOG[xi] + int(LOG_NP[c])]
    return torch.where(xi == 0, torch.zeros_like(prod), prod)


@lru_cache(maxsize=1 << 16)
def bitmatrix_rows(c: int) -> tuple[int, ...]:
    """The 16x16 GF(2) matrix of "multiply by c", as 16 row masks.

    Bit ``b`` of row ``i`` is bit ``i`` of ``c * x^b``: output bit ``i`` of ``c * v`` is
    the parity of ``row[i] & v``. In the bit-sliced layout, output plane ``i`` is the XOR
    of the input planes ``b`` selected by ``row[i]``.
    """
    cols = [mul(c, 1 << b) for b in range(16)]
    return tuple(sum(((cols[b] >> i) & 1) << b for b in range(16)) for i in range(16))


def bitmatrix_rows_np(coefs: np.ndarray) -> np.ndarray:
    """Vectorised :func:`bitmatrix_rows`: int64 ``[..., 16]`` row masks for an array of constants."""
    c = np.asarray(coefs, dtype=np.int64)[..., None]
    b = np.arange(16, dtype=np.int64)
    cols = np.where(c == 0, 0, EXP_NP[LOG_NP[c] + b])  # c * x^b, [..., b]
    bits = (cols[..., None, :] >> b[:, None]) & 1  # [..., i, b]
    return (bits << b).sum(axis=-1)


def mat_inv(m: list[list[int]]) -> list[list[int]]:
    """Inverse of a square matrix over GF(2^16) by Gauss-Jordan elimination.

    Raises :class:`UnrecoverableStateError` if the matrix is singular, which for a Cauchy
    submatrix means the code was misconstructed: recovery must not go on.
    """
    n = len(m)
    a = np.zeros((n, 2 * n), dtype=np.int64)
    a[:, :n] = np.asarray(m, dtype=np.int64).reshape(n, n)
    a[:, n:] = np.eye(n, dtype=np.int64)
    for col in range(n):
        nz = np.flatnonzero(a[col:, col])
        if nz.size == 0:
            raise UnrecoverableStateError(
                "decode matrix is singular; the parity cannot rebuild these pages, "
                "restore from the checkpoint"
            )
        pivot = col + int(nz[0])
        if pivot != col:
            a[[col, pivot]] = a[[pivot, col]]
        a[col] = _outer_mul(np.array([inv(int(a[col, col]))]), a[col])[0]
        f = a[:, col].copy()
        f[col] = 0
        a ^= _outer_mul(f, a[col])  # row r -= f[r] * pivot row (vectorised over rows)
    return a[:, n:].tolist()


def _outer_mul(f: np.ndarray, row: np.ndarray) -> np.ndarray:
    """``[len(f), len(row)]`` products ``f[r] * row[c]`` over the field (log/antilog)."""
    prod = EXP_NP[LOG_NP[f][:, None] + LOG_NP[row][None, :]]
    return np.where((f[:, None] == 0) | (row[None, :] == 0), 0, prod)


def mat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Matrix product over GF(2^16), vectorised with the log/antilog tables.

    ``a`` is ``(n, k)``, ``b`` is ``(k, m)``, both integer arrays of field elements; the
    result is ``(n, m)`` int64. Used for decode matrices (n, k <= H, m <= D).
    """
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    out = np.zeros((a.shape[0], b.shape[1]), dtype=np.int64)
    for k in range(a.shape[1]):
        col, row = a[:, k : k + 1], b[k : k + 1, :]
        prod = EXP_NP[LOG_NP[col] + LOG_NP[row]]
        out ^= np.where((col == 0) | (row == 0), 0, prod)
    return out
