"""The simulator against the Leto paper's published numbers, from the paper's inputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from leto.sim import closed_form, load_scenario
from leto.sim.closed_form import checkpoint_cost_from_ettr, system_terms
from leto.sim.evaluate import with_failures

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sim"
TABLE5 = ["deepseek-v2-1k.yaml", "deepseek-v3-16k.yaml", "deepseek-v4-131k.yaml"]
PP = 0.01  # one percentage point


def test_table3_kimi_moe_from_gemini_row() -> None:
    """Table 3: Gemini+ 80.5 %, Leto 91.0 % (interval 11) and 94.2 % (interval 32).

    Inputs from the paper: T_iter 9.097 s (Table 6), MTTF 10 min (§8.2), intervals and
    measured recovery times 127 / 88 / 19 / 16 s (Table 3), RMU overhead 0.6 % (Table 1).
    Assumed: the paper gives no checkpoint cost for Kimi-MoE. It is calibrated here from
    Table 3's *Gemini* row (74.1 %) by inverting Eq. 6-7, and the other three rows are
    predicted from it. Also assumed: Table 1's overhead, measured on OLMoE, holds for Kimi.
    """
    scenario = load_scenario(CONFIGS / "kimi-moe-table3.yaml")
    f = scenario.failures
    iteration_s = scenario.workload.iteration_s()
    calibrated = checkpoint_cost_from_ettr(0.741, iteration_s, 11, 127.0, f.mttf_s)
    for system in scenario.systems:
        assert system.checkpoint_s(iteration_s) == pytest.approx(calibrated, abs=0.01)
    predicted = closed_form(scenario)
    assert predicted["Gemini+"].ettr == pytest.approx(0.805, abs=PP)
    assert predicted["Leto (I=11)"].ettr == pytest.approx(0.910, abs=PP)
    assert predicted["Leto (I=32)"].ettr == pytest.approx(0.942, abs=PP)
    assert predicted["Gemini+"].recovery_s == 88.0


def test_table3_leto_recovery_from_its_parts() -> None:
    """Leto's recovery T_init + L T_eff with L = 1/2 (Eq. 8) against Table 3's totals.

    From the paper: initialisation 15 s and 13 s (Table 3), T_iter (Table 6). Assumed:
    detection is inside the measured initialisation (the paper measures from injection).
    """
    scenario = load_scenario(CONFIGS / "kimi-moe-table3.yaml")
    iteration_s = scenario.workload.iteration_s()
    for name, measured_s in (("Leto (I=11)", 19.0), ("Leto (I=32)", 16.0)):
        system = scenario.system(name)
        terms = system_terms(system, iteration_s, scenario.failures)
        modelled = (
            system.detection_s + (system.init_s or 0.0) + terms.hof.lost_iters * terms.t_eff_s
        )
        assert modelled == pytest.approx(measured_s, abs=2.0)


def _ettr(path: str, mttf_min: float, hof_ratio: float) -> dict[str, float]:
    scenario = load_scenario(CONFIGS / path)
    failures = with_failures(scenario.failures, mttf_min=mttf_min, hof_ratio=hof_ratio)
    return {name: p.ettr for name, p in closed_form(scenario, failures).items()}


@pytest.mark.parametrize("path", TABLE5)
def test_fig14_range_at_10_min_mttf(path: str) -> None:
    """Fig. 14 (§8.6): Leto 95-96 % at 100 % HOFs, Gemini+ 83.0-85.3 %, Leto +3.5-4.3 pp at
    50 % and -0.3 pp at 0 %; each within one percentage point.

    From the paper: models and parallelism (Table 5), MTTF 10 min, HOF ratios, the FF-MTTF
    interval rule (§8.1), RMU overhead (Table 1). Assumed (the paper gives none for these
    runs): iteration times from the Appendix C model with assumed FLOP rate and microbatch
    counts; checkpoint cost p = 0.70 and init times 35 s / 15 s carried over from Kimi-MoE
    (Table 3); Leto's interval at 100 % HOFs capped at 32 (largest tested, Fig. 9).
    """
    full, half, none = (_ettr(path, 10, h) for h in (1.0, 0.5, 0.0))
    assert 0.95 - PP <= full["Leto"] <= 0.96 + PP
    assert 0.830 - PP <= full["Gemini+"] <= 0.853 + PP
    assert 0.035 - PP <= half["Leto"] - half["Gemini+"] <= 0.043 + PP
    assert none["Leto"] - none["Gemini+"] == pytest.approx(-0.003, abs=PP)
    assert none["Gemini+"] == full["Gemini+"]  # both failure classes take the same path


@pytest.mark.parametrize("path", TABLE5)
def test_fig15_at_30_min_mttf(path: str) -> None:
    """Appendix B (Fig. 15a): Leto leads by 0.7-1.8 pp at 50 % HOFs and 2.8-5.6 pp at
    100 %, and trails by 0.3-0.4 pp at 0 %; within one percentage point.

    Same inputs and assumptions as the Fig. 14 test. (At 60 min, Fig. 15b, the 100 %-HOF
    lead comes out 1.6-2.0 pp, below the paper's range: see docs/SIMULATOR.md.)
    """
    full, half, none = (_ettr(path, 30, h) for h in (1.0, 0.5, 0.0))
    assert 0.007 - PP <= half["Leto"] - half["Gemini+"] <= 0.018 + PP
    assert 0.028 - PP <= full["Leto"] - full["Gemini+"] <= 0.056 + PP
    assert -0.004 - PP <= none["Leto"] - none["Gemini+"] <= -0.003 + PP
