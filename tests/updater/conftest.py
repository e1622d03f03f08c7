"""Updater tests run the fused RMU kernel the Triton kernels in the interpreter when no GPU is present.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set here, before any
test module imports ``triton_kernels``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
