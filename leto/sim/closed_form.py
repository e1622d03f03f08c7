"""The closed-form ETTR of Appendix C.3 (Eq. 6-8) and Young's checkpoint interval.

    ETTR = (T_iter / T_eff) * (1 - T_rec / MTTF)                       (Eq. 6)
    checkpointing:  T_eff = T_iter + T_ckpt / I,            L = I/2 + 1  (Eq. 7)
    Leto:           T_eff = (1 + omega) T_iter + T_ckpt / I, L = 1/2 on a HOF (Eq. 8)
    T_rec = T_det + T_init + L * T_eff
    I* = sqrt(2 p MTTF / T_iter), p = T_ckpt / T_iter                   (Young, A.2)

Leto keeps checkpoints for fatal failures only, so its interval uses the FF MTTF,
MTTF / (1 - h) (§8.1); its FF recovery is the checkpoint path at that interval. Eq. 8 in
the paper omits Leto's checkpoint cost; it is the T_ckpt / I term above, zero when Leto
runs without a fallback. With HOF ratio h, T_rec is the mean h T_rec,HOF + (1-h) T_rec,FF.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from leto.errors import ConfigError
from leto.sim.config import FailureConfig, SystemConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RecoveryPath:
    """What one failure of a class costs a system."""

    prep_s: float
    """Detection + replacement preparation, before recomputation starts."""
    rollback: bool
    """Whether the job rolls back to its newest usable checkpoint."""
    lost_iters: float
    """Expected iterations of lost progress L (completed ones plus the in-flight half)."""
    recovery_s: float
    """Expected total recovery T_rec: measured, or prep + L * T_eff."""


@dataclass(frozen=True, slots=True)
class SystemTerms:
    """A system's steady-state and recovery terms for one workload and failure model."""

    name: str
    iteration_s: float
    """T_iter of the reference run (no fault tolerance)."""
    step_s: float
    """A non-checkpointing iteration of this system, (1 + omega) T_iter."""
    checkpoint_cost_s: float
    interval_iters: int
    """Checkpoint interval I in iterations."""
    hof: RecoveryPath
    ff: RecoveryPath

    @property
    def t_eff_s(self) -> float:
        """Mean iteration time with fault tolerance on and no failures."""
        return self.step_s + self.checkpoint_cost_s / self.interval_iters


@dataclass(frozen=True, slots=True)
class Prediction:
    """The closed-form prediction for one system."""

    system: str
    ettr: float
    """Predicted ETTR in [0, 1]; 0 where T_rec >= MTTF (the formula is then invalid)."""
    steady_factor: float
    """T_iter / T_eff: what steady-state overhead leaves."""
    recovery_s: float
    """Mean recovery time per failure, over failure classes."""
    hof_recovery_s: float
    ff_recovery_s: float
    t_eff_s: float
    interval_iters: int
    recovery_to_mttf: float
    """T_rec / MTTF; Eq. 6 assumes it is small (the paper's runs reach 0.3)."""

    @property
    def valid(self) -> bool:
        """Whether Eq. 6 is inside its own domain (T_rec < MTTF)."""
        return self.recovery_to_mttf < 1.0


def young_interval_iters(checkpoint_cost_s: float, mttf_s: float, iteration_s: float) -> float:
    """Young's optimum, in iterations: sqrt(2 T_ckpt MTTF) / T_iter (unrounded)."""
    if math.isinf(mttf_s):
        return math.inf
    return math.sqrt(2.0 * checkpoint_cost_s * mttf_s) / iteration_s


def checkpoint_interval(system: SystemConfig, iteration_s: float, failures: FailureConfig) -> int:
    """The interval I a system runs with: fixed, or Young's rounded (FF MTTF for Leto)."""
    if system.kind == "jit":
        return 1
    if system.checkpoint_interval_iters is not None:
        return system.checkpoint_interval_iters
    mttf_s = failures.mttf_s
    if system.kind == "leto":
        mttf_s = math.inf if failures.hof_ratio >= 1.0 else mttf_s / (1.0 - failures.hof_ratio)
    optimum = young_interval_iters(system.checkpoint_s(iteration_s), mttf_s, iteration_s)
    cap = system.max_checkpoint_interval_iters
    if math.isinf(optimum):
        if cap is None:
            raise ConfigError(
                f"system {system.name!r}: Young's interval diverges at hof_ratio 1; "
                "set max_checkpoint_interval_iters (the paper uses the largest interval tested)"
            )
        return cap
    rounded = max(1, math.floor(optimum + 0.5))
    return min(rounded, cap) if cap is not None else rounded


def system_terms(system: SystemConfig, iteration_s: float, failures: FailureConfig) -> SystemTerms:
    """Steady-state and per-class recovery terms of ``system``."""
    interval = checkpoint_interval(system, iteration_s, failures)
    step_s = (1.0 + system.overhead_ratio) * iteration_s
    checkpoint_s = system.checkpoint_s(iteration_s)
    t_eff = step_s + checkpoint_s / interval
    rollback_iters = interval / 2.0 + 1.0
    if system.kind == "leto":
        hof = _path(system.recovery_s, system.init_s, system, False, 0.5, t_eff)
        ff_needed = failures.hof_ratio < 1.0
    else:
        hof = _path(system.recovery_s, system.init_s, system, True, rollback_iters, t_eff)
        ff_needed = False
    if system.ff_recovery_s is None and system.ff_init_s is None:
        if ff_needed:
            raise ConfigError(
                f"system {system.name!r}: fatal failures (hof_ratio < 1) need ff_init_s or "
                "ff_recovery_s for Leto's checkpoint fallback"
            )
        ff = hof if system.kind != "leto" else RecoveryPath(0.0, True, rollback_iters, 0.0)
    else:
        ff = _path(system.ff_recovery_s, system.ff_init_s, system, True, rollback_iters, t_eff)
    return SystemTerms(
        name=system.name,
        iteration_s=iteration_s,
        step_s=step_s,
        checkpoint_cost_s=checkpoint_s,
        interval_iters=interval,
        hof=hof,
        ff=ff,
    )


def _path(
    measured_s: float | None,
    init_s: float | None,
    system: SystemConfig,
    rollback: bool,
    lost_iters: float,
    t_eff_s: float,
) -> RecoveryPath:
    """A recovery path from a measured total or from T_det + T_init + L T_eff."""
    recompute_s = lost_iters * t_eff_s
    if measured_s is not None:
        # A measured total stays as given; the event simulation replays it as a preparation
        # phase of (total - L T_eff) followed by the recomputation it implies.
        return RecoveryPath(max(0.0, measured_s - recompute_s), rollback, lost_iters, measured_s)
    assert init_s is not None  # SystemConfig requires init_s or recovery_s
    prep = system.detection_s + init_s
    return RecoveryPath(prep, rollback, lost_iters, prep + recompute_s)


def predict(terms: SystemTerms, failures: FailureConfig) -> Prediction:
    """Eq. 6 for one system."""
    h = failures.hof_ratio
    recovery = h * terms.hof.recovery_s + (1.0 - h) * terms.ff.recovery_s
    ratio = recovery / failures.mttf_s
    steady = terms.iteration_s / terms.t_eff_s
    ettr = max(0.0, steady * (1.0 - ratio))
    if ratio >= 1.0:
        log.warning(
            "%s: T_rec %.0f s >= MTTF %.0f s, Eq. 6 does not apply",
            terms.name,
            recovery,
            failures.mttf_s,
        )
    return Prediction(
        system=terms.name,
        ettr=ettr,
        steady_factor=steady,
        recovery_s=recovery,
        hof_recovery_s=terms.hof.recovery_s,
        ff_recovery_s=terms.ff.recovery_s,
        t_eff_s=terms.t_eff_s,
        interval_iters=terms.interval_iters,
        recovery_to_mttf=ratio,
    )


def checkpoint_cost_from_ettr(
    ettr: float, iteration_s: float, interval_iters: int, recovery_s: float, mttf_s: float
) -> float:
    """Invert Eq. 6-7 for T_ckpt, given a measured ETTR, interval and recovery time.

    Used to calibrate an input the paper does not publish (e.g. Kimi-MoE's checkpoint cost
    from Table 3's Gemini row) and then predict the other rows from it.
    """
    steady = ettr / (1.0 - recovery_s / mttf_s)
    if not 0.0 < steady <= 1.0:
        raise ValueError(
            f"ETTR {ettr} and recovery {recovery_s} s imply T_iter/T_eff = {steady:.3f}"
        )
    return (iteration_s / steady - iteration_s) * interval_iters
