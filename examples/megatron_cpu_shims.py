"""``torch.cuda`` shims that let Megatron-Core's GPTModel run on a machine without CUDA.

For CPU runs only (tests, CI, the example with no GPU); ``install()`` refuses to run when
CUDA is available, so none of this can leak into a GPU job. Megatron-Core 0.16.1 needs:

* ``torch.cuda.current_device()`` → the CPU device (Megatron allocates its scratch
  buffers, e.g. the attention matmul buffer, with ``device=torch.cuda.current_device()``);
* an RNG tracker whose states are CPU generator states (``CudaRNGStatesTracker`` reads
  and writes ``torch.cuda`` generators); forks swap the default CPU generator in and out.

Callers must also pass an explicit attention mask (``leto.integrations.megatron.causal_mask``):
Megatron's default causal mask is allocated on ``"cuda"`` by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_installed = False


def install() -> None:
    """Patch ``torch.cuda.current_device`` and Megatron's RNG tracker for CPU (idempotent)."""
    global _installed
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu_shims are for machines without CUDA; do not install them on a GPU")
    if _installed:
        return
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's tracker with CPU generator states in place of CUDA ones."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_ or name in self.states_:
                raise RuntimeError(f"rng state {name} / seed {seed} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise RuntimeError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _installed = True
