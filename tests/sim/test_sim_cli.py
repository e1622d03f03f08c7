"""``leto-run sim`` through its click command: outputs, profiles and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from leto.sim import closed_form, load_scenario
from leto_run.sim_cmd import sim

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "sim"
KIMI = CONFIGS / "kimi-moe-table3.yaml"


def _scenario(
    tmp_path: Path, edit: dict[str, object] | None = None, text: str | None = None
) -> Path:
    """Write a copy of the Kimi scenario, with top-level ``edit`` merged in, or raw ``text``."""
    path = tmp_path / "scenario.yaml"
    if text is None:
        data = yaml.safe_load(KIMI.read_text())
        data.update(edit or {})
        text = yaml.safe_dump(data)
    path.write_text(text)
    return path


def _kimi_with(**changes: object) -> dict[str, object]:
    data = yaml.safe_load(KIMI.read_text())
    return data | changes


BAD = {
    "unknown key": ({"failures": {"mttf_min": 10, "hof_ratoi": 1.0}}, "hof_ratoi"),
    "negative mttf": ({"failures": {"mttf_min": -1}}, "mttf_min"),
    "ratio above one": ({"failures": {"mttf_min": 10, "hof_ratio": 1.5}}, "hof_ratio"),
    "wrong type": ({"failures": {"mttf_min": "ten"}}, "mttf_min"),
    "bad choice": ({"failures": {"mttf_min": 10, "arrival": "burst"}}, "arrival"),
    "no systems": ({"systems": []}, "systems"),
    "missing key": ({"workload": {"num_gpus": 8, "iteration_time_s": 1.0}}, "name"),
    "jit on sharded": (
        {"systems": [{"name": "JIT", "kind": "jit", "init_s": 10}]},
        "replicated optimizer",
    ),
    "leto without cap": (
        {"systems": [{"name": "L", "kind": "leto", "init_s": 10}]},
        "max_checkpoint",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_scenario_is_one_line(tmp_path: Path, case: str) -> None:
    edit, needle = BAD[case]
    path = _scenario(tmp_path, edit)
    result = CliRunner().invoke(sim, [str(path)])
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert str(path) in lines[0] and needle in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "text", ["name: [unclosed\n", "- just\n- a list\n"], ids=["malformed", "not a mapping"]
)
def test_unreadable_scenario_is_one_line(tmp_path: Path, text: str) -> None:
    path = _scenario(tmp_path, text=text)
    result = CliRunner().invoke(sim, [str(path)])
    assert result.exit_code != 0
    assert len(result.output.strip().splitlines()) == 1 and str(path) in result.output


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(sim, [str(tmp_path / "nope.yaml")])
    assert result.exit_code != 0
    assert len(result.output.strip().splitlines()) == 1 and "does not exist" in result.output


def test_json_and_plots(tmp_path: Path) -> None:
    """The JSON holds the closed form of every system; three PNGs are written."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out.json"
    args = [
        str(KIMI),
        "--json",
        str(out),
        "--plots",
        str(tmp_path / "plots"),
        "--monte-carlo-runs",
        "4",
    ]
    result = CliRunner().invoke(sim, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    expected = closed_form(load_scenario(KIMI))
    systems = doc["scenarios"][0]["systems"]
    assert {s["closed_form"]["system"]: s["closed_form"]["ettr"] for s in systems} == {
        name: p.ettr for name, p in expected.items()
    }
    assert all(s["monte_carlo"]["runs"] == 4 for s in systems)
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["ettr_vs_hof_ratio.png", "ettr_vs_mttf.png"]  # one scale: no plot against it
    assert all((tmp_path / "plots" / p).stat().st_size > 1000 for p in pngs)


def test_plots_against_scale_need_two_scales(tmp_path: Path) -> None:
    scenarios = [str(CONFIGS / "deepseek-v2-1k.yaml"), str(CONFIGS / "deepseek-v3-16k.yaml")]
    result = CliRunner().invoke(
        sim, [*scenarios, "--plots", str(tmp_path / "plots"), "--monte-carlo-runs", "2"]
    )
    assert result.exit_code == 0, result.output
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["ettr_vs_hof_ratio.png", "ettr_vs_mttf.png", "ettr_vs_scale.png"]


def test_override_out_of_range_is_one_line() -> None:
    result = CliRunner().invoke(sim, [str(KIMI), "--hof-ratio", "2", "--monte-carlo-runs", "0"])
    assert result.exit_code != 0
    assert len(result.output.strip().splitlines()) == 1 and "hof_ratio" in result.output


def test_measured_profile_fills_unset_keys(tmp_path: Path) -> None:
    """A bench profile supplies T_iter and per-system timings; scenario keys win."""
    profile = {
        "source": "bench/recovery.py on 2 GPUs",
        "iteration_time_s": 0.5,
        "systems": {
            "torchrun": {"init_s": 20.0, "checkpoint_cost_s": 0.4},
            "Leto": {"init_s": 2.0, "ff_init_s": 20.0},
        },
    }
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    scenario = {
        "name": "ours",
        "workload": {"name": "gpt-small", "num_gpus": 2, "profile": "profile.json"},
        "failures": {"mttf_min": 30, "hof_ratio": 1.0},
        "monte_carlo": {"runs": 0},
        "systems": [
            {"name": "torchrun", "kind": "checkpoint"},
            {"name": "Leto", "kind": "leto", "init_s": 3.0, "checkpoint_interval_iters": 100},
        ],
    }
    path = tmp_path / "ours.yaml"
    path.write_text(yaml.safe_dump(scenario))
    loaded = load_scenario(path)
    assert loaded.workload.iteration_s() == 0.5
    assert loaded.system("torchrun").init_s == 20.0
    assert loaded.system("Leto").init_s == 3.0  # the scenario's own value wins
    result = CliRunner().invoke(sim, [str(path)])
    assert result.exit_code == 0, result.output
    assert "torchrun" in result.output


def test_profile_with_unknown_key_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "profile.json").write_text(json.dumps({"iteration_s": 0.5}))
    data = _kimi_with()
    data["workload"] = {"name": "x", "num_gpus": 2, "profile": "profile.json"}
    path = _scenario(tmp_path, data)
    result = CliRunner().invoke(sim, [str(path)])
    assert result.exit_code != 0
    assert len(result.output.strip().splitlines()) == 1 and "iteration_s" in result.output
