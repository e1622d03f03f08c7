"""Scenario files for ``leto-run sim``: one workload, one failure model, several systems.

A scenario YAML holds data only. Values taken from the Leto paper carry a ``source:``
field or a comment naming the table or figure; values the paper does not give are
marked as assumptions. A measured profile (``workload.profile: bench_out.json``) fills
in iteration, checkpoint and recovery times so the simulator predicts our own runs;
keys written in the scenario win over the profile's.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from leto.config import unknown_key
from leto.errors import ConfigError
from leto.sim.itermodel import IterationModelConfig
from leto.sim.schema import build, check, read_mapping

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class WorkloadConfig:
    """The training job: its size and how long one fault-free iteration takes."""

    name: str
    """Model name, e.g. ``Kimi-MoE``."""
    num_gpus: int
    """GPUs in the job; the x axis of the ETTR-vs-scale plot."""
    iteration_time_s: float | None = None
    """Fault-free iteration time without any fault-tolerance mechanism (T_iter)."""
    iteration_model: IterationModelConfig | None = None
    """Appendix C iteration-time model; used when ``iteration_time_s`` is not given."""
    profile: str | None = None
    """Measured profile JSON (path relative to the scenario file) with our own timings."""
    optimizer_sharded: bool = True
    """Whether optimizer states are sharded across DP ranks (JIT-Ckpt then does not apply)."""
    parallelism: dict[str, int] = field(default_factory=dict)
    """DP/TP/PP/EP degrees, recorded for the report only (Table 2 / Table 5)."""
    source: str = ""
    """Where the numbers come from (paper table, profile, assumption)."""

    def __post_init__(self) -> None:
        check(self.num_gpus >= 1, f"num_gpus: must be >= 1, got {self.num_gpus}")
        if self.iteration_time_s is not None:
            check(
                self.iteration_time_s > 0,
                f"iteration_time_s: must be > 0, got {self.iteration_time_s}",
            )
        check(
            (self.iteration_time_s is None) != (self.iteration_model is None),
            "give exactly one of iteration_time_s, iteration_model "
            "(or a profile with iteration_time_s)",
        )

    def iteration_s(self) -> float:
        """T_iter in seconds, given or predicted by the Appendix C model."""
        if self.iteration_time_s is not None:
            return self.iteration_time_s
        assert self.iteration_model is not None
        return self.iteration_model.predict().iteration_s


@dataclass(kw_only=True, slots=True)
class FailureConfig:
    """How often the job fails and which share of failures leaves the hardware usable."""

    mttf_min: float
    """Mean time between job failures of any class, in minutes of wall-clock time."""
    hof_ratio: float = 1.0
    """Fraction of failures that are hardware-operable (HOF); the rest are fatal (FF)."""
    arrival: Literal["poisson", "window", "periodic"] = "poisson"
    """Monte Carlo arrivals: exponential gaps; one at a uniform time in each MTTF window;
    or exactly one every MTTF (phase-locks with the checkpoint cycle, see SIMULATOR.md)."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        check(self.mttf_min > 0, f"mttf_min: must be > 0, got {self.mttf_min}")
        check(0.0 <= self.hof_ratio <= 1.0, f"hof_ratio: must be in [0, 1], got {self.hof_ratio}")

    @property
    def mttf_s(self) -> float:
        """MTTF in seconds."""
        return self.mttf_min * 60.0


@dataclass(kw_only=True, slots=True)
class SystemConfig:
    """One fault-tolerance system: its steady-state cost and its recovery path.

    ``kind`` picks the recovery model (Appendix C, Eq. 7-8): ``checkpoint`` rolls back to
    the newest usable checkpoint on every failure (Gemini, Gemini+, torchrun + disk);
    ``jit`` is a checkpoint system that commits every iteration (JIT-Ckpt, replicated
    optimizer states only); ``leto`` loses only the in-flight iteration on a HOF and takes
    its checkpoint fallback on an FF, with the interval from the FF MTTF.
    """

    name: str
    """Label in tables and plots, e.g. ``Gemini+``."""
    kind: Literal["checkpoint", "jit", "leto"]
    """Recovery model, see the class docstring."""
    checkpoint_cost_s: float | None = None
    """Excess time of an iteration that commits a checkpoint over one that does not."""
    checkpoint_cost_ratio: float | None = None
    """The same cost normalised by T_iter (p in Appendix A.2); instead of the seconds."""
    checkpoint_interval_iters: int | None = None
    """Fixed checkpoint interval I; unset means Young's interval, rounded."""
    max_checkpoint_interval_iters: int | None = None
    """Cap on Young's interval; required for Leto at 100 % HOFs, where it diverges."""
    detection_s: float = 0.0
    """Failure detection time (T_det)."""
    init_s: float | None = None
    """Time to prepare the replacement after a HOF (T_init), checkpoint loading included."""
    ff_init_s: float | None = None
    """T_init after a fatal failure (spare-based); defaults to ``init_s``."""
    overhead_ratio: float = 0.0
    """Steady-state iteration-time overhead omega, e.g. 0.006 for RMU (Table 1)."""
    recovery_s: float | None = None
    """Measured total HOF recovery (init + recomputation); overrides the decomposition."""
    ff_recovery_s: float | None = None
    """Measured total FF recovery; overrides the decomposition."""
    source: str = ""
    """Where the numbers come from."""

    def __post_init__(self) -> None:
        check(
            self.checkpoint_cost_s is None or self.checkpoint_cost_ratio is None,
            "give checkpoint_cost_s or checkpoint_cost_ratio, not both",
        )
        for name in (
            "checkpoint_cost_s",
            "checkpoint_cost_ratio",
            "detection_s",
            "init_s",
            "ff_init_s",
            "recovery_s",
            "ff_recovery_s",
        ):
            value = getattr(self, name)
            check(value is None or value >= 0, f"{name}: must be >= 0, got {value}")
        check(
            0 <= self.overhead_ratio,
            f"overhead_ratio: must be >= 0 (iteration time multiplier minus 1), got {self.overhead_ratio}",
        )
        for name in ("checkpoint_interval_iters", "max_checkpoint_interval_iters"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"{name}: must be >= 1, got {value}")
        check(
            self.init_s is not None or self.recovery_s is not None,
            "give init_s (recovery is then modelled) or a measured recovery_s",
        )
        if self.kind == "jit":
            check(
                self.checkpoint_interval_iters in (None, 1),
                "checkpoint_interval_iters: jit commits every iteration (1)",
            )

    def checkpoint_s(self, iteration_s: float) -> float:
        """T_ckpt in seconds: given, or p x T_iter."""
        if self.checkpoint_cost_s is not None:
            return self.checkpoint_cost_s
        return (self.checkpoint_cost_ratio or 0.0) * iteration_s


@dataclass(kw_only=True, slots=True)
class MonteCarloConfig:
    """The event simulation that checks the closed form."""

    runs: int = 200
    """Independent simulated runs; 0 disables the Monte Carlo."""
    duration_h: float = 24.0
    """Fault-free length of each run (useful work), in hours."""
    seed: int = 0
    """Seed of the random generator; same seed, same numbers."""

    def __post_init__(self) -> None:
        check(
            self.runs == 0 or self.runs >= 2,
            f"runs: must be 0 (off) or >= 2 for a CI, got {self.runs}",
        )
        check(self.duration_h > 0, f"duration_h: must be > 0, got {self.duration_h}")


@dataclass(kw_only=True, slots=True)
class SweepConfig:
    """Grids for the ETTR-vs-HOF-ratio and ETTR-vs-MTTF plots (closed form)."""

    hof_ratios: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """HOF ratios of the ETTR-vs-HOF-ratio plot (Fig. 10 / 14 analogue)."""
    mttf_min: list[float] = field(default_factory=lambda: [5.0, 10.0, 20.0, 30.0, 60.0, 120.0])
    """MTTFs of the ETTR-vs-MTTF plot (Fig. 15 analogue), in minutes."""

    def __post_init__(self) -> None:
        check(all(0 <= h <= 1 for h in self.hof_ratios), "hof_ratios: each must be in [0, 1]")
        check(all(m > 0 for m in self.mttf_min), "mttf_min: each must be > 0")


@dataclass(kw_only=True, slots=True)
class Scenario:
    """A whole scenario file."""

    name: str
    """Short name, used in the JSON output and plot legends."""
    description: str = ""
    """One or two sentences: what the scenario models."""
    source: str = ""
    """Where its inputs come from; each block may say more."""
    workload: WorkloadConfig
    """The training job."""
    failures: FailureConfig
    """Failure rate and HOF ratio."""
    systems: list[SystemConfig]
    """Systems to compare; names must be unique."""
    monte_carlo: MonteCarloConfig = field(default_factory=MonteCarloConfig)
    """Event-simulation settings."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """Plot grids."""

    def __post_init__(self) -> None:
        check(len(self.systems) > 0, "systems: list at least one system")
        names = [s.name for s in self.systems]
        dup = [n for n in names if names.count(n) > 1]
        check(not dup, f"systems: duplicate name {dup[0]!r}" if dup else "")
        for s in self.systems:
            check(
                s.kind != "leto"
                or s.checkpoint_interval_iters is not None
                or s.max_checkpoint_interval_iters is not None,
                f"systems: {s.name!r}: Leto's Young interval diverges at 100 % HOFs; "
                "set max_checkpoint_interval_iters or checkpoint_interval_iters",
            )
            check(
                s.kind != "jit" or not self.workload.optimizer_sharded,
                f"systems: {s.name!r} is JIT-Ckpt, which needs replicated optimizer states; "
                "set workload.optimizer_sharded: false or drop it",
            )

    def system(self, name: str) -> SystemConfig:
        """The system called ``name``."""
        for s in self.systems:
            if s.name == name:
                return s
        raise KeyError(name)


_PROFILE_KEYS = ("source", "iteration_time_s", "systems")


def load_scenario(path: str | Path) -> Scenario:
    """Read, merge the profile into, and validate the scenario at ``path``."""
    path = Path(path)
    data = read_mapping(path, "scenario file")
    workload = data.get("workload")
    if isinstance(workload, dict) and workload.get("profile") is not None:
        data = _merge_profile(data, path)
    scenario = build(Scenario, data, where=str(path))
    log.debug("loaded scenario %s from %s", scenario.name, path)
    return scenario


def _merge_profile(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """Fill unset workload/system keys from the measured profile JSON."""
    profile_path = path.parent / str(data["workload"]["profile"])
    profile = read_mapping(profile_path, "profile")
    unknown = [k for k in profile if k not in _PROFILE_KEYS]
    if unknown:
        raise ConfigError(f"{profile_path}: {unknown_key(unknown[0], _PROFILE_KEYS)}")
    merged = copy.deepcopy(data)
    workload = merged["workload"]
    if "iteration_time_s" in profile and "iteration_model" not in workload:
        workload.setdefault("iteration_time_s", profile["iteration_time_s"])
    measured = profile.get("systems") or {}
    if not isinstance(measured, dict):
        raise ConfigError(f"{profile_path}: systems: expected a mapping of system name to timings")
    for system in merged.get("systems") or []:
        if isinstance(system, dict) and isinstance(measured.get(system.get("name")), dict):
            for key, value in measured[system["name"]].items():
                system.setdefault(key, value)
    log.info("filled %s from measured profile %s", path, profile_path)
    return merged
