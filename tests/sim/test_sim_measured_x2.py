"""The 2-GPU measured scenario: its profile comes from the stored bench result by
bench/recovery_gpu.py's own builder, and the simulator's predictions sit where
BENCHMARKS.md ("Simulator vs measurement, 2 GPUs") says they do."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from leto.sim.config import load_scenario
from leto.sim.evaluate import closed_form, with_failures

REPO = Path(__file__).resolve().parents[2]
RESULT = REPO / "bench/results/recovery_gpu_rmu_x2.json"
PROFILE = REPO / "bench/results/recovery_gpu_rmu_x2_profile.json"
SCENARIO = REPO / "configs/sim/h200x2-gpt1b-measured.yaml"


def _bench():
    spec = importlib.util.spec_from_file_location("recovery_gpu", REPO / "bench/recovery_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_profile_is_the_builders_output() -> None:
    result = json.loads(RESULT.read_text())
    profile = _bench().sim_profile(result)
    assert profile == json.loads(PROFILE.read_text())
    leto = profile["systems"]["Leto"]
    assert leto["detection_s"] + leto["init_s"] == pytest.approx(
        statistics.median(result["leto_recovery_s"])
    )
    assert profile["iteration_time_s"] == result["torchrun_mem"]["iteration_s"]


def test_profile_from_writes_beside_the_result(tmp_path: Path) -> None:
    copy = tmp_path / "run.json"
    copy.write_text(RESULT.read_text())
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench/recovery_gpu.py"), "--profile-from", str(copy)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "run_profile.json").read_text()) == json.loads(
        PROFILE.read_text()
    )


def test_profile_from_bad_input_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"date": "x"}))
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench/recovery_gpu.py"), "--profile-from", str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1 and "leto_phases_s" in proc.stderr
    assert not (tmp_path / "bad_profile.json").exists()


def test_prediction_next_to_measurement() -> None:
    result = json.loads(RESULT.read_text())
    scenario = load_scenario(SCENARIO)
    # The measured run's own schedule: 2 HOFs in 120 leto iterations.
    mttf_min = 120 * result["leto_iteration_s"] / 2 / 60
    run = closed_form(scenario, with_failures(scenario.failures, mttf_min=mttf_min))
    leto = run["Leto"]
    # The measured ETTR counts leto's own step time as productive: compare the recovery share.
    recovery_share = 1 - leto.recovery_to_mttf
    assert recovery_share < result["leto_ettr"] < recovery_share + 0.06
    assert leto.t_eff_s == pytest.approx(result["leto_iteration_s"], rel=1e-3)
    # torchrun's restart + load alone exceeds a failure every 17 s: Eq. 6 leaves its domain.
    assert not run["torchrun+mem"].valid and run["torchrun+mem"].ettr == 0.0
    # The paper's regime (one HOF every 10 min, the file's own failures).
    paper = closed_form(scenario)
    assert paper["torchrun+mem"].hof_recovery_s == pytest.approx(
        result["torchrun_mem"]["recovery_s"], rel=0.1
    )
    assert paper["Leto"].ettr == pytest.approx(0.421, abs=0.001)
    assert paper["torchrun+mem"].ettr == pytest.approx(0.776, abs=0.001)
