"""Configuration of two-tier erasure protection (the ``erasure:`` section of a job file).

No torch here: ``leto-run`` reads job files before it imports torch."""

from __future__ import annotations

from dataclasses import dataclass

from leto.errors import ConfigError

TILE_BYTES = 2048
"""Bytes per bit-sliced tile (``leto.erasure.bitslice``); page sizes and update ranges must
be multiples of this."""
ORDER = 1 << 16
"""Number of elements of the field GF(2^16) (``leto.erasure.gf16``)."""


@dataclass(kw_only=True, slots=True)
class ErasureConfig:
    """Page size and group shape of the two-tier Reed-Solomon protection (paper §4.1)."""

    page_bytes: int = 2 << 20
    """Bytes per protected page; the GPU VMM granularity (2 MiB) by default. Must be a
    multiple of 2048 (one bit-sliced tile)."""
    data_pages: int = 1024
    """D: data pages per protection group (1024 x 2 MiB = one 2 GiB HBM die)."""
    tier1_parity: int = 16
    """H1: tier-1 parity pages per group, in host memory; any H1 lost pages are rebuilt."""
    tier2_parity: int = 1
    """H2: tier-2 parity pages over the H1 tier-1 pages, in host memory (0 disables)."""

    def __post_init__(self) -> None:
        if self.page_bytes <= 0 or self.page_bytes % TILE_BYTES:
            raise ConfigError(
                f"erasure.page_bytes={self.page_bytes}: must be a positive multiple of "
                f"{TILE_BYTES} (use 2097152 for 2 MiB pages)"
            )
        if self.data_pages < 1:
            raise ConfigError(f"erasure.data_pages={self.data_pages}: must be at least 1")
        if self.tier1_parity < 1:
            raise ConfigError(f"erasure.tier1_parity={self.tier1_parity}: must be at least 1")
        if self.tier2_parity < 0:
            raise ConfigError(f"erasure.tier2_parity={self.tier2_parity}: must be 0 or more")
        if self.data_pages + self.tier1_parity > ORDER:
            raise ConfigError(
                f"erasure.data_pages + tier1_parity = {self.data_pages + self.tier1_parity} "
                f"exceeds {ORDER} (GF(2^16) symbols); use smaller groups"
            )
        if self.tier1_parity + self.tier2_parity > ORDER:
            raise ConfigError("erasure.tier1_parity + tier2_parity exceeds 65536")

    @property
    def group_bytes(self) -> int:
        """Data bytes of a full group."""
        return self.page_bytes * self.data_pages
