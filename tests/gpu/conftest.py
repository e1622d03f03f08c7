"""GPU tests: they need a CUDA device and skip on CPU machines (CI), saying why."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make gpu-test` on a GPU machine)")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
