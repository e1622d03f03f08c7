"""``leto-run sim``: predict ETTR for Leto and checkpointing baselines from scenario files."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import click

from leto.errors import ConfigError, LetoError
from leto.sim.config import load_scenario
from leto.sim.evaluate import ScenarioResult, evaluate, with_failures

log = logging.getLogger(__name__)


@click.command(name="sim", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("scenarios", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option(
    "--json", "json_out", type=click.Path(path_type=Path), help="Write inputs and results as JSON."
)
@click.option(
    "--plots",
    "plots_dir",
    type=click.Path(path_type=Path),
    help="Write PNG plots into this folder.",
)
@click.option(
    "--monte-carlo-runs",
    type=click.IntRange(min=0),
    default=None,
    help="Simulated runs per system (0: closed form only); default from the scenario.",
)
@click.option("--seed", type=int, default=None, help="Monte Carlo seed; default from the scenario.")
@click.option(
    "--mttf-min", type=float, default=None, help="Override the scenario MTTF, in minutes."
)
@click.option(
    "--hof-ratio", type=float, default=None, help="Override the scenario HOF ratio, in [0, 1]."
)
def sim(
    scenarios: tuple[Path, ...],
    json_out: Path | None,
    plots_dir: Path | None,
    monte_carlo_runs: int | None,
    seed: int | None,
    mttf_min: float | None,
    hof_ratio: float | None,
) -> None:
    """Predict ETTR, recovery time and checkpoint interval for each SCENARIO file.

    Several scenarios (e.g. configs/sim/deepseek-v*.yaml) make the ETTR-vs-scale plot.
    """
    try:
        _check_output(json_out, "--json", directory=False)
        _check_output(plots_dir, "--plots", directory=True)
        results = [_run(path, monte_carlo_runs, seed, mttf_min, hof_ratio) for path in scenarios]
        from leto.sim.report import print_tables, write_json

        print_tables(results)
        if json_out is not None:
            with _writing(json_out, "--json"):
                write_json(results, json_out)
            click.echo(f"wrote {json_out}")
        if plots_dir is not None:
            from leto.sim.plots import write_plots

            with _writing(plots_dir, "--plots"):
                written = write_plots(results, plots_dir)
            for path in written:
                click.echo(f"wrote {path}")
    except LetoError as e:
        _die("leto-run sim", str(e))


def main(argv: Sequence[str], prog_name: str) -> NoReturn:
    """Run ``prog_name ARGV``; click's usage errors become one line and exit 2, in the
    launcher's style (``leto-run sim: error: ...``), without click's usage box."""
    try:
        code = sim.main(args=list(argv), prog_name=prog_name, standalone_mode=False)
    except click.ClickException as e:
        _die(prog_name, e.format_message(), code=e.exit_code)
    except click.Abort:
        _die(prog_name, "interrupted", code=130)
    raise SystemExit(code if isinstance(code, int) else 0)


def _die(prog_name: str, message: str, *, code: int = 2) -> NoReturn:
    click.echo(f"{prog_name}: error: {' '.join(message.split())}", err=True)
    raise SystemExit(code)


def _check_output(path: Path | None, flag: str, *, directory: bool) -> None:
    """Refuse, before any work, an output path that cannot be made: one below a file, or a
    file where a folder goes (and the reverse)."""
    if path is None:
        return
    if path.exists():
        if path.is_dir() != directory:
            what = "is not a directory" if directory else "is a directory; give a file path"
            raise ConfigError(f"{flag} {str(path)!r}: {what}")
        return
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: {str(parent)!r} is a file, not a directory")


@contextlib.contextmanager
def _writing(path: Path, flag: str) -> Iterator[None]:
    """Turn an OSError while writing an output into a one-line error naming its flag."""
    try:
        yield
    except OSError as e:
        raise ConfigError(f"{flag} {str(path)!r}: cannot write: {e.strerror or e}") from None


def _run(
    path: Path, runs: int | None, seed: int | None, mttf_min: float | None, hof_ratio: float | None
) -> ScenarioResult:
    """Load one scenario, apply the command-line overrides, evaluate it."""
    scenario = load_scenario(path)
    changes = {k: v for k, v in (("mttf_min", mttf_min), ("hof_ratio", hof_ratio)) if v is not None}
    if changes:
        try:
            scenario.failures = with_failures(scenario.failures, **changes)
        except LetoError as e:
            raise type(e)(f"{path}: {e}") from None
    try:
        return evaluate(scenario, runs=runs, seed=seed)
    except LetoError as e:
        raise type(e)(f"{path}: {e}") from None
