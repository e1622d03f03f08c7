"""Where one tensor lives inside a retained region: offset, shape and dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one tensor lives inside a region."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * element_size(self.dtype)

    def view(self, region: torch.Tensor) -> torch.Tensor:
        return region[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
