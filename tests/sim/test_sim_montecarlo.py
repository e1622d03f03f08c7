"""The Monte Carlo event simulation against the closed form (Eq. 6)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from leto.sim import evaluate, load_scenario
from leto.sim.closed_form import predict, system_terms
from leto.sim.config import FailureConfig, MonteCarloConfig, SystemConfig
from leto.sim.montecarlo import simulate

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sim"


@pytest.mark.parametrize("mttf_min", [60.0, 120.0])
def test_agrees_with_closed_form_where_assumptions_hold(mttf_min: float) -> None:
    """Poisson failures, T_rec / MTTF <= 0.035, long runs: Eq. 6 lies inside the 95 % CI
    for every Table 3 system, while failures do happen (about 6-30 per run)."""
    scenario = load_scenario(CONFIGS / "kimi-moe-table3.yaml")
    scenario.failures = dataclasses.replace(scenario.failures, mttf_min=mttf_min, arrival="poisson")
    scenario.monte_carlo = MonteCarloConfig(runs=100, duration_h=24, seed=1)
    result = evaluate(scenario)
    for r in result.systems:
        assert r.prediction.recovery_to_mttf < 0.04
        assert r.monte_carlo is not None and r.monte_carlo.failures_per_run > 5
        assert r.monte_carlo.contains(r.prediction.ettr), (r.prediction, r.monte_carlo)


def _system(recovery_s: float, interval: int | None = None) -> SystemConfig:
    return SystemConfig(
        name="ckpt",
        kind="checkpoint",
        checkpoint_cost_s=1.0,
        init_s=recovery_s,
        checkpoint_interval_iters=interval,
    )


def test_disagrees_when_recovery_is_close_to_mttf() -> None:
    """T_rec = 0.8 MTTF breaks assumptions 1-2: many failures land inside a recovery and
    restart it instead of costing a full T_rec each, so the simulated ETTR sits well above
    Eq. 6, outside its CI."""
    failures = FailureConfig(mttf_min=10, hof_ratio=1.0)
    terms = system_terms(_system(recovery_s=470.0), 2.0, failures)
    closed = predict(terms, failures)
    assert 0.75 < closed.recovery_to_mttf < 0.85
    mc = simulate(
        terms, failures, MonteCarloConfig(runs=50, duration_h=12), np.random.default_rng(0)
    )
    assert mc.overlapping_per_run > 0.3 * mc.failures_per_run
    assert not mc.contains(closed.ettr)
    assert mc.ettr_mean > closed.ettr + 0.05


def test_no_failures_gives_the_steady_state_factor() -> None:
    """With failures practically absent, ETTR is T_iter / T_eff: checkpoint cost only."""
    failures = FailureConfig(mttf_min=1e12, hof_ratio=1.0)
    terms = system_terms(_system(recovery_s=30.0, interval=10), 2.0, failures)
    mc = simulate(
        terms, failures, MonteCarloConfig(runs=2, duration_h=10), np.random.default_rng(0)
    )
    assert mc.failures_per_run == 0
    assert mc.ettr_mean == pytest.approx(terms.iteration_s / terms.t_eff_s, rel=1e-3)
    assert mc.ettr_mean < 1.0


def test_failure_count_follows_the_wall_clock_rate() -> None:
    """Failures arrive at 1/MTTF over the whole elapsed run, recovery included (Eq. 2)."""
    failures = FailureConfig(mttf_min=10, hof_ratio=0.5)
    system = SystemConfig(
        name="leto",
        kind="leto",
        checkpoint_cost_s=1.0,
        init_s=10.0,
        ff_init_s=40.0,
        max_checkpoint_interval_iters=32,
    )
    terms = system_terms(system, 2.0, failures)
    mc = simulate(
        terms, failures, MonteCarloConfig(runs=40, duration_h=24), np.random.default_rng(3)
    )
    wall_h = 24 / mc.ettr_mean
    assert mc.failures_per_run == pytest.approx(wall_h * 60 / failures.mttf_min, rel=0.05)


def test_periodic_arrivals_phase_lock() -> None:
    """Exactly one failure every MTTF makes every run lose the same work per failure, so
    runs barely differ; uniform arrivals within each window do not."""
    failures = FailureConfig(mttf_min=10, hof_ratio=1.0, arrival="periodic")
    terms = system_terms(_system(recovery_s=30.0), 2.0, failures)
    mc = MonteCarloConfig(runs=30, duration_h=6)
    locked = simulate(terms, failures, mc, np.random.default_rng(0))
    spread = simulate(
        terms, dataclasses.replace(failures, arrival="window"), mc, np.random.default_rng(0)
    )
    assert locked.ettr_ci95 < spread.ettr_ci95
