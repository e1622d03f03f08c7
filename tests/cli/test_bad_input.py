"""Bad input a user can type: one line on stderr that names the flag as typed (or the file
and key), exit code 2, no traceback, nothing launched.

Every case runs in-process through ``cli.main``: none gets as far as importing the agent.
The kinds whose failure would otherwise surface from deep inside torch, the agent or the
simulator also run as real ``leto-run`` processes (all at once: each one imports torch),
where a traceback would show. The example scripts check their own step counts.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import runpy
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from leto.config import LetoConfig
from leto_run import cli
from tests.launcher.harness import LETO_RUN, REPO

KIMI = str(REPO / "configs" / "sim" / "kimi-moe-table3.yaml")
NOT_UTF8 = b"leto:\n  digest: true  # caf\xe9, written in Latin-1\n"
TYPO_SCENARIO = (
    "name: x\nworkload: {name: w, num_gpus: 8, iteration_time_s: 1.0}\n"
    "failures: {mttf_min: 10, hof_ratoi: 1.0}\nsystems: []\n"
)

# name: (files to write next to train.py, argv, texts the one error line must contain)
CASES: dict[str, tuple[dict[str, str | bytes], list[str], tuple[str, ...]]] = {
    # the job file and the script
    "malformed-yaml": (
        {"job.yaml": "launch:\n  nproc_per_node: [2\n"},
        ["--config", "job.yaml"],
        ("job.yaml:3:1: malformed YAML",),
    ),
    "yaml-not-mapping": (
        {"job.yaml": "just text\n"},
        ["--config", "job.yaml"],
        ("job.yaml: expected a mapping",),
    ),
    "missing-config": (
        {},
        ["--config", "nope.yaml", "train.py"],
        ("config file 'nope.yaml' does not exist",),
    ),
    "missing-script": (
        {},
        ["--nproc-per-node", "2", "nope.py"],
        ("training script 'nope.py' does not exist",),
    ),
    "missing-script-from-yaml": (
        {"job.yaml": "script: gone.py\n"},
        ["--config", "job.yaml"],
        ("training script 'gone.py' does not exist",),
    ),
    "no-script": ({}, [], ("no training script",)),
    "wrong-type-launch": (
        {"job.yaml": "launch: {max_restarts: two}\n"},
        ["--config", "job.yaml"],
        ("job.yaml: launch.max_restarts: expected int, got 'two'",),
    ),
    "wrong-type-leto": (
        {"job.yaml": "leto: {digest: maybe}\n"},
        ["--config", "job.yaml"],
        ("job.yaml: leto.digest: expected true or false",),
    ),
    "wrong-type-faults": (
        {"job.yaml": "leto: {faults: [{rank: a, step: 1}]}\n"},
        ["--config", "job.yaml"],
        ("job.yaml: leto.faults[0].rank: expected int",),
    ),
    # torchrun's values, named as given: flag as typed, PET_* variable or job file key
    "nproc-zero": ({}, ["--nproc-per-node", "0", "train.py"], ("--nproc-per-node:", ">= 1")),
    "nproc-negative": ({}, ["--nproc_per_node", "-1", "train.py"], ("--nproc_per_node:", "-1")),
    "nproc-word": ({}, ["--nproc-per-node", "lots", "train.py"], ("--nproc-per-node:", "'lots'")),
    "nproc-job-file": (
        {"job.yaml": "launch: {nproc_per_node: 0}\n"},
        ["--config", "job.yaml", "train.py"],
        ("job.yaml: launch.nproc_per_node:", ">= 1"),
    ),
    "max-restarts-negative": ({}, ["--max-restarts", "-1", "train.py"], ("--max-restarts:",)),
    "max-restarts-word": ({}, ["--max-restarts", "x", "train.py"], ("--max-restarts", "'x'")),
    "nnodes-zero": ({}, ["--nnodes", "0", "train.py"], ("--nnodes '0'",)),
    "nnodes-three-parts": ({}, ["--nnodes", "1:2:3", "train.py"], ("--nnodes '1:2:3'", "MIN:MAX")),
    "consistency-not-a-choice": (
        {},
        ["--consistency", "magic", "train.py"],
        ("--consistency", "'magic'"),
    ),
    "unknown-flag": (
        {},
        ["--nproc-per-nod", "2", "--bogus", "train.py"],
        ("unrecognized arguments: --bogus",),
    ),
    # the events file: the agent would open it only after the launch
    "events-missing-dir": (
        {},
        ["--events", "missing/ev.jsonl", "train.py"],
        ("--events:", "'missing/ev.jsonl'"),
    ),
    "events-under-a-file": (
        {},
        ["--events", "train.py/ev.jsonl", "train.py"],
        ("--events:", "not a directory"),
    ),
    "events-job-file": (
        {"job.yaml": "leto: {events_file: missing/ev.jsonl}\n"},
        ["--config", "job.yaml", "train.py"],
        ("job.yaml: leto.events_file:", "does not exist"),
    ),
    "job-file-not-utf8": (
        {"job.yaml": NOT_UTF8},
        ["--config", "job.yaml", "train.py"],
        ("'job.yaml'", "not UTF-8"),
    ),
    # faults: every key named, and none that can never fire
    "fault-rank-beyond-the-job": (
        {},
        ["--nproc-per-node", "2", "--inject-fault", "rank=7,step=1", "train.py"],
        ("--inject-fault 'rank=7,step=1':", "rank 7", "2 ranks"),
    ),
    "fault-rank-beyond-two-nodes": (
        {},
        ["--nnodes", "2", "--nproc-per-node", "2", "--inject-fault", "rank=4,step=1", "train.py"],
        ("--inject-fault 'rank=4,step=1':", "4 ranks"),
    ),
    "fault-rank-beyond-job-file": (
        {"job.yaml": "leto: {faults: [{rank: 2, step: 1}]}\n"},
        ["--config", "job.yaml", "train.py"],
        ("job.yaml: leto.faults[0]:", "rank 2", "1 ranks"),
    ),
    "fault-step-missing": (
        {},
        ["--inject-fault", "rank=1", "train.py"],
        ("--inject-fault 'rank=1':", "step is missing"),
    ),
    "fault-step-missing-job-file": (
        {"job.yaml": "leto: {faults: [{rank: 0}]}\n"},
        ["--config", "job.yaml", "train.py"],
        ("job.yaml: leto.faults[0]: step is missing",),
    ),
    "fault-not-key-value": (
        {},
        ["--inject-fault", "rank1", "train.py"],
        ("--inject-fault 'rank1':", "key=value"),
    ),
    "fault-unknown-key": (
        {},
        ["--inject-fault", "rnak=0,step=2", "train.py"],
        ("--inject-fault 'rnak=0,step=2':", "unknown key 'rnak'; did you mean 'rank'?"),
    ),
    "fault-bad-value": (
        {},
        ["--inject-fault", "rank=one,step=2", "train.py"],
        ("rank: expected int, got 'one'",),
    ),
    "fault-bad-phase": (
        {},
        ["--inject-fault", "rank=0,step=1,phase=fwd", "train.py"],
        ("phase: 'fwd' is not one of",),
    ),
    "fault-unknown-phase": (
        {},
        ["--inject-fault", "rank=0,step=1,phase=x", "train.py"],
        ("--inject-fault 'rank=0,step=1,phase=x':", "phase: 'x' is not one of"),
    ),
    "fault-key-twice": (
        {},
        ["--inject-fault", "rank=0,step=1,step=2", "train.py"],
        ("step is given twice",),
    ),
    # Leto's settings: the flag when a flag set the value, the file and key otherwise
    "hang-timeout-flag": (
        {},
        ["--hang-timeout", "-1", "train.py"],
        ("--hang-timeout: must be > 0",),
    ),
    "hang-timeout-equals": (
        {},
        ["--hang-timeout=-1", "train.py"],
        ("--hang-timeout: must be > 0",),
    ),
    "hang-timeout-abbreviated": ({}, ["--hang", "-1", "train.py"], ("--hang: must be > 0",)),
    "hang-timeout-job-file": (
        {"job.yaml": "leto: {hang_timeout_s: -1}\n"},
        ["--config", "job.yaml", "train.py"],
        ("job.yaml: leto.hang_timeout_s: must be > 0",),
    ),
    "first-step-timeout": (
        {},
        ["--first-step-timeout", "5", "train.py"],
        ("--first-step-timeout: must be >=",),
    ),
    "checkpoint-every-zero": (
        {},
        ["--checkpoint-dir", "ck", "--checkpoint-every", "0", "train.py"],
        ("--checkpoint-every: must be >= 1",),
    ),
    "checkpoint-every-without-dir": (
        {},
        ["--checkpoint-every", "5", "train.py"],
        ("--checkpoint-every needs --checkpoint-dir",),
    ),
    "metrics-port-out-of-range": (
        {},
        ["--metrics-port", "70000", "train.py"],
        ("--metrics-port: must be in [0, 65535]",),
    ),
    # unknown keys suggest the closest
    "unknown-leto-key": (
        {"job.yaml": "leto: {hang_timeout: 5}\n"},
        ["--config", "job.yaml", "train.py"],
        ("job.yaml: leto: unknown key 'hang_timeout'; did you mean 'hang_timeout_s'?",),
    ),
    "unknown-leto-key-misspelt": (
        {"job.yaml": "leto: {consistancy: rmu}\n"},
        ["--config", "job.yaml"],
        ("job.yaml: leto: unknown key 'consistancy'; did you mean 'consistency'?",),
    ),
    "unknown-nested-key": (
        {"job.yaml": "leto: {checkpoint: {dir: ck, intervall: 5}}\n"},
        ["--config", "job.yaml", "train.py"],
        ("job.yaml: leto.checkpoint: unknown key 'intervall'; did you mean 'interval_steps'?",),
    ),
    "unknown-launch-key": (
        {"job.yaml": "launch: {nproc-per-node: 2}\n"},
        ["--config", "job.yaml", "train.py"],
        ("job.yaml: launch: unknown key 'nproc-per-node'; did you mean 'nproc_per_node'?",),
    ),
    "unknown-launch-key-unlike-any": (
        {"job.yaml": "launch: {nprocs: 2}\n"},
        ["--config", "job.yaml"],
        ("job.yaml: launch: unknown key 'nprocs'", "e.g. nproc_per_node"),
    ),
    "leto-key-under-launch": (
        {"job.yaml": "launch: {hang_timeout_s: 5}\n"},
        ["--config", "job.yaml", "train.py"],
        ("launch: unknown key 'hang_timeout_s'", "under leto:"),
    ),
    "unknown-top-level-key": (
        {"job.yaml": "scirpt: train.py\n"},
        ["--config", "job.yaml"],
        ("unknown top-level key 'scirpt' (did you mean 'script'?)",),
    ),
    "unknown-top-level-key-dropped-letter": (
        {"job.yaml": "scrpt: train.py\n"},
        ["--config", "job.yaml"],
        ("job.yaml: unknown top-level key 'scrpt' (did you mean 'script'?)",),
    ),
    # the simulator, in the launcher's style
    "sim-scenario-not-utf8": (
        {"scenario.yaml": NOT_UTF8},
        ["sim", "scenario.yaml"],
        ("'scenario.yaml'", "not UTF-8"),
    ),
    "sim-plots-under-a-file": (
        {},
        ["sim", "--plots", "train.py/plots", KIMI],
        ("--plots 'train.py/plots'", "is a file"),
    ),
    "sim-json-under-a-file": (
        {},
        ["sim", "--json", "train.py/out.json", KIMI],
        ("--json 'train.py/out.json'",),
    ),
    "sim-unknown-key": (
        {"scenario.yaml": TYPO_SCENARIO},
        ["sim", "scenario.yaml"],
        ("scenario.yaml: failures: unknown key 'hof_ratoi'; did you mean 'hof_ratio'?",),
    ),
    "sim-no-scenario": ({}, ["sim"], ("Missing argument",)),
    "sim-unknown-option": ({}, ["sim", "--bogus", KIMI], ("--bogus",)),
    "sim-bad-option-value": (
        {},
        ["sim", "--monte-carlo-runs", "-1", KIMI],
        ("--monte-carlo-runs",),
    ),
}

# The cases that also run as real processes: one per kind of bad input.
SUBPROCESS_CASES = (
    "nproc-zero",
    "events-missing-dir",
    "job-file-not-utf8",
    "malformed-yaml",
    "unknown-top-level-key",
    "unknown-launch-key",
    "unknown-leto-key",
    "wrong-type-launch",
    "missing-config",
    "missing-script",
    "fault-not-key-value",
    "sim-scenario-not-utf8",
    "sim-plots-under-a-file",
    "fault-rank-beyond-the-job",
    "sim-no-scenario",
)

# script, argv, the flag the one line must name
EXAMPLES: dict[str, tuple[str, list[str], str]] = {
    "train_gpt-negative": ("train_gpt.py", ["--steps", "-5"], "--steps"),
    "train_gpt-zero": ("train_gpt.py", ["--steps", "0"], "--steps"),
    "train_gpt-grad-accum": ("train_gpt.py", ["--grad-accum", "0"], "--grad-accum"),
    "train_scheduled": ("train_scheduled.py", ["--steps", "0"], "--steps"),
    "finetune_lora": ("finetune_lora.py", ["--steps", "0"], "--steps"),
    "plain_ddp": ("plain_ddp.py", ["--steps", "0"], "--steps"),
    "torchrun_gpt_ckpt": (
        "torchrun_gpt_ckpt.py",
        ["--ckpt-dir", "ck", "--ckpt-every", "0"],
        "--ckpt-every",
    ),
    "torchrun_gpt_ckpt-grad-accum": (
        "torchrun_gpt_ckpt.py",
        ["--ckpt-dir", "ck", "--grad-accum", "0"],
        "--grad-accum",
    ),
    "megatron_gpt": ("megatron_gpt.py", ["--train-iters", "0"], "--train-iters"),
}


def job_dir(path: Path, files: dict[str, str | bytes]) -> Path:
    """A working directory with a train.py (that must never run) and the case's files."""
    (path / "train.py").write_text("raise SystemExit('must not run')\n")
    for name, content in files.items():
        target = path / name
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
    return path


def assert_one_line_error(returncode: object, stderr: str, expected: tuple[str, ...]) -> None:
    assert "Traceback" not in stderr, stderr
    assert returncode == 2, (returncode, stderr)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines == stderr.splitlines(), stderr
    assert lines[0].startswith(("leto-run: error: ", "leto-run sim: error: ")), lines[0]
    for text in expected:
        assert text in lines[0], (text, lines[0])


@pytest.mark.parametrize("name", CASES)
def test_bad_input_in_process(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    files, argv, expected = CASES[name]
    monkeypatch.chdir(job_dir(tmp_path, files))
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert_one_line_error(exit_.value.code, capsys.readouterr().err, expected)


def test_every_leto_flag_maps_onto_one_setting() -> None:
    """LETO_FLAGS covers the leto group, each row a real setting; one no flag gave is named
    by its key."""
    parser = cli.make_parser()
    dests = {a.dest for a in parser._actions}
    hints = typing.get_type_hints(LetoConfig)
    for flag, setting in cli.LETO_FLAGS.items():
        assert any(
            flag in a.option_strings and a.dest == cli._dest(setting) for a in parser._actions
        )
        head, _, rest = setting.partition(".")
        assert head in hints, flag
        if rest:
            section = cli._section_class(head)
            assert rest in {f.name for f in dataclasses.fields(section)}, flag
    assert dests >= {cli._dest(s) for s in cli.LETO_FLAGS.values()}
    (group,) = [g for g in parser._action_groups if g.title == "leto"]
    flags = {o for a in group._group_actions for o in a.option_strings}
    assert flags - {"--config", "--version"} == set(cli.LETO_FLAGS)  # a new flag needs its row
    origins = cli.Origins(parser=parser, options=["--digest"])
    assert origins.leto("leto.hang_timeout_s") == "leto.hang_timeout_s"
    assert origins.leto("leto.digest") == "--digest"


def test_version_names_leto_run_and_torch(capsys: pytest.CaptureFixture) -> None:
    import torch

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"leto-run {importlib.metadata.version('leto')} (torch {torch.__version__})"


def test_sim_takes_dash_h_like_help(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    shown = []
    for flag in ("-h", "--help"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["sim", flag])
        assert exit_.value.code == 0
        shown.append(capsys.readouterr().out)
    assert shown[0] == shown[1] and shown[0].startswith("Usage: leto-run sim")


# ---------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """The SUBPROCESS_CASES, ``--version`` and ``sim -h``, run at once."""
    commands: dict[str, tuple[list[str], Path]] = {}
    for name in SUBPROCESS_CASES:
        files, argv, _ = CASES[name]
        commands[name] = ([*LETO_RUN, *argv], job_dir(tmp_path_factory.mktemp(name), files))
    commands["--version"] = ([*LETO_RUN, "--version"], tmp_path_factory.mktemp("version"))
    commands["sim -h"] = ([*LETO_RUN, "sim", "-h"], tmp_path_factory.mktemp("sim-h"))
    procs = {
        name: subprocess.Popen(
            cmd, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for name, (cmd, cwd) in commands.items()
    }
    results = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_input_is_one_line_in_a_real_process(
    name: str, processes: dict[str, subprocess.CompletedProcess]
) -> None:
    result = processes[name]
    assert "Traceback" not in result.stdout
    assert_one_line_error(result.returncode, result.stderr, CASES[name][2])


def test_version_and_sim_help_in_a_real_process(
    processes: dict[str, subprocess.CompletedProcess],
) -> None:
    version = processes["--version"]
    assert version.returncode == 0 and version.stderr == ""
    assert version.stdout.startswith("leto-run ") and "(torch " in version.stdout
    help_ = processes["sim -h"]
    assert help_.returncode == 0 and help_.stderr == ""
    assert help_.stdout.startswith("Usage: leto-run sim") and "--plots" in help_.stdout


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_refuses_a_count_below_one(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Run as a script (in this process: torch is imported already), before any training."""
    script, argv, flag = EXAMPLES[name]
    path = str(REPO / "examples" / script)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [path, *argv])
    monkeypatch.setattr(sys, "path", [str(REPO / "examples"), *sys.path])
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what megatron_gpt.py sets
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(path, run_name="__main__")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines() == [err.strip()], err
    assert err.startswith(f"{script}: error: {flag} must be >= 1"), err
