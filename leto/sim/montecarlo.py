"""Monte Carlo event simulation of the same run the closed form describes.

Each simulated run must complete ``duration_h`` worth of fault-free iterations. Failures
arrive on the wall clock (Poisson, or one every MTTF with a random phase, as the paper
injects them), during recovery too: a failure that lands inside another's preparation
restarts it and may deepen the rollback, which the closed form does not model
(assumption 2). Checkpoints follow Appendix C.3: a snapshot of iteration k (k a multiple
of I) costs the next iteration T_ckpt and becomes usable when that iteration completes.

ETTR of a run = (iterations x T_iter) / wall time; the result is the mean over runs with
a 95 % confidence interval (normal approximation).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from leto.sim.closed_form import RecoveryPath, SystemTerms
from leto.sim.config import FailureConfig, MonteCarloConfig

log = logging.getLogger(__name__)

_WALL_CAP = 1000.0
"""A run that needs more than this many times its fault-free length is stopped."""


@dataclass(frozen=True, slots=True)
class MonteCarloResult:
    """ETTR of one system over many simulated runs."""

    system: str
    runs: int
    ettr_mean: float
    ettr_ci95: float
    """Half-width of the 95 % confidence interval of the mean."""
    failures_per_run: float
    overlapping_per_run: float
    """Failures per run that arrived while an earlier one was still being recovered."""
    capped_runs: int
    """Runs stopped at 1000x their fault-free length (ETTR is then an upper bound)."""

    def contains(self, value: float) -> bool:
        """Whether ``value`` lies inside the 95 % confidence interval."""
        return abs(value - self.ettr_mean) <= self.ettr_ci95


class _Arrivals:
    """Failure times on the wall clock, consumed in order.

    ``poisson``: exponential gaps. ``periodic``: exactly one every MTTF from a random phase;
    recovery then locks every failure to the same point of the checkpoint cycle.
    ``window``: one failure at a uniform time inside each MTTF-long window, which keeps
    the paper's fixed count while making the arrival phase uniform (assumption 3).
    """

    def __init__(self, failures: FailureConfig, rng: np.random.Generator) -> None:
        self._mttf_s = failures.mttf_s
        self._kind = failures.arrival
        self._rng = rng
        self._window = 0
        self._last = 0.0 if self._kind != "periodic" else (rng.random() - 1.0) * self._mttf_s

    def next(self) -> float:
        if self._kind == "poisson":
            self._last += self._rng.exponential(self._mttf_s)
        elif self._kind == "periodic":
            self._last += self._mttf_s
        else:
            self._last = (self._window + self._rng.random()) * self._mttf_s
            self._window += 1
        return self._last


class _Schedule:
    """Iteration and checkpoint timing of one system, in closed arithmetic."""

    def __init__(self, terms: SystemTerms) -> None:
        self.step_s = terms.step_s
        self.ckpt_s = terms.checkpoint_cost_s
        self.interval = terms.interval_iters

    def _snapshots(self, first: int, last: int, usable: int) -> int:
        """Snapshots taken at multiples of I in [first, last], skipping the usable one."""
        lo = max(first, 1)
        if last < lo:
            return 0
        n = last // self.interval - (lo - 1) // self.interval
        return n - (1 if lo <= usable <= last and usable % self.interval == 0 and usable > 0 else 0)

    def time_to(self, progress: int, target: int, usable: int) -> float:
        """Wall time to run iterations progress+1..target."""
        return (target - progress) * self.step_s + self.ckpt_s * self._snapshots(
            progress, target - 1, usable
        )

    def reached(self, progress: int, budget_s: float, usable: int) -> int:
        """Completed iterations after ``budget_s`` seconds of running from ``progress``."""
        q = progress + int(budget_s // (self.step_s + self.ckpt_s / self.interval))
        while self.time_to(progress, q + 1, usable) <= budget_s:
            q += 1
        while q > progress and self.time_to(progress, q, usable) > budget_s:
            q -= 1
        return q

    def newest_usable(self, progress: int, usable: int, reached: int) -> int:
        """Newest usable checkpoint after running from ``progress`` to ``reached``."""
        last = reached - 1  # a snapshot of k is usable once iteration k + 1 completes
        newest = (last // self.interval) * self.interval
        return max(usable, newest) if newest >= max(progress, 1) else usable


def simulate_run(
    terms: SystemTerms, failures: FailureConfig, target_iters: int, rng: np.random.Generator
) -> tuple[float, int, int, bool]:
    """One run: (ETTR, failures, overlapping failures, capped)."""
    schedule = _Schedule(terms)
    arrivals = _Arrivals(failures, rng)
    cap_s = _WALL_CAP * target_iters * terms.iteration_s
    t, progress, usable, count, overlapping = 0.0, 0, 0, 0, 0
    next_fail = arrivals.next()
    while True:
        finish = t + schedule.time_to(progress, target_iters, usable)
        if finish <= next_fail:
            return target_iters * terms.iteration_s / finish, count, overlapping, False
        reached = schedule.reached(progress, next_fail - t, usable)
        usable = schedule.newest_usable(progress, usable, reached)
        t, resume = next_fail, reached
        while True:  # one recovery episode; failures inside it restart the preparation
            count += 1
            path = _draw(terms, failures.hof_ratio, rng)
            if path.rollback:
                resume = min(resume, usable)
            next_fail = arrivals.next()
            if next_fail >= t + path.prep_s:
                t += path.prep_s
                break
            overlapping += 1
            t = next_fail
        progress = resume
        if t > cap_s:
            return progress * terms.iteration_s / t, count, overlapping, True


def _draw(terms: SystemTerms, hof_ratio: float, rng: np.random.Generator) -> RecoveryPath:
    return terms.hof if rng.random() < hof_ratio else terms.ff


def simulate(
    terms: SystemTerms, failures: FailureConfig, mc: MonteCarloConfig, rng: np.random.Generator
) -> MonteCarloResult:
    """``mc.runs`` independent runs of ``terms`` under ``failures``."""
    target = max(1, round(mc.duration_h * 3600.0 / terms.iteration_s))
    results = [simulate_run(terms, failures, target, rng) for _ in range(mc.runs)]
    ettr = np.array([r[0] for r in results])
    ci = 1.96 * float(ettr.std(ddof=1)) / math.sqrt(len(ettr)) if len(ettr) > 1 else math.inf
    out = MonteCarloResult(
        system=terms.name,
        runs=mc.runs,
        ettr_mean=float(ettr.mean()),
        ettr_ci95=ci,
        failures_per_run=float(np.mean([r[1] for r in results])),
        overlapping_per_run=float(np.mean([r[2] for r in results])),
        capped_runs=sum(r[3] for r in results),
    )
    log.debug("monte carlo %s: %s", terms.name, out)
    return out
