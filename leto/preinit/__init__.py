"""Pre-initialisation controller (paper §6): shadows never cost the active trainers an OOM.

A shadow trainer holds device memory for what makes promotion fast (CUDA context, cuBLAS
workspaces, NCCL communicator). When the active trainer's own demand needs that memory:

1. the active trainer's compute phase raises ``torch.OutOfMemoryError``; ``RetainedState``
   (``leto.trainer.state``) catches it, and through :class:`~leto.preinit.guard.OomGuard`
   asks its agent to reclaim the shadow (words of the node's heartbeat board);
2. the agent's :class:`~leto.preinit.controller.PreinitController` kills the shadow
   generation and answers once it is reaped; on a GPU the trainer then waits until the
   device's free memory went up, restores the step's RNG, zeroes its gradients and re-runs
   the compute phase — bit-identical, since model state is read-only there;
3. after the retried step, the agent relaunches the shadows at the highest level that fits
   the memory the actives reported (:func:`~leto.preinit.levels.choose_level`,
   L3 → L2 → L1), and after every recovery it chooses again from the new actives' peak.
"""

from leto.preinit.config import PreinitConfig
from leto.preinit.levels import DeviceMemory, LevelChoice, ShadowLevel, choose_level

__all__ = ["DeviceMemory", "LevelChoice", "PreinitConfig", "ShadowLevel", "choose_level"]
