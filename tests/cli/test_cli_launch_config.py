"""leto-run's LaunchConfig equals torchrun's for the same flags, and job files merge under flags.

The torchrun side is torch's own ``torch.distributed.run.run`` with ``elastic_launch``
replaced by a recorder, so the pre-processing leto-run mirrors is checked against the
real function, not against a copy.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.run as torchrun

from leto.config import FaultSpec, LetoConfig
from leto.errors import ConfigError
from leto_run.cli import build_launch


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PET_* overrides from the caller; OMP_NUM_THREADS preset so neither side sets it."""
    import os

    for name in [n for n in os.environ if n.startswith("PET_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A training script in a temporary cwd."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    return "train.py"


def torchrun_launch(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any, list[str]]:
    """What torchrun itself would launch for ``argv``: (LaunchConfig, entrypoint, args)."""
    seen: dict[str, Any] = {}

    def fake_elastic_launch(config: Any, entrypoint: Any) -> Any:
        seen.update(config=config, entrypoint=entrypoint)
        return lambda *args: seen.update(args=list(args))

    monkeypatch.setattr(torchrun, "elastic_launch", fake_elastic_launch)
    torchrun.run(torchrun.parse_args(argv))
    return seen["config"], seen["entrypoint"], seen["args"]


def comparable(config: Any, *, ignore_run_id: bool = False) -> dict[str, Any]:
    """LaunchConfig as plain data: logs_specs and numa_options by their attributes."""
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    specs = dict(vars(out.pop("logs_specs")))
    if specs.get("_root_log_dir", "").rpartition("/")[2].startswith("torchelastic_"):
        specs.pop("_root_log_dir")  # a fresh temporary directory on each side
    out["logs_specs"] = specs
    numa = out.pop("numa_options")
    out["numa_options"] = None if numa is None else vars(numa)
    if ignore_run_id:
        uuid.UUID(out.pop("run_id"))  # standalone or single node: a random uuid on each side
    return out


LAUNCH_MATRIX: dict[str, list[str]] = {
    "defaults": [],
    "nnodes-1": ["--nnodes", "1"],
    "nnodes-range-rdzv": [
        "--nnodes",
        "1:4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "host:29400",
        "--rdzv-id",
        "x",
        "--rdzv-conf",
        "timeout=30",
    ],
    "underscore-spellings": ["--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1"],
    "standalone": ["--standalone", "--nproc-per-node", "2"],
    "standalone-overrides-rdzv": ["--standalone", "--rdzv-backend", "etcd", "--rdzv-id", "y"],
    "max-restarts": ["--max-restarts", "3"],
    "monitor-interval": ["--monitor-interval", "0.5"],
    "static-multinode": [
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "1234",
    ],
    "static-master-port-single-node": ["--master-port", "29511"],
    "redirects-tee": ["--redirects", "3", "--tee", "1"],
    "redirects-per-rank": ["-r", "0:1,1:2", "-t", "3", "--local-ranks-filter", "0,1"],
    "role-start-method": [
        "--role",
        "trainer",
        "--start-method",
        "fork",
        "--event-log-handler",
        "x",
    ],
    "filters-signals": [
        "--duplicate-stdout-filters",
        "a,b",
        "--signals-to-handle",
        "SIGTERM",
        "--shutdown-timeout",
        "7",
        "--local-addr",
        "127.0.0.1",
        "--virtual-local-rank",
    ],
    "nproc-cpu": ["--nproc-per-node", "cpu"],
}


@pytest.mark.parametrize("flags", LAUNCH_MATRIX.values(), ids=LAUNCH_MATRIX.keys())
def test_launch_config_matches_torchrun(
    flags: list[str], script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = [*flags, script, "--lr", "0.1"]
    ours, cmd, cmd_args, leto = build_launch(argv)
    theirs, their_cmd, their_args = torchrun_launch(argv, monkeypatch)
    local = ours.rdzv_endpoint == "localhost:0"  # --standalone, or static with one node
    assert comparable(ours, ignore_run_id=local) == comparable(theirs, ignore_run_id=local)
    assert (cmd, cmd_args) == (their_cmd, their_args)
    assert leto == LetoConfig()


def test_launch_config_matches_torchrun_with_log_dir(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["--log-dir", str(tmp_path / "logs"), "--redirects", "3", "--tee", "1", script]
    ours, *_ = build_launch(argv)
    theirs, *_ = torchrun_launch(argv, monkeypatch)
    assert comparable(ours, ignore_run_id=True) == comparable(theirs, ignore_run_id=True)
    assert ours.logs_specs.root_log_dir == str(tmp_path / "logs")


@pytest.mark.parametrize(
    "argv",
    [["-m", "pkg.train", "--lr", "1"], ["--module", "pkg.train"], ["--no-python", "echo", "hi"]],
    ids=["module", "module-long", "no-python"],
)
def test_module_and_no_python_modes_match_torchrun(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither mode names a file, so no existence check happens."""
    monkeypatch.chdir(tmp_path)
    ours, cmd, cmd_args, _ = build_launch(argv)
    theirs, their_cmd, their_args = torchrun_launch(argv, monkeypatch)
    assert comparable(ours, ignore_run_id=True) == comparable(theirs, ignore_run_id=True)
    assert (cmd, cmd_args) == (their_cmd, their_args)


def test_run_path_mode_matches_torchrun(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _, cmd, cmd_args, _ = build_launch(["--run-path", script, "a"])
    _, their_cmd, their_args = torchrun_launch(["--run-path", script, "a"], monkeypatch)
    assert (cmd, cmd_args) == (their_cmd, their_args) == (torchrun.run_script_path, [script, "a"])


def test_script_args_are_not_parsed_as_leto_flags(script: str) -> None:
    """Everything after the script belongs to the script, Leto's flag names included."""
    _, _, cmd_args, leto = build_launch([script, "--config", "x.yaml", "--digest"])
    assert cmd_args == ["-u", script, "--config", "x.yaml", "--digest"]
    assert leto.digest is False


def test_leto_flags(script: str) -> None:
    _, _, _, leto = build_launch(
        [
            "--nproc-per-node",
            "2",
            "--no-dashboard",
            "--events",
            "ev.jsonl",
            "--consistency",
            "rmu",
            "--shadow-level",
            "1",
            "--recovery",
            "restart",
            "--digest",
            "--inject-fault",
            "rank=1,step=5,phase=update",
            "--inject-fault",
            "rank=0,step=2",
            script,
        ]
    )
    assert leto == LetoConfig(
        dashboard=False,
        events_file="ev.jsonl",
        consistency="rmu",
        shadow_level=1,
        recovery="restart",
        digest=True,
        faults=[FaultSpec(rank=1, step=5, phase="update"), FaultSpec(rank=0, step=2)],
    )


# ---------------------------------------------------------------------------- job file


def write_job(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def test_job_file_values_are_defaults_and_flags_win(script: str, tmp_path: Path) -> None:
    job = write_job(tmp_path, "launch: {nproc_per_node: 2, max_restarts: 1}\n")
    config, *_ = build_launch(["--config", job, "--max-restarts", "3", script])
    assert (config.nproc_per_node, config.max_restarts) == (2, 3)
    config, *_ = build_launch(["--config", job, script])
    assert (config.nproc_per_node, config.max_restarts) == (2, 1)


def test_job_file_equals_the_same_flags(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every launch option written in YAML gives torchrun's LaunchConfig for the flags."""
    job = write_job(
        tmp_path,
        "launch:\n  nnodes: '1:4'\n  nproc_per_node: 2\n  rdzv_backend: c10d\n"
        "  rdzv_endpoint: host:29400\n  rdzv_id: x\n  rdzv_conf: timeout=30\n"
        "  max_restarts: 3\n  monitor_interval: 0.5\n  redirects: 3\n  tee: 1\n"
        "  start_method: fork\n  virtual_local_rank: true\n",
    )
    flags = [
        "--nnodes",
        "1:4",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "host:29400",
        "--rdzv-id",
        "x",
        "--rdzv-conf",
        "timeout=30",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.5",
        "--redirects",
        "3",
        "--tee",
        "1",
        "--start-method",
        "fork",
        "--virtual-local-rank",
    ]
    ours, *_ = build_launch(["--config", job, script])
    theirs, *_ = torchrun_launch([*flags, script], monkeypatch)
    assert comparable(ours) == comparable(theirs)


def test_job_file_standalone_and_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    job = write_job(tmp_path, "launch: {standalone: true, module: true}\nscript: pkg.train\n")
    config, _, cmd_args, _ = build_launch(["--config", job])
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "localhost:0"
    assert cmd_args == ["-u", "-m", "pkg.train"]


def test_environment_ranks_between_flags_and_job_file(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = write_job(tmp_path, "launch: {max_restarts: 1}\n")
    monkeypatch.setenv("PET_MAX_RESTARTS", "5")
    assert build_launch(["--config", job, script])[0].max_restarts == 5
    assert build_launch(["--config", job, "--max-restarts", "3", script])[0].max_restarts == 3


def test_script_from_job_file_unless_given(script: str, tmp_path: Path) -> None:
    (tmp_path / "other.py").write_text("")
    job = write_job(tmp_path, "script: other.py\nscript_args: [--steps, 5]\n")
    _, _, cmd_args, _ = build_launch(["--config", job])
    assert cmd_args == ["-u", "other.py", "--steps", "5"]
    _, _, cmd_args, _ = build_launch(["--config", job, script, "--x"])
    assert cmd_args == ["-u", script, "--x"]


def test_leto_flags_override_job_file_and_faults_concatenate(script: str, tmp_path: Path) -> None:
    job = write_job(
        tmp_path,
        "launch: {nproc_per_node: 2}\n"
        "leto:\n  consistency: rmu\n  shadow_level: 1\n  digest: true\n"
        "  faults: [{rank: 1, step: 5, phase: update}]\n",
    )
    _, _, _, leto = build_launch(
        ["--config", job, "--shadow-level", "3", "--inject-fault", "rank=0,step=7", script]
    )
    assert (leto.consistency, leto.shadow_level, leto.digest) == ("rmu", 3, True)
    assert leto.faults == [FaultSpec(rank=1, step=5, phase="update"), FaultSpec(rank=0, step=7)]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("launch: {nproc_per_nodes: 2}\n", "launch: unknown key 'nproc_per_nodes'"),
        ("launch: {training_script: x.py}\n", "script/script_args at top level"),
        ("launch: {config: x.yaml}\n", "launch: unknown key 'config'"),
        ("launch: {max_restarts: many}\n", "launch.max_restarts: expected int, got 'many'"),
        ("launch: {standalone: 'yes'}\n", "launch.standalone: expected true or false"),
        ("launch: {start_method: thread}\n", "launch.start_method: 'thread' is not one of"),
        ("launch: {nnodes: [1, 2]}\n", "launch.nnodes: expected a single value"),
        ("lauch: {}\n", "unknown top-level key 'lauch'"),
        ("leto: {shadow_levle: 1}\n", "leto: unknown key 'shadow_levle'"),
        ("leto: {shadow_level: 4}\n", "leto.shadow_level: 4 is not one of 1, 2, 3"),
        ("script_args: --x\n", "script_args: expected a list"),
        ("- a\n", "expected a mapping at top level"),
        ("launch: [1, 2\n", "malformed YAML"),
    ],
)
def test_bad_job_file_names_file_and_key(
    text: str, expected: str, script: str, tmp_path: Path
) -> None:
    job = write_job(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        build_launch(["--config", job, script])
    assert expected in str(err.value) and job in str(err.value)
    assert "\n" not in str(err.value)


def test_malformed_yaml_names_line_and_column(script: str, tmp_path: Path) -> None:
    job = write_job(tmp_path, "launch:\n  nproc_per_node: 2\n  max_restarts: [1\n")
    with pytest.raises(ConfigError, match=rf"^{job}:\d+:\d+: malformed YAML"):
        build_launch(["--config", job, script])


def test_rmu_chunk_default_depends_on_the_trainers_device(script: str, tmp_path: Path) -> None:
    """Unset, ``rmu_chunk_bytes`` reaches the trainers as 0 and each resolves it for its
    device (256 MiB on a GPU, where 4 MiB chunks made a 1.1 B update launch-bound; 4 MiB on
    CPU); a value from the job file is passed through; a too-small one is refused."""
    from leto.config import default_rmu_chunk_bytes

    assert LetoConfig().rmu_chunk_bytes is None
    assert (default_rmu_chunk_bytes("cuda"), default_rmu_chunk_bytes("cpu")) == (256 << 20, 4 << 20)
    job = write_job(tmp_path, "leto:\n  rmu_chunk_bytes: 1048576\n")
    _, _, _, leto = build_launch(["--config", job, script])
    assert leto.rmu_chunk_bytes == 1 << 20
    with pytest.raises(ConfigError, match="rmu_chunk_bytes"):
        LetoConfig(rmu_chunk_bytes=1000)
