"""``leto-run sim``: predict ETTR for Leto and checkpointing baselines from scenario files."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from leto.errors import LetoError
from leto.sim.config import load_scenario
from leto.sim.evaluate import ScenarioResult, evaluate, with_failures

log = logging.getLogger(__name__)


@click.command(name="sim")
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
        results = [_run(path, monte_carlo_runs, seed, mttf_min, hof_ratio) for path in scenarios]
        from leto.sim.report import print_tables, write_json

        print_tables(results)
        if json_out is not None:
            write_json(results, json_out)
            click.echo(f"wrote {json_out}")
        if plots_dir is not None:
            from leto.sim.plots import write_plots

            for path in write_plots(results, plots_dir):
                click.echo(f"wrote {path}")
    except LetoError as e:
        click.echo(f"leto-run sim: error: {' '.join(str(e).split())}", err=True)
        raise SystemExit(2) from None


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
