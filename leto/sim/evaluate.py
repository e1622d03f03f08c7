"""Evaluate a scenario: closed form and Monte Carlo per system, plus the plot sweeps."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np

from leto.errors import ConfigError
from leto.sim.closed_form import Prediction, predict, system_terms
from leto.sim.config import FailureConfig, Scenario
from leto.sim.montecarlo import MonteCarloResult, simulate

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SystemResult:
    """Closed form and (optionally) Monte Carlo for one system."""

    prediction: Prediction
    monte_carlo: MonteCarloResult | None


@dataclass(frozen=True, slots=True)
class ScenarioResult:
    """Everything ``leto-run sim`` reports for one scenario."""

    scenario: Scenario
    iteration_s: float
    systems: list[SystemResult]
    hof_sweep: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """Per system, (HOF ratio, closed-form ETTR) over ``sweep.hof_ratios``."""
    mttf_sweep: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    """Per system, (MTTF in minutes, closed-form ETTR) over ``sweep.mttf_min``."""

    def result(self, system: str) -> SystemResult:
        """The result of the system called ``system``."""
        for r in self.systems:
            if r.prediction.system == system:
                return r
        raise KeyError(system)


def with_failures(failures: FailureConfig, **changes: float | str) -> FailureConfig:
    """A copy of ``failures`` with ``changes`` applied and validated."""
    try:
        return dataclasses.replace(failures, **changes)  # type: ignore[arg-type]
    except ValueError as e:
        raise ConfigError(f"failures: {e}") from None


def closed_form(scenario: Scenario, failures: FailureConfig | None = None) -> dict[str, Prediction]:
    """Eq. 6 for every system of ``scenario`` (under ``failures`` if given)."""
    failures = failures or scenario.failures
    iteration_s = scenario.workload.iteration_s()
    return {
        s.name: predict(system_terms(s, iteration_s, failures), failures) for s in scenario.systems
    }


def evaluate(
    scenario: Scenario, *, runs: int | None = None, seed: int | None = None
) -> ScenarioResult:
    """Closed form, Monte Carlo (``runs`` overrides the scenario's) and sweeps."""
    mc = scenario.monte_carlo
    mc = dataclasses.replace(
        mc, runs=mc.runs if runs is None else runs, seed=mc.seed if seed is None else seed
    )
    rng = np.random.default_rng(mc.seed)
    iteration_s = scenario.workload.iteration_s()
    results = []
    for system in scenario.systems:
        terms = system_terms(system, iteration_s, scenario.failures)
        mc_result = simulate(terms, scenario.failures, mc, rng) if mc.runs > 0 else None
        results.append(SystemResult(predict(terms, scenario.failures), mc_result))
    hof = _sweep(scenario, "hof_ratio", scenario.sweep.hof_ratios)
    mttf = _sweep(scenario, "mttf_min", scenario.sweep.mttf_min)
    return ScenarioResult(scenario, iteration_s, results, hof, mttf)


def _sweep(
    scenario: Scenario, key: str, values: list[float]
) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {s.name: [] for s in scenario.systems}
    for value in values:
        for name, p in closed_form(
            scenario, with_failures(scenario.failures, **{key: value})
        ).items():
            out[name].append((value, p.ettr))
    return out
