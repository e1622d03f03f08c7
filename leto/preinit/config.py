"""Settings of the pre-initialisation controller (the ``leto.preinit`` section of a job)."""

from __future__ import annotations

from dataclasses import dataclass

from leto.errors import ConfigError

_MIB = 1 << 20


@dataclass(kw_only=True, slots=True)
class PreinitConfig:
    """How shadows give memory back to the active trainers, and how their level is chosen."""

    reclaim_on_oom: bool = True
    """Reclaim the shadows when an active trainer's compute phase runs out of memory, and
    retry it; off: the OOM propagates (the trainer raises, torchrun's group restart)."""
    l2_bytes: int = 768 * _MIB
    """Device memory of one L2 shadow (CUDA context, cuBLAS workspaces, mapped regions)."""
    l3_bytes: int = 1536 * _MIB
    """Device memory of one L3 shadow (L2 plus its NCCL communicator); DESIGN.md's H200
    figure is about 1.5 GiB per process."""
    margin_bytes: int = 256 * _MIB
    """Free device memory kept beyond a level's footprint at the actives' peak."""
    reclaim_timeout_s: float = 60.0
    """How long an out-of-memory trainer waits for its agent to reclaim the shadows."""
    free_wait_s: float = 10.0
    """GPU: how long a trainer waits, after the shadows were reaped, for the device's free
    memory to go up (the driver may release a dead context's memory late)."""
    warm_kernels: bool = True
    """A level-3 shadow compiles and loads the Triton kernels its recovery and first update
    launch (``leto.preinit.warmup``), and for a model with ``torch.compile``'d modules
    warms the compiler (``model_warmup.warm_compiler``), before it waits; off: they compile
    at first use."""
    replay_forward: bool | None = None
    """A level-3 shadow runs one throwaway forward and backward of a scratch copy of its
    model with the active trainer's input shapes (``leto.preinit.replay``), so a promoted
    trainer's first step finds GEMM choices, loaded kernels and autograd paths paid for;
    unset: on CUDA only (on CPU there is little to pay and the cores are shared)."""
    shadow_deaths_limit: int = 3
    """Shadow generations that may die in a row before any became ready; then the agent
    stops relaunching them and the next failure takes the group-restart path."""
    emulated_device_bytes: int = 0
    """CPU runs only (tests, demos): each rank has an emulated device of this many bytes,
    of which its trainer uses ``emulated_trainer_bytes``; an ``oom`` fault's ``oom_bytes``
    adds to that process's peak. 0: no emulation; on CPU the actives then report no
    memory and a reclaim lowers the level by one."""
    emulated_trainer_bytes: int = 0
    """CPU runs only: the emulated device memory an active trainer holds."""

    def __post_init__(self) -> None:
        for name in (
            "l2_bytes",
            "l3_bytes",
            "margin_bytes",
            "emulated_device_bytes",
            "emulated_trainer_bytes",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"preinit.{name} must be >= 0, got {getattr(self, name)}")
        if self.l3_bytes < self.l2_bytes:
            raise ConfigError(
                f"preinit.l3_bytes ({self.l3_bytes}) must be >= l2_bytes ({self.l2_bytes})"
            )
        if self.shadow_deaths_limit < 1:
            raise ConfigError(
                f"preinit.shadow_deaths_limit must be >= 1, got {self.shadow_deaths_limit}"
            )
        if self.reclaim_timeout_s <= 0 or self.free_wait_s < 0:
            raise ConfigError("preinit.reclaim_timeout_s must be > 0 and free_wait_s >= 0")
        if self.emulated_trainer_bytes > self.emulated_device_bytes:
            raise ConfigError("preinit.emulated_trainer_bytes must be <= emulated_device_bytes")
