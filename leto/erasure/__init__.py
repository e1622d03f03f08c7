"""Two-tier Reed-Solomon erasure protection of retained state over GF(2^16) (paper §4).

Public API for the pool and the updater:

* :class:`ErasureConfig` - page size and group shape (job-file section ``erasure``);
* :func:`plan_groups`, :func:`split_range`, :func:`padded_bytes` - region layout;
* :class:`ProtectionGroup` - ``encode_all``, ``update``, ``update_into`` /
  ``commit_tier1``, ``rebuild`` (raises :class:`leto.errors.UnrecoverableStateError`
  beyond tolerance);
* :class:`CauchyCode` - the code's coefficient algebra (decode plans).
"""

from __future__ import annotations

from leto.erasure.config import ErasureConfig
from leto.erasure.group import ProtectionGroup, RebuildReport
from leto.erasure.layout import GroupSpan, PageSpan, padded_bytes, plan_groups, split_range
from leto.erasure.rs import CauchyCode, DecodePlan, PageRef

__all__ = [
    "CauchyCode",
    "DecodePlan",
    "ErasureConfig",
    "GroupSpan",
    "PageRef",
    "PageSpan",
    "ProtectionGroup",
    "RebuildReport",
    "padded_bytes",
    "plan_groups",
    "split_range",
]
