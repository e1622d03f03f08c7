"""Megatron-Core tests: megatron-core is in the ``test`` extra; without it they skip, saying so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def megatron():
    """megatron.core with the CPU ``torch.cuda`` shims installed (this process has no CUDA)."""
    core = pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install -e '.[megatron]'")
    sys.path.insert(0, str(REPO / "examples"))
    import megatron_cpu_shims

    megatron_cpu_shims.install()
    return core
