"""The Appendix C iteration-time model: T_iter = T_pipeline + T_sync + T_update.

Profile-based: per-stage times for one microbatch (brackets + point-to-point transfers +
embedding or head) give the pipeline time (C.1.1); a latency/bandwidth collective model
gives the data-parallel gradient synchronisation (C.1.2); and the bucket-queue replay of
Megatron's overlap (C.1.3) gives the part of that synchronisation left exposed after the
backward window, plus the calibrated interference of dense or cross-node MoE traffic.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

from leto.sim.schema import check

log = logging.getLogger(__name__)

_MIN_BUCKET_PARAMS = 40e6
"""Megatron's gradient bucket: max(40M, 1M x d_p) parameters."""


@dataclass(kw_only=True, slots=True)
class IterationModelConfig:
    """Profiled inputs of the Appendix C iteration-time model."""

    microbatches: int
    """Microbatches per iteration per pipeline (M)."""
    pipeline_stages: int = 1
    """Pipeline-parallel degree (S)."""
    virtual_stages: int = 1
    """Interleaving degree (v); model chunks per pipeline rank."""
    stage_times_s: list[float]
    """Per stage, forward+backward of one microbatch: brackets, p2p, embedding/head."""
    backward_window_s: float | None = None
    """Backward window W that gradient buckets overlap with; default 2/3 of the slowest stage."""
    stage_params: float
    """Parameters whose gradients one stage synchronises across data parallelism."""
    data_parallel: int
    """Data-parallel degree d_p (sets the bucket size and the ring factor)."""
    grad_bytes_per_param: float = 4.0
    """Bytes per gradient element on the wire (4 for fp32 reduction, 2 for bf16)."""
    collective: Literal["all_reduce", "reduce_scatter"] = "reduce_scatter"
    """Gradient collective: reduce-scatter for sharded optimizers, all-reduce otherwise."""
    collective_latency_s: float = 50e-6
    """Fitted per-collective latency (alpha)."""
    collective_bandwidth_gbps: float
    """Fitted bus bandwidth of the gradient collective, in GB/s (1e9 bytes)."""
    concurrency_penalty: float = 1.0
    """Measured slowdown of a collective that shares the fabric with another one."""
    overlap: Literal["off", "dense", "moe"] = "dense"
    """No overlap; dense interference (c); or MoE all-to-all sharing the fabric (f)."""
    interference: float = 0.0
    """Calibrated c (dense) or f (MoE) of Appendix C.1.3, in [0, 1]."""
    alltoall_s: float = 0.0
    """MoE all-to-all time during the backward window (A), for ``overlap: moe``."""
    update_s: float = 0.0
    """Optimizer step and scalar reductions (T_update)."""
    allgather_s: float = 0.0
    """Parameter all-gather after a sharded optimizer step."""
    source: str = ""
    """Where the profile numbers come from."""

    def __post_init__(self) -> None:
        check(self.microbatches >= 1, f"microbatches: must be >= 1, got {self.microbatches}")
        check(
            self.pipeline_stages >= 1, f"pipeline_stages: must be >= 1, got {self.pipeline_stages}"
        )
        check(self.virtual_stages >= 1, f"virtual_stages: must be >= 1, got {self.virtual_stages}")
        check(
            len(self.stage_times_s) in (1, self.pipeline_stages),
            f"stage_times_s: give 1 or pipeline_stages={self.pipeline_stages} values, "
            f"got {len(self.stage_times_s)}",
        )
        check(all(t > 0 for t in self.stage_times_s), "stage_times_s: each must be > 0")
        check(self.stage_params > 0, f"stage_params: must be > 0, got {self.stage_params}")
        check(self.data_parallel >= 1, f"data_parallel: must be >= 1, got {self.data_parallel}")
        check(self.collective_bandwidth_gbps > 0, "collective_bandwidth_gbps: must be > 0")
        check(
            0.0 <= self.interference <= 1.0,
            f"interference: must be in [0, 1], got {self.interference}",
        )
        for name in ("update_s", "allgather_s", "alltoall_s", "collective_latency_s"):
            check(getattr(self, name) >= 0, f"{name}: must be >= 0, got {getattr(self, name)}")

    def predict(self) -> IterationBreakdown:
        """Predict T_iter and its parts."""
        return predict_iteration(self)


@dataclass(frozen=True, slots=True)
class IterationBreakdown:
    """The parts of one predicted iteration, in seconds."""

    pipeline_s: float
    sync_serial_s: float
    """T_sync: the gradient collectives back to back, no overlap."""
    sync_s: float
    """Synchronisation time charged to the iteration (T_sync^on with overlap)."""
    update_s: float

    @property
    def iteration_s(self) -> float:
        return self.pipeline_s + self.sync_s + self.update_s


def pipeline_time_s(
    microbatches: int, stages: int, virtual: int, stage_times_s: list[float]
) -> float:
    """C.1.1: (M + (S - 1)/v) x max_s stage(s)."""
    return (microbatches + (stages - 1) / virtual) * max(stage_times_s)


def bucket_sizes(stage_params: float, data_parallel: int) -> list[float]:
    """Megatron's gradient buckets for one stage, in parameters, last one partial."""
    size = max(_MIN_BUCKET_PARAMS, 1e6 * data_parallel)
    full = int(stage_params // size)
    rest = stage_params - full * size
    return [size] * full + ([rest] if rest > 0 else [])


def exposed_comm_s(transfer_s: list[float], ready_fraction: list[float], window_s: float) -> float:
    """C.1.3 bucket queue: f_i = max(rho_i W, f_{i-1}) + w_i; E = max(0, f_n - W)."""
    finish = 0.0
    for w, rho in zip(transfer_s, ready_fraction, strict=True):
        finish = max(rho * window_s, finish) + w
    return max(0.0, finish - window_s)


def collective_time_s(cfg: IterationModelConfig, params: float) -> float:
    """Ring collective of ``params`` gradients over d_p ranks, with the concurrency penalty."""
    d = cfg.data_parallel
    steps = 2 * (d - 1) / d if cfg.collective == "all_reduce" else (d - 1) / d
    wire_s = params * cfg.grad_bytes_per_param * steps / (cfg.collective_bandwidth_gbps * 1e9)
    return (cfg.collective_latency_s + wire_s) * cfg.concurrency_penalty


def predict_iteration(cfg: IterationModelConfig) -> IterationBreakdown:
    """T_pipeline + T_sync(^on) + T_update (+ all-gather) for one configuration."""
    pipeline = pipeline_time_s(
        cfg.microbatches, cfg.pipeline_stages, cfg.virtual_stages, cfg.stage_times_s
    )
    buckets = bucket_sizes(cfg.stage_params, cfg.data_parallel) if cfg.data_parallel > 1 else []
    transfer = [collective_time_s(cfg, b) for b in buckets]
    serial = sum(transfer)
    ready = [sum(buckets[: i + 1]) / cfg.stage_params for i in range(len(buckets))]
    window = (
        cfg.backward_window_s
        if cfg.backward_window_s is not None
        else 2 / 3 * max(cfg.stage_times_s)
    )
    if cfg.overlap == "off":
        sync = serial
    elif cfg.overlap == "dense":
        exposed = exposed_comm_s(transfer, ready, window)
        sync = exposed + cfg.interference * (serial - exposed)
    else:
        shared = cfg.interference * min(serial, cfg.alltoall_s)
        sync = exposed_comm_s(transfer, ready, window + shared) + shared
    result = IterationBreakdown(
        pipeline_s=pipeline,
        sync_serial_s=serial,
        sync_s=sync,
        update_s=cfg.update_s + cfg.allgather_s,
    )
    log.debug("iteration model: %s -> %.3f s", result, result.iteration_s)
    assert math.isfinite(result.iteration_s)
    return result
