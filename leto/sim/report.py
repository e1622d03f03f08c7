"""Render scenario results: a rich table for the terminal and a JSON document."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from leto.sim.evaluate import ScenarioResult

log = logging.getLogger(__name__)

JSON_SCHEMA_VERSION = 1


def table(result: ScenarioResult) -> Table:
    """One row per system: interval, T_eff, recovery, closed-form and Monte Carlo ETTR."""
    s = result.scenario
    f = s.failures
    out = Table(
        title=(
            f"{s.name}: {s.workload.name} on {s.workload.num_gpus:,} GPUs, "
            f"T_iter {result.iteration_s:.3f} s, "
            f"MTTF {f.mttf_min:g} min, HOF {f.hof_ratio:.0%}"
        ),
        title_justify="left",
    )
    out.add_column("system", no_wrap=True, min_width=11)
    for column in ("I", "T_eff s", "T_rec s", "rec/MTTF", "Eq. 6", "Monte Carlo", "overlaps"):
        out.add_column(column, justify="right", no_wrap=True)
    for r in result.systems:
        p, mc = r.prediction, r.monte_carlo
        closed = f"{p.ettr:.1%}" if p.valid else f"[red]{p.ettr:.1%}![/red]"
        if mc is None:
            sim, overlaps = "-", "-"
        else:
            mark = "" if mc.contains(p.ettr) else " [yellow]≠[/yellow]"
            sim = f"{100 * mc.ettr_mean:.2f}±{100 * mc.ettr_ci95:.2f}%{mark}"
            overlaps = f"{mc.overlapping_per_run:.1f}/{mc.failures_per_run:.0f}"
        out.add_row(
            p.system,
            str(p.interval_iters),
            f"{p.t_eff_s:.3f}",
            f"{p.recovery_s:.1f}",
            f"{p.recovery_to_mttf:.3f}",
            closed,
            sim,
            overlaps,
        )
    return out


def print_tables(results: list[ScenarioResult], console: Console | None = None) -> None:
    """Print one table per scenario; ≠ marks a Monte Carlo CI that misses Eq. 6."""
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    for result in results:
        console.print(table(result))
    if any(r.monte_carlo is not None for res in results for r in res.systems):
        console.print(
            "I: checkpoint interval (iters). Monte Carlo: mean ± 95 % CI over runs; "
            "≠: Eq. 6 lies "
            "outside it. overlaps: failures inside another's recovery / failures, per run."
        )


def to_json(results: list[ScenarioResult]) -> dict[str, Any]:
    """A JSON-ready document: inputs and outputs of every scenario."""
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "scenarios": [_scenario_json(r) for r in results],
    }


def _scenario_json(result: ScenarioResult) -> dict[str, Any]:
    return {
        "name": result.scenario.name,
        "inputs": dataclasses.asdict(result.scenario),
        "iteration_time_s": result.iteration_s,
        "systems": [
            {
                "closed_form": dataclasses.asdict(r.prediction) | {"valid": r.prediction.valid},
                "monte_carlo": dataclasses.asdict(r.monte_carlo) if r.monte_carlo else None,
            }
            for r in result.systems
        ],
        "sweeps": {
            "hof_ratio": {k: [list(p) for p in v] for k, v in result.hof_sweep.items()},
            "mttf_min": {k: [list(p) for p in v] for k, v in result.mttf_sweep.items()},
        },
    }


def write_json(results: list[ScenarioResult], path: Path) -> None:
    """Write :func:`to_json` to ``path`` (parents created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_json(results), indent=2) + "\n")
    log.info("wrote %s", path)
