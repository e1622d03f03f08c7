"""leto-run as a user meets it: --help, one-line errors for bad input, the ``sim`` rule.

Every bad-input case runs in-process through ``main``; the kinds the launcher issue names
also run as real ``leto-run`` processes (concurrently: each one imports torch), where a
traceback would show. None launches a worker: each fails before the agent is imported.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from leto_run import cli

LETO_RUN = Path(sys.executable).with_name("leto-run")

# name: (job file text or None, argv, text the one-line error must contain)
BAD_INPUT: dict[str, tuple[str | None, list[str], str]] = {
    "malformed-yaml": ("launch:\n  nproc_per_node: [2\n", ["--config", "job.yaml"], "job.yaml:"),
    "yaml-not-mapping": ("just text\n", ["--config", "job.yaml"], "expected a mapping"),
    "unknown-top-level-key": ("scrpt: train.py\n", ["--config", "job.yaml"], "'scrpt'"),
    "unknown-launch-key": ("launch: {nprocs: 2}\n", ["--config", "job.yaml"], "'nprocs'"),
    "unknown-leto-key": ("leto: {consistancy: rmu}\n", ["--config", "job.yaml"], "'consistancy'"),
    "wrong-type-launch": ("launch: {max_restarts: two}\n", ["--config", "job.yaml"], "restarts"),
    "wrong-type-leto": ("leto: {digest: maybe}\n", ["--config", "job.yaml"], "leto.digest"),
    "wrong-type-faults": (
        "leto: {faults: [{rank: a, step: 1}]}\n",
        ["--config", "job.yaml"],
        "faults[0].rank",
    ),
    "missing-config": (None, ["--config", "nope.yaml", "train.py"], "'nope.yaml' does not exist"),
    "missing-script": (None, ["--nproc-per-node", "2", "nope.py"], "'nope.py' does not exist"),
    "missing-script-from-yaml": ("script: gone.py\n", ["--config", "job.yaml"], "'gone.py'"),
    "no-script": (None, [], "no training script"),
    "bad-fault-syntax": (None, ["--inject-fault", "rank1", "train.py"], "--inject-fault"),
    "bad-fault-phase": (None, ["--inject-fault", "rank=0,step=1,phase=x", "train.py"], "phase"),
    "bad-flag-value": (None, ["--max-restarts", "x", "train.py"], "--max-restarts"),
    "bad-choice": (None, ["--consistency", "magic", "train.py"], "--consistency"),
    "bad-nnodes": (None, ["--nnodes", "1:2:3", "train.py"], "--nnodes"),
    "unknown-flag": (None, ["--nproc-per-nod", "2", "--bogus", "train.py"], "--bogus"),
}


# One per kind of bad input the launcher issue lists, run as real processes.
SUBPROCESS_CASES = (
    "malformed-yaml",
    "unknown-top-level-key",
    "unknown-launch-key",
    "unknown-leto-key",
    "wrong-type-launch",
    "missing-config",
    "missing-script",
    "bad-fault-syntax",
)


def job_dir(path: Path, job: str | None) -> Path:
    """A working directory with a train.py (that must never run) and the job file, if any."""
    (path / "train.py").write_text("raise SystemExit('must not run')\n")
    if job is not None:
        (path / "job.yaml").write_text(job)
    return path


def assert_one_line_error(returncode: int | str | None, stderr: str, expected: str) -> None:
    assert returncode not in (0, None)
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("leto-run: error: ") and expected in lines[0], lines[0]


@pytest.mark.parametrize("name", BAD_INPUT)
def test_bad_input_in_process(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    job, argv, expected = BAD_INPUT[name]
    monkeypatch.chdir(job_dir(tmp_path, job))
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert_one_line_error(exit_.value.code, capsys.readouterr().err, expected)


@pytest.fixture(scope="module")
def bad_input_results(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, subprocess.CompletedProcess]:
    """Run the SUBPROCESS_CASES at once, each in its own directory."""
    procs = {}
    for name in SUBPROCESS_CASES:
        job, argv, _ = BAD_INPUT[name]
        cwd = job_dir(tmp_path_factory.mktemp(name), job)
        procs[name] = subprocess.Popen(
            [str(LETO_RUN), *argv],
            cwd=cwd,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_input_is_one_line_without_traceback(
    name: str, bad_input_results: dict[str, subprocess.CompletedProcess]
) -> None:
    result = bad_input_results[name]
    assert "Traceback" not in result.stderr + result.stdout
    assert_one_line_error(result.returncode, result.stderr, BAD_INPUT[name][2])


def run_leto(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LETO_RUN), *argv], check=False, cwd=cwd, text=True, capture_output=True, timeout=120
    )


def test_help_lists_every_torchrun_flag_the_leto_group_and_sim() -> None:
    from torch.distributed.run import get_args_parser

    result = run_leto("--help")
    assert result.returncode == 0, result.stderr
    shown = set(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", result.stdout))
    torchrun_flags = {s for a in get_args_parser()._actions for s in a.option_strings}
    assert torchrun_flags - shown == set()
    leto_flags = {
        "--config",
        "--no-dashboard",
        "--events",
        "--inject-fault",
        "--consistency",
        "--shadow-level",
        "--recovery",
        "--digest",
    }
    assert leto_flags - shown == set()
    assert "\nleto:\n" in result.stdout and "leto-run sim" in result.stdout


# ---------------------------------------------------------------------------- sim rule


def test_sim_is_the_subcommand_only_without_a_file_named_sim(tmp_path: Path) -> None:
    assert cli.is_sim_invocation(["sim", "--help"], cwd=str(tmp_path))
    assert not cli.is_sim_invocation(["--nproc-per-node", "2", "sim"], cwd=str(tmp_path))
    assert not cli.is_sim_invocation(["./sim"], cwd=str(tmp_path))
    assert not cli.is_sim_invocation([], cwd=str(tmp_path))
    (tmp_path / "sim").write_text("print('a script')\n")
    assert not cli.is_sim_invocation(["sim", "--help"], cwd=str(tmp_path))


def test_a_directory_named_sim_also_wins(tmp_path: Path) -> None:
    (tmp_path / "sim").mkdir()
    assert not cli.is_sim_invocation(["sim"], cwd=str(tmp_path))


def dispatch(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[str]]:
    """Run ``main(argv)`` with the launch and the simulator replaced by recorders."""
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(cli, "_launch", lambda a: calls.append(("launch", list(a))))
    monkeypatch.setattr(cli, "_run_sim", lambda a: calls.append(("sim", list(a))))
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code in (0, None)
    (call,) = calls
    return call


def test_main_dispatches_sim_or_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert dispatch(["sim", "--steps", "3"], monkeypatch) == ("sim", ["--steps", "3"])
    assert dispatch(["-m", "sim"], monkeypatch) == ("launch", ["-m", "sim"])
    (tmp_path / "sim").write_text("print('a script')\n")
    assert dispatch(["sim", "--steps", "3"], monkeypatch) == ("launch", ["sim", "--steps", "3"])


def test_main_keeps_double_dash_for_argparse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert dispatch(["--", "train.py", "--", "x"], monkeypatch) == (
        "launch",
        ["--", "train.py", "--", "x"],
    )


def test_script_named_sim_is_launched_as_a_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "sim").write_text("print('a script')\n")
    _, cmd, cmd_args, _ = cli.build_launch(["sim", "--steps", "3"])
    assert cmd == sys.executable and cmd_args == ["-u", "sim", "--steps", "3"]


def test_sim_subcommand_runs_or_says_why_not(tmp_path: Path) -> None:
    """Until leto_run.sim_cmd exists this is the one-line 'not available' error, exit 2."""
    result = run_leto("sim", "--help", cwd=tmp_path)
    if result.returncode == 0:
        assert "Traceback" not in result.stderr
    else:
        assert result.returncode == 2
        assert result.stderr.splitlines() == [result.stderr.strip()]
        assert result.stderr.startswith("leto-run: error: the 'sim' subcommand is not available")
