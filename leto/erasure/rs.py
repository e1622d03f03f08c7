"""Systematic MDS Reed-Solomon codes over GF(2^16): the coefficient algebra.

Both codes give parity ``p`` as ``sum_j c[p][j] * d_j``; every square submatrix of ``c``
is non-singular, so any ``H`` erasures among the ``D + H`` pages are recoverable, and
linearity gives the incremental update ``parity_p ^= c[p][j] * (old_j ^ new_j)``.

* :class:`CauchyCode`: ``c[p][j] = 1 / (x_p + y_j)``, ``x_p = p``, ``y_j = H + j`` (tier 2).
* :class:`GRSCode` (tier 1): the generalised RS code whose parity-check matrix is the
  Vandermonde ``[V | W]`` with ``V[p][j] = a^(e_p j)`` (data page ``j`` at the point
  ``a^j``) and ``W[p][q] = a^(e_p (D + q))`` (parity page ``q``), on the consecutive rows
  ``e_p = b + p``, ``p < H``, ``b = first_row(H)`` (-7 for H = 16), ``a`` the primitive
  element. Any H columns of it form a Vandermonde matrix on distinct points times a
  diagonal, so the code is MDS; its parity is ``P = W^-1 S`` of the *syndromes* ``S = V d``.

Why tier 1 is GRS (docs/ERASURE.md): syndrome ``p`` of ``k`` consecutive pages
``j0..j0+k-1`` is ``a^(e_p j0) * sum_i (a^e_p)^i d_(j0+i)``, a Horner polynomial in the
*fixed* constant ``a^e_p``. In the bit-sliced layout multiplying by ``a`` (or by
``a^-1``) is a plane rotation plus three XORs, so the per-page work of an update falls
from a generic 16x16 GF(2) product per parity (256 AND-XOR per 32 symbols) to
``3|e_p| + 16`` XORs, and rows centred on 0 keep ``|e_p|`` at most H/2; the generic
product is paid once per chunk for ``a^(e_p j0)``. The updater keeps its device working
parity in syndrome form (:meth:`GRSCode.syndromes`) and converts at the ends of a step
(``S = W P`` at load, ``P = W^-1 S`` at the flush, 16 pages each per group).

This module is pure coefficient algebra (no page data): it produces the matrices that
the engines (:mod:`leto.erasure.engine`) apply to pages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from leto.erasure.gf16 import ALPHA, EXP_NP, LOG_NP, ORDER, mat_inv, mat_mul
from leto.errors import ConfigError, UnrecoverableStateError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PageRef:
    """One page of a codeword: ``kind`` is ``"data"`` or ``"parity"``, ``index`` its number."""

    kind: str
    index: int


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """A linear map from survivors to lost pages: ``outputs[o] = sum_k coef[o][k] * sources[k]``."""

    sources: tuple[PageRef, ...]
    outputs: tuple[PageRef, ...]
    coef: tuple[tuple[int, ...], ...]
    matrix: np.ndarray | None = field(default=None, compare=False, repr=False)
    """``coef`` as an int64 ``[outputs, sources]`` array (what the GPU path uploads)."""


@dataclass(frozen=True, slots=True)
class SyndromeDecode:
    """Erasure decoding of a :class:`GRSCode` through its syndromes (the GPU rebuild).

    With the erased pages zeroed, the first ``rows`` syndromes of what survives are
    ``R = V[:rows] d + parity_coef . parity[parity_sources]`` (``V d`` by the Horner kernel
    over the data pages, the rest a small product); they equal ``M c`` over the erased pages
    ``c`` (``M[p][x] = a^(e_p pos_x)``, a Vandermonde matrix on distinct points times a
    diagonal), so
    ``c = inverse . R``. No ``H x D`` composition: the planning is one ``e x e`` inverse.
    """

    outputs: tuple[PageRef, ...]
    """The erased pages, in the order of ``inverse``'s rows."""
    rows: int
    """How many syndromes the solve needs (the number of erasures)."""
    parity_sources: tuple[int, ...]
    """The surviving parity pages that enter ``R`` (tier-1 parity, or the stored syndromes)."""
    parity_coef: np.ndarray
    """int64 ``[rows, len(parity_sources)]``."""
    inverse: np.ndarray
    """int64 ``[rows, rows]``: ``M^-1``."""


def _check_shape(data_pages: int, parity_pages: int, points: int) -> None:
    if data_pages < 1 or parity_pages < 0:
        raise ConfigError(
            f"need data_pages >= 1 and parity_pages >= 0, got {data_pages} and {parity_pages}"
        )
    if data_pages + parity_pages > points:
        raise ConfigError(
            f"data_pages + parity_pages = {data_pages + parity_pages} exceeds the "
            f"{points} distinct points of GF(2^16); use smaller protection groups"
        )


def _powers(base: np.ndarray, exponents: np.ndarray) -> np.ndarray:
    """``base ** exponents`` elementwise for non-zero field elements (via the log table)."""
    return EXP_NP[(LOG_NP[base] * exponents) % (ORDER - 1)]


class SystematicCode:
    """A systematic ``[D + H, D]`` code given by its ``H x D`` parity matrix ``c``."""

    data_pages: int
    parity_pages: int
    _matrix: np.ndarray

    @property
    def matrix(self) -> np.ndarray:
        """The ``H x D`` coefficient matrix (int64 field elements, read-only copy)."""
        return self._matrix.copy()

    def coef(self, columns: range | list[int] | None = None) -> tuple[tuple[int, ...], ...]:
        """The encode coefficients restricted to the given data columns (all by default)."""
        m = self._matrix if columns is None else self._matrix[:, list(columns)]
        return tuple(tuple(int(v) for v in row) for row in m)

    def decode_plan(
        self,
        lost_data: set[int] | list[int],
        lost_parity: set[int] | list[int],
        *,
        present_data: int | None = None,
    ) -> DecodePlan:
        """Coefficients that rebuild every lost page from the survivors in one pass.

        ``present_data`` (default D) is the number of leading data pages that exist; the
        rest are logical zero pages (a short last group) and are neither sources nor lost.
        Raises :class:`UnrecoverableStateError` when the erasures exceed the tolerance.
        """
        d, ld, lp = _checked_erasures(self, lost_data, lost_parity, present_data)
        return _decode_plan(self._matrix, d, ld, lp)


class CauchyCode(SystematicCode):
    """The ``[D + H, D]`` Cauchy Reed-Solomon code; ``data_pages`` D, ``parity_pages`` H."""

    def __init__(self, data_pages: int, parity_pages: int) -> None:
        _check_shape(data_pages, parity_pages, ORDER)
        self.data_pages = data_pages
        self.parity_pages = parity_pages
        h = parity_pages
        x = np.arange(h, dtype=np.int64)[:, None]
        y = np.arange(h, h + data_pages, dtype=np.int64)[None, :]
        s = x ^ y
        self._matrix = EXP_NP[(ORDER - 1 - LOG_NP[s]) % (ORDER - 1)]


def first_row(parity_pages: int) -> int:
    """The exponent ``b`` of syndrome 0 of a code with ``parity_pages`` syndromes: the rows
    ``b .. b + H - 1`` are centred on 0 (-7 .. 8 for H = 16), so the Horner steps multiply
    by ``a^e`` with ``|e|`` at most H/2 (3|e| XORs each; 64 in all for H = 16, against 120
    for the rows 0 .. 15)."""
    return -((parity_pages - 1) // 2)


class GRSCode(SystematicCode):
    """The ``[D + H, D]`` generalised RS code of the module docstring (tier 1).

    ``matrix`` is the generator ``W^-1 V``; :attr:`check_data` (``V``), :attr:`to_syndromes`
    (``W``: ``S = W P``) and :attr:`from_syndromes` (``W^-1``) serve the syndrome form.
    Syndrome ``p`` is row ``first_row + p`` of the check matrix (:func:`first_row`).
    """

    def __init__(self, data_pages: int, parity_pages: int) -> None:
        # the points a^0 .. a^(D+H-1) must be distinct: D + H <= 2^16 - 1
        _check_shape(data_pages, parity_pages, ORDER - 1)
        self.data_pages, self.parity_pages = data_pages, parity_pages
        self.first_row = first_row(parity_pages)
        p = self.first_row + np.arange(parity_pages, dtype=np.int64)[:, None]
        a = np.full((1, 1), ALPHA, dtype=np.int64)
        self.check_data = _powers(a, p * np.arange(data_pages, dtype=np.int64)[None, :])
        self.to_syndromes = _powers(
            a, p * np.arange(data_pages, data_pages + parity_pages, dtype=np.int64)[None, :]
        )
        self.from_syndromes = (
            np.array(mat_inv(self.to_syndromes.tolist()), dtype=np.int64)
            if parity_pages
            else np.zeros((0, 0), dtype=np.int64)
        )
        self._matrix = (
            mat_mul(self.from_syndromes, self.check_data)
            if parity_pages
            else np.zeros((0, data_pages), dtype=np.int64)
        )

    def syndromes(self) -> SyndromeCode:
        """The syndrome form ``S = V d`` of this code (the updater's working parity)."""
        return SyndromeCode(self)

    def syndrome_decode(
        self, lost_data: list[int], lost_parity: list[int], *, present_data: int | None = None
    ) -> SyndromeDecode:
        """:class:`SyndromeDecode` of these erasures: the parity check ``V d = W P`` (char 2)
        makes the syndromes of the survivors those of the erased pages. Same checks and
        errors as :meth:`decode_plan`."""
        _, ld, lp = _checked_erasures(self, lost_data, lost_parity, present_data)
        e = len(ld) + len(lp)
        pos = np.array(ld + [self.data_pages + q for q in lp], dtype=np.int64)
        gone = set(lp)
        surv = tuple(q for q in range(self.parity_pages) if q not in gone)
        return SyndromeDecode(
            outputs=tuple(PageRef("data", j) for j in ld) + tuple(PageRef("parity", q) for q in lp),
            rows=e,
            parity_sources=surv,
            parity_coef=self.to_syndromes[:e][:, list(surv)],
            inverse=_vandermonde_inverse(pos, e, self.first_row),
        )


class SyndromeCode(SystematicCode):
    """Syndromes ``S_p = sum_j a^(e_p j) d_j`` of a :class:`GRSCode` as "parity pages".

    Not an MDS code on its own (a square submatrix of ``V`` on non-consecutive rows may be
    singular), but lost *data* pages are always recoverable while every syndrome page is
    intact: ``e`` lost pages use syndromes ``0..e-1``, a Vandermonde matrix on distinct
    points times a diagonal. Lost syndrome pages (the updater's working parity) are refused.
    """

    def __init__(self, code: GRSCode) -> None:
        self.data_pages, self.parity_pages = code.data_pages, code.parity_pages
        self.first_row = code.first_row
        self._matrix = code.check_data

    def decode_plan(
        self,
        lost_data: set[int] | list[int],
        lost_parity: set[int] | list[int],
        *,
        present_data: int | None = None,
    ) -> DecodePlan:
        """Rebuild lost data pages from the survivors and the syndromes (none may be lost)."""
        _refuse_lost_syndromes(lost_parity)
        return super().decode_plan(lost_data, (), present_data=present_data)

    def syndrome_decode(
        self, lost_data: list[int], lost_parity: list[int], *, present_data: int | None = None
    ) -> SyndromeDecode:
        """:class:`SyndromeDecode` of lost data pages: the stored syndromes enter ``R``
        directly (``parity_coef`` selects the first ``e``). Lost syndrome pages are refused."""
        _refuse_lost_syndromes(lost_parity)
        _, ld, _ = _checked_erasures(self, lost_data, [], present_data)
        e = len(ld)
        return SyndromeDecode(
            outputs=tuple(PageRef("data", j) for j in ld),
            rows=e,
            parity_sources=tuple(range(e)),
            parity_coef=np.eye(e, dtype=np.int64),
            inverse=_vandermonde_inverse(np.array(ld, dtype=np.int64), e, self.first_row),
        )


def _refuse_lost_syndromes(lost: set[int] | list[int]) -> None:
    if lost:
        raise UnrecoverableStateError(
            f"syndrome pages {sorted(set(lost))} of the working parity were lost; restore from the checkpoint"
        )


def _checked_erasures(
    code: SystematicCode, lost_data: list[int], lost_parity: list[int], present_data: int | None
) -> tuple[int, list[int], list[int]]:
    """The data pages present and the sorted erasures, checked for every decode."""
    d = code.data_pages if present_data is None else present_data
    ld, lp = sorted(set(lost_data)), sorted(set(lost_parity))
    if any(not 0 <= j < d for j in ld) or any(not 0 <= p < code.parity_pages for p in lp):
        raise ValueError(
            f"lost pages out of range: data {ld} (of {d}), parity {lp} (of {code.parity_pages})"
        )
    if len(ld) + len(lp) > code.parity_pages:
        raise UnrecoverableStateError(
            f"{len(ld)} data and {len(lp)} parity pages lost, but the code tolerates "
            f"{code.parity_pages} erasures per group; restore from the checkpoint"
        )
    return d, ld, lp


def _vandermonde_inverse(positions: np.ndarray, rows: int, first: int) -> np.ndarray:
    """``M^-1`` for ``M[p][x] = a^((first + p) positions[x])``, ``p < rows = len(positions)``
    (a Vandermonde matrix on distinct points times the diagonal ``a^(first positions[x])``)."""
    if rows == 0:
        return np.zeros((0, 0), dtype=np.int64)
    exps = (first + np.arange(rows, dtype=np.int64))[:, None] * positions[None, :]
    m = EXP_NP[exps % (ORDER - 1)]
    return np.array(mat_inv(m.tolist()), dtype=np.int64)


def _decode_plan(c_all: np.ndarray, d: int, ld: list[int], lp: list[int]) -> DecodePlan:
    """The one-pass decode plan of a systematic code with parity matrix ``c_all``."""
    ld_set, lp_set = set(ld), set(lp)
    surv_d = [j for j in range(d) if j not in ld_set]
    use_p = [p for p in range(c_all.shape[0]) if p not in lp_set][: len(ld)]
    c = c_all[:, :d]
    n_src = len(surv_d) + len(use_p)
    rows: list[np.ndarray] = []
    if ld:
        cinv = np.array(mat_inv(c[np.ix_(use_p, ld)].tolist()), dtype=np.int64)
        # d_L = Cinv * (parity_used + C[used, surv] d_surv)
        r_data = mat_mul(cinv, c[np.ix_(use_p, surv_d)])
        r_par = cinv
        rows.extend(np.concatenate([r_data, r_par], axis=1))
    else:
        r_data = np.zeros((0, len(surv_d)), dtype=np.int64)
        r_par = np.zeros((0, 0), dtype=np.int64)
    for p in lp:
        # parity_p = C[p, surv] d_surv + C[p, L] d_L
        row = np.zeros(n_src, dtype=np.int64)
        row[: len(surv_d)] = c[p, surv_d]
        if ld:
            via = mat_mul(c[np.ix_([p], ld)], np.concatenate([r_data, r_par], axis=1))
            row ^= via[0]
        rows.append(row)
    sources = tuple(PageRef("data", j) for j in surv_d) + tuple(PageRef("parity", p) for p in use_p)
    outputs = tuple(PageRef("data", j) for j in ld) + tuple(PageRef("parity", p) for p in lp)
    matrix = np.stack(rows).astype(np.int64) if rows else np.zeros((0, n_src), dtype=np.int64)
    coef = tuple(tuple(row) for row in matrix.tolist())
    return DecodePlan(sources=sources, outputs=outputs, coef=coef, matrix=matrix)
