"""A step's RNG state as one byte tensor, retained with the model state."""

from __future__ import annotations

import torch


def rng_blob(device: torch.device) -> torch.Tensor:
    """Every RNG state a step consumes (CPU, and the CUDA device's), as one byte tensor."""
    parts = [torch.get_rng_state()]
    if device.type == "cuda":
        parts.append(torch.cuda.get_rng_state(device))
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
        torch.cuda.set_rng_state(blob[cpu:].clone(), device)
