"""The step-timing diagnostics (``leto.trainer.timing``): ``LETO_PHASE_TIMES=1`` waits for the
device at each phase boundary, ``LETO_PHASE_TIMES=host`` times the host alone without waiting,
and both reach a trainer through its environment, as ``LETO_SYNC_DEBUG`` does."""

from __future__ import annotations

import pytest
import torch

from leto.contract import GenerationEnv
from leto.trainer.env import TrainerEnv
from leto.trainer.timing import ENV_PHASE_TIMES, ENV_SYNC_DEBUG, PhaseTimes

CUDA = torch.device("cuda", 0)


def test_host_phase_times_do_not_wait_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", waits.append)
    monkeypatch.setenv(ENV_PHASE_TIMES, "host")
    phases = PhaseTimes(CUDA, 0.0)
    phases.mark("compute")
    assert phases.enabled and set(phases.fields()["phases_s"]) == {"compute"}
    assert waits == []
    monkeypatch.setenv(ENV_PHASE_TIMES, "1")  # the synchronised mode waits at each boundary
    PhaseTimes(CUDA, 0.0).mark("compute")
    assert waits == [CUDA]


def _env(**extra: str) -> dict[str, str]:
    generation = GenerationEnv(
        role="active", generation=0, pool_socket="/nonexistent", job_token="t"
    )
    return {
        **generation.to_environ(),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
        **extra,
    }


@pytest.mark.parametrize(
    ("setting", "phase_times", "sync_debug"),
    [({}, False, False), ({ENV_PHASE_TIMES: "host", ENV_SYNC_DEBUG: "1"}, True, True)],
)
def test_the_diagnostics_reach_the_trainer_s_environment(
    monkeypatch: pytest.MonkeyPatch, setting: dict[str, str], phase_times: bool, sync_debug: bool
) -> None:
    for name in (ENV_PHASE_TIMES, ENV_SYNC_DEBUG):
        monkeypatch.delenv(name, raising=False)
    for name, value in setting.items():
        monkeypatch.setenv(name, value)
    env = TrainerEnv.from_environ(_env())
    assert (env.phase_times, env.sync_debug) == (phase_times, sync_debug)


def test_the_profiler_writes_the_first_and_a_steady_step(monkeypatch, tmp_path) -> None:
    """``LETO_PROFILE_DIR``: the process's first step and the one ``LETO_PROFILE_AFTER``
    later are profiled, each table naming the ops its step ran; no other step is."""
    from torch import nn

    from tests.trainer.local import local_context

    after = 2
    steps = after + 2
    with local_context(monkeypatch, profile_dir=str(tmp_path), profile_after=after) as ctx:
        net = nn.Linear(4, 4)
        state = ctx.retain(net, torch.optim.AdamW(net.parameters()))
        for step in state.steps(steps):
            state.compute(lambda: net(torch.ones(2, 4)).sum().backward())
            state.step()
    tables = sorted(tmp_path.iterdir())
    assert [t.name.rsplit("-", 1)[1] for t in tables] == ["step0.txt", f"step{steps - 2}.txt"]
    first, steady = (t.read_text() for t in tables)
    assert first.startswith("step 0 (the process's first)")  # and the step ``after`` later:
    assert steady.startswith(f"step {steps - 2} (the process's steady)")
    assert "aten::addmm" in first and "aten::addmm" in steady


def test_the_profiled_steady_step_is_chosen_by_environment(monkeypatch) -> None:
    from leto.errors import ConfigError
    from leto.trainer.timing import ENV_PROFILE_AFTER

    monkeypatch.setenv(ENV_PROFILE_AFTER, "12")
    assert TrainerEnv.from_environ(_env()).profile_after == 12
    monkeypatch.setenv(ENV_PROFILE_AFTER, "0")
    with pytest.raises(ConfigError, match="LETO_PROFILE_AFTER=0"):
        TrainerEnv.from_environ(_env())
