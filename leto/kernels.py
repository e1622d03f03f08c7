"""Kernel modes: PyTorch's default kernels, or deterministic ones.

Leto's contract in the default mode: a promoted trainer resumes from exactly the state its
predecessor committed (parameters, optimizer state, RNG, retained objects). Steps re-run
after that may differ from a fault-free run in the last bits, as two fault-free runs on a
GPU do. ``leto-run --deterministic`` makes every trainer use deterministic algorithms (and
cuBLAS's fixed workspace, math attention, no cuDNN autotuning), so that a recovered run is
bit-identical to a fault-free one; it costs step time on a GPU. On CPU the two coincide.

Importing this module does not import torch (the agent reads ``DETERMINISTIC_ENV``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from leto.contract import ENV_DETERMINISTIC

DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
"""Set in every trainer's environment in deterministic mode (cuBLAS reads it at its first
call, before any script code could set it); a value the user set is kept."""


def deterministic_env(environ: Mapping[str, str]) -> dict[str, str]:
    """``DETERMINISTIC_ENV`` less what ``environ`` already sets."""
    return {k: v for k, v in DETERMINISTIC_ENV.items() if k not in environ}


def requested() -> bool:
    """Whether this trainer runs under ``leto-run --deterministic`` (a script that picks
    kernels itself, e.g. Megatron's ``deterministic_mode``, follows it)."""
    return os.environ.get(ENV_DETERMINISTIC) == "1"


def use_deterministic() -> None:
    """Deterministic kernels in this process: what ``--deterministic`` applies in ``leto.init()``.

    A torchrun baseline calls it itself to run on the same kernels; ``DETERMINISTIC_ENV`` is
    set here too for it (effective if cuBLAS has not run yet in this process)."""
    import torch

    os.environ.update(deterministic_env(os.environ))

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    if torch.cuda.is_available():  # flash and memory-efficient attention backward use atomics
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)
