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

import importlib
from typing import Any

_LAZY = {
    "CauchyCode": "leto.erasure.rs",
    "DecodePlan": "leto.erasure.rs",
    "ErasureConfig": "leto.erasure.config",
    "GroupSpan": "leto.erasure.layout",
    "PageRef": "leto.erasure.rs",
    "PageSpan": "leto.erasure.layout",
    "ProtectionGroup": "leto.erasure.group",
    "RebuildReport": "leto.erasure.group",
    "padded_bytes": "leto.erasure.layout",
    "plan_groups": "leto.erasure.layout",
    "split_range": "leto.erasure.layout",
}
"""Each export's module, imported at first access: the configuration needs no torch."""

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'leto.erasure' has no attribute {name!r}")
