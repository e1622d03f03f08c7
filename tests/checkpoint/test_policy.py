"""Young's interval for the FF rate, and the checkpoint section's validation."""

from __future__ import annotations

import math

import pytest

from leto.checkpoint import young_interval_steps
from leto.config import CheckpointConfig, LetoConfig, from_dict
from leto.errors import ConfigError


def test_young_interval_uses_the_fatal_failure_mttf() -> None:
    cfg = CheckpointConfig(dir="x", mttf_s=3600.0, hof_ratio=0.75)
    assert cfg.ff_mttf_s == 14400.0
    # sqrt(2 * C * MTTF_FF) / T_iter = sqrt(2 * 2 * 14400) / 0.5 = 480 steps
    assert young_interval_steps(2.0, 0.5, cfg) == 480
    all_failures = CheckpointConfig(dir="x", mttf_s=3600.0, hof_ratio=0.0)
    assert young_interval_steps(2.0, 0.5, all_failures) == round(math.sqrt(2 * 2 * 3600) / 0.5)
    assert young_interval_steps(1e-6, 10.0, cfg) == 1


def test_checkpoint_section_is_validated() -> None:
    cfg = from_dict(
        LetoConfig, {"checkpoint": {"dir": "/c", "interval_steps": 50}}, where="job.leto"
    )
    assert cfg.checkpoint == CheckpointConfig(dir="/c", interval_steps=50)
    with pytest.raises(ConfigError, match="hof_ratio"):
        CheckpointConfig(dir="x", hof_ratio=1.0)
    with pytest.raises(ConfigError, match="unknown key 'intervall'"):
        from_dict(LetoConfig, {"checkpoint": {"dir": "/c", "intervall": 5}}, where="job.leto")
    with pytest.raises(ConfigError, match="first_step_timeout_s"):
        LetoConfig(hang_timeout_s=10.0, first_step_timeout_s=5.0)
