"""A systematic MDS Reed-Solomon code over GF(2^16) built from a Cauchy matrix.

Parity ``p`` is ``sum_j c[p][j] * d_j`` with ``c[p][j] = 1 / (x_p + y_j)``, ``x_p = p``
and ``y_j = H + j`` (all distinct, so every square submatrix of ``c`` is non-singular and
any ``H`` erasures among the ``D + H`` pages are recoverable). Linearity gives the
incremental update ``parity_p ^= c[p][j] * (old_j ^ new_j)``.

This module is pure coefficient algebra (no page data): it produces the matrices that
the engines (:mod:`leto.erasure.engine`) apply to pages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from leto.erasure import gf16
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


class CauchyCode:
    """The ``[D + H, D]`` Cauchy Reed-Solomon code; ``data_pages`` D, ``parity_pages`` H."""

    def __init__(self, data_pages: int, parity_pages: int) -> None:
        if data_pages < 1 or parity_pages < 0:
            raise ConfigError(f"need data_pages >= 1 and parity_pages >= 0, "
                              f"got {data_pages} and {parity_pages}")
        if data_pages + parity_pages > gf16.ORDER:
            raise ConfigError(
                f"data_pages + parity_pages = {data_pages + parity_pages} exceeds the "
                f"{gf16.ORDER} distinct points of GF(2^16); use smaller protection groups"
            )
        self.data_pages = data_pages
        self.parity_pages = parity_pages
        h = parity_pages
        x = np.arange(h, dtype=np.int64)[:, None]
        y = np.arange(h, h + data_pages, dtype=np.int64)[None, :]
        s = x ^ y
        self._matrix = gf16.EXP_NP[(gf16.ORDER - 1 - gf16.LOG_NP[s]) % (gf16.ORDER - 1)]

    @property
    def matrix(self) -> np.ndarray:
        """The ``H x D`` coefficient matrix (int64 field elements, read-only copy)."""
        return self._matrix.copy()

    def coef(self, columns: range | list[int] | None = None) -> tuple[tuple[int, ...], ...]:
        """The encode coefficients restricted to the given data columns (all by default)."""
        m = self._matrix if columns is None else self._matrix[:, list(columns)]
        return tuple(tuple(int(v) for v in row) for row in m)

    def decode_plan(
        self, lost_data: set[int] | list[int], lost_parity: set[int] | list[int],
        *, present_data: int | None = None,
    ) -> DecodePlan:
        """Coefficients that rebuild every lost page from the survivors in one pass.

        ``present_data`` (default D) is the number of leading data pages that exist; the
        rest are logical zero pages (a short last group) and are neither sources nor lost.
        Raises :class:`UnrecoverableStateError` when the erasures exceed the tolerance.
        """
        d = self.data_pages if present_data is None else present_data
        ld = sorted(set(lost_data))
        lp = sorted(set(lost_parity))
        if any(not 0 <= j < d for j in ld) or any(not 0 <= p < self.parity_pages for p in lp):
            raise ValueError(f"lost pages out of range: data {ld} (of {d}), parity {lp} "
                             f"(of {self.parity_pages})")
        if len(ld) + len(lp) > self.parity_pages:
            raise UnrecoverableStateError(
                f"{len(ld)} data and {len(lp)} parity pages lost, but the code tolerates "
                f"{self.parity_pages} erasures per group; restore from the checkpoint"
            )
        ld_set, lp_set = set(ld), set(lp)
        surv_d = [j for j in range(d) if j not in ld_set]
        use_p = [p for p in range(self.parity_pages) if p not in lp_set][: len(ld)]
        c = self._matrix[:, :d]
        n_src = len(surv_d) + len(use_p)
        rows: list[np.ndarray] = []
        if ld:
            cinv = np.array(gf16.mat_inv(c[np.ix_(use_p, ld)].tolist()), dtype=np.int64)
            # d_L = Cinv * (parity_used + C[used, surv] d_surv)
            r_data = gf16.mat_mul(cinv, c[np.ix_(use_p, surv_d)])
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
                via = gf16.mat_mul(c[np.ix_([p], ld)], np.concatenate([r_data, r_par], axis=1))
                row ^= via[0]
            rows.append(row)
        sources = tuple(PageRef("data", j) for j in surv_d) + tuple(
            PageRef("parity", p) for p in use_p)
        outputs = tuple(PageRef("data", j) for j in ld) + tuple(PageRef("parity", p) for p in lp)
        matrix = (np.stack(rows).astype(np.int64) if rows
                  else np.zeros((0, n_src), dtype=np.int64))
        coef = tuple(tuple(row) for row in matrix.tolist())
        return DecodePlan(sources=sources, outputs=outputs, coef=coef, matrix=matrix)
