"""The updaters: one step's optimizer update, crash-consistent (``base.Updater``).

* :mod:`leto.updater.base` — :class:`Updater`, what the step loop asks of either updater, and
  :class:`Buffer`, a retained region an updater works in;
* :mod:`leto.updater.snapshot` — :class:`SnapshotUpdater` (``consistency: snapshot``, §5.1): a
  host copy of the state, then torch's optimizer step;
* :mod:`leto.updater.adamw` — AdamW / Adam applied to slices of the flat retained buffers,
  equal to ``torch.optim.AdamW`` (foreach, non-capturable) within float rounding;
* :mod:`leto.updater.plan` — the cut of the flat parameter space into chunks and the byte
  spans of the state region each chunk touches;
* :mod:`leto.updater.rmu` — :class:`ResumableUpdater` (RMU, §5.2, the default): per chunk
  undo copy → in-place update → incremental parity into a scratch buffer → commit (marker +
  swap); resume from the marker;
* :mod:`leto.updater.fused` — the fused chunk (``triton_kernels.adamw_rmu``: undo copy, progress
  flags and AdamW in one pass) and its restore.
* :mod:`leto.updater.torch_step` — any other optimizer: its own ``step()`` over one chunk of
  whole parameters, on views of retained memory (state found by ``leto.retained.optim_state``).
"""

from __future__ import annotations

from leto.updater.adamw import AdamWHyper, adamw_pieces
from leto.updater.base import Buffer, Updater
from leto.updater.plan import Chunk, Piece, plan_chunks
from leto.updater.rmu import ResumableUpdater
from leto.updater.snapshot import SnapshotUpdater

__all__ = [
    "AdamWHyper",
    "Buffer",
    "Chunk",
    "Piece",
    "ResumableUpdater",
    "SnapshotUpdater",
    "Updater",
    "adamw_pieces",
    "plan_chunks",
]
