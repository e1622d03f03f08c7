"""leto-run as a user meets it: --help and the ``sim`` rule. Bad input (one-line errors,
exit code 2) is tests/cli/test_bad_input.py's table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from leto_run import cli

LETO_RUN = Path(sys.executable).with_name("leto-run")


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
