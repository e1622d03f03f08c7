"""PNG figures: ETTR vs HOF ratio, vs MTTF and vs scale (Fig. 10/14, 15 and 14 analogues)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from leto.errors import ConfigError
from leto.sim.evaluate import ScenarioResult, closed_form, with_failures

log = logging.getLogger(__name__)

_SCALE_HOF_RATIOS = {0.0: ":", 0.5: "--", 1.0: "-"}
"""HOF ratios drawn in the ETTR-vs-scale plot, as in Fig. 14, and their line styles."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plots needs matplotlib: pip install 'leto[sim]'") from None
    return plt


def write_plots(results: list[ScenarioResult], out_dir: Path) -> list[Path]:
    """Write the figures into ``out_dir``; return their paths. ETTR against scale needs
    scenarios of at least two GPU counts, and is left out otherwise."""
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [
        _sweep_figure(
            plt,
            results,
            "hof_sweep",
            "HOF ratio",
            out_dir / "ettr_vs_hof_ratio.png",
            fixed=lambda r: f"MTTF {r.scenario.failures.mttf_min:g} min",
        ),
        _sweep_figure(
            plt,
            results,
            "mttf_sweep",
            "MTTF (min)",
            out_dir / "ettr_vs_mttf.png",
            log_x=True,
            fixed=lambda r: f"HOF ratio {r.scenario.failures.hof_ratio:g}",
        ),
    ]
    if len({r.scenario.workload.num_gpus for r in results}) > 1:
        paths.append(_scale_figure(plt, results, out_dir / "ettr_vs_scale.png"))
    else:
        log.info("one scale only: no ettr_vs_scale.png (give scenarios of two or more GPU counts)")
    log.info("wrote %s", ", ".join(str(p) for p in paths))
    return paths


def _sweep_figure(
    plt: Any,
    results: list[ScenarioResult],
    attr: str,
    xlabel: str,
    path: Path,
    *,
    fixed: Callable[[ScenarioResult], str],
    log_x: bool = False,
) -> Path:
    """One panel per scenario, one closed-form line per system; ``fixed`` names the
    scenario's parameter that the sweep holds still (in the panel's title)."""
    fig, axes = plt.subplots(
        1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False, sharey=True
    )
    for ax, result in zip(axes[0], results, strict=True):
        for system, points in getattr(result, attr).items():
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, [100 * y for y in ys], marker="o", label=system)
        ax.set_title(
            f"{result.scenario.workload.name}, {result.scenario.workload.num_gpus:,} GPUs, {fixed(result)}",
            fontsize=9,
        )
        ax.set_xlabel(xlabel)
        if log_x:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("ETTR (%)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _scale_figure(plt: Any, results: list[ScenarioResult], path: Path) -> Path:
    """ETTR against GPU count at each scenario's MTTF, for HOF ratios 0, 50 and 100 %."""
    ordered = sorted(results, key=lambda r: r.scenario.workload.num_gpus)
    fig, ax = plt.subplots(figsize=(8, 4))
    colors: dict[str, str] = {}
    for h, style in _SCALE_HOF_RATIOS.items():
        per_system: dict[str, list[tuple[int, float]]] = {}
        for r in ordered:
            for name, p in closed_form(
                r.scenario, with_failures(r.scenario.failures, hof_ratio=h)
            ).items():
                per_system.setdefault(name, []).append((r.scenario.workload.num_gpus, 100 * p.ettr))
        for name, points in per_system.items():
            xs, ys = zip(*points, strict=True)
            color = colors.setdefault(name, f"C{len(colors) % 10}")
            ax.plot(xs, ys, style, color=color, marker="o", label=f"{name}, {h:.0%} HOF")
    ax.set_title("ETTR against scale, at each scenario's MTTF", fontsize=9)
    ax.set_xscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("ETTR (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
