"""Megatron-Core tests: megatron-core is in the ``test`` extra; without it they skip, saying so."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def megatron():
    """megatron.core with the CPU ``torch.cuda`` shims installed (this process has no CUDA)."""
    core = pytest.importorskip(
        "megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'"
    )
    sys.path.insert(0, str(REPO / "examples"))
    import megatron_cpu_shims

    megatron_cpu_shims.install()
    return core


@pytest.fixture(scope="module")
def parallel(megatron):
    """A world of one (gloo) with Megatron's parallel_state on it; yields the integration module."""
    from megatron.core import parallel_state

    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", store=dist.FileStore(f.name, 1), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        from leto.integrations import megatron as lm

        lm.reseed_tracker(7, -1)
        yield lm
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
