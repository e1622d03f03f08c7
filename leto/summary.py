"""Recovery timings and ETTR derived from the event stream.

Recovery time follows the paper's §8.1: from the failure (the fault's kill, or its
detection when the kill came from outside) until the interrupted step completes again on
every rank — initialisation plus recomputation.

:class:`Summary` reads the stream one event at a time and keeps aggregates only (per rank
the step-time totals, per recovery its phase boundaries, the last shadow level, counts),
so the agent's live view holds as much after a million steps as after ten. The functions
below run it over a list of events (benchmarks and tests).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Recovery:
    """One in-place recovery, phase by phase (seconds)."""

    gen: int
    failed_ranks: list[int]
    step: int | None
    phases: dict[str, float] = field(default_factory=dict)
    total_s: float | None = None
    pages_rebuilt: int = 0
    """Lost pages (model state, gradients, parity) rebuilt from parity by the promoted trainers."""


@dataclass(slots=True)
class _Tracker:
    """One failure to be answered in place, collecting the boundaries of its phases.

    Events count from the detection on (by time). The trainers' events of the promoted
    generation may be written before the agent's ``shadows_promoted``: they are held,
    tagged with their generation, and matched once it is known (a few per rank)."""

    t_det: float
    t0: float
    failed_ranks: list[int]
    step: int | None
    gen: int | None = None
    t_promote: float = 0.0
    t_stopped: float | None = None
    promoted: list[tuple[int, float]] = field(default_factory=list)
    resumed: list[tuple[int | None, float, int]] = field(default_factory=list)
    rebuilt: list[tuple[int | None, int]] = field(default_factory=list)
    done: dict[str, float] = field(default_factory=dict)
    """Per trainer: when it first completed the interrupted step (or a later one)."""

    def add(self, e: dict[str, Any]) -> None:
        kind, t = e["kind"], e["t"]
        if t < self.t_det:
            return
        if kind == "step_done":
            if (
                self.gen is None
                or t < self.t_promote
                or e["src"] in self.done
                or e.get("finished_in_recovery")
            ):
                return  # a step finished inside the recovery is part of attach+decide
            target = self.step if self.step is not None else self._resume_step()
            if target is not None and e["step"] >= target:
                self.done[e["src"]] = t
        elif kind == "shadows_promoted":
            if self.gen is None:
                self.gen, self.t_promote = e["gen"], e.get("promote_t", t)
        elif kind == "actives_stopped":
            if self.t_stopped is None:
                self.t_stopped = t
        elif self.gen is not None and e.get("gen") != self.gen:
            return  # a trainer's event of another generation
        elif kind == "promoted":
            self.promoted.append((e["gen"], t))
        elif kind == "resumed":
            self.resumed.append((e.get("gen"), t, e["step"]))
        elif kind == "pages_rebuilt":
            pages = sum(n for counts in e["lost"].values() for n in counts.values())
            self.rebuilt.append((e.get("gen"), pages))

    def _resume_step(self) -> int | None:
        return min((s for g, _, s in self.resumed if g == self.gen), default=None)

    def recovery(self) -> Recovery | None:
        if self.gen is None:
            return None
        gen = self.gen
        rec = Recovery(gen=gen, failed_ranks=self.failed_ranks, step=self.step)
        rec.phases["detect"] = self.t_det - self.t0
        rec.pages_rebuilt = sum(n for g, n in self.rebuilt if g == gen)
        if self.t_stopped is not None:
            rec.phases["stop"] = self.t_stopped - self.t_det
            rec.phases["promote"] = self.t_promote - self.t_stopped
        woke = [t for g, t in self.promoted if g == gen]
        if woke:
            rec.phases["wake"] = max(woke) - self.t_promote
        resumed = [t for g, t, _ in self.resumed if g == gen]
        if resumed:
            start = max(woke) if woke else self.t_promote
            rec.phases["attach+decide"] = max(resumed) - start
            if self.done:
                t_done = max(self.done.values())
                rec.phases["first step"] = t_done - max(resumed)
                rec.total_s = t_done - self.t0
        return rec


@dataclass(slots=True)
class _StepTotals:
    start: float
    end: float
    productive: float


class Summary:
    """Aggregates of an event stream, fed one event at a time (``add``).

    ``keep_recoveries``: how many of the latest failures answered in place are kept (None:
    all of them)."""

    def __init__(self, keep_recoveries: int | None = None) -> None:
        self._trackers: deque[_Tracker] = deque(maxlen=keep_recoveries)
        self._faults: deque[tuple[float, int | None]] = deque(maxlen=64)
        self._steps: dict[int, _StepTotals] = {}
        self._level: dict[str, Any] | None = None
        self._reclaims = 0
        self._last_reclaim_t: float | None = None
        self.restarts = 0
        """Group restarts (torchrun's path, counted against --max-restarts)."""
        self.promotions = 0
        """In-place recoveries: shadow generations promoted, less those a group restart
        answered before the promoted trainers all stepped (the agent's ``recoveries``)."""
        self._unfinished = False
        """The latest promotion's trainers have not all stepped (no ``recovery_done`` yet)."""
        self.worked = False
        """Whether any step completed or any failure was seen (a summary is worth printing)."""

    @classmethod
    def of(cls, events: Iterable[dict[str, Any]]) -> Summary:
        summary = cls()
        for e in events:
            summary.add(e)
        return summary

    def add(self, e: dict[str, Any]) -> None:
        kind = e["kind"]
        for tracker in self._trackers:
            tracker.add(e)
        if kind == "step_done":
            self.worked = True
            if "rank" in e:  # a step finished inside a recovery is recovery time, not productive
                self._step_done(
                    e["rank"], e["t"], 0.0 if e.get("finished_in_recovery") else e["iter_s"]
                )
        elif kind == "failure_detected":
            self.worked = True
            if e.get("failure", "hof") == "hof":  # an FF or a script error restarts instead
                self._detected(e)
        elif kind == "epoch":
            # Another node saw the failure: this node's file has no failure_detected for it.
            if e.get("remote") and e.get("action") == "in_place" and not self._awaiting_promotion():
                self._detected(e)
        elif kind == "fault_injected":
            self._faults.append((e["t"], e.get("step")))
        elif kind == "group_restart":
            self.restarts += 1
            if self._unfinished:
                self.promotions -= 1
                self._unfinished = False
            # the failures it answered get no promotion: the next one must not pair with them
            self._trackers = deque(
                (t for t in self._trackers if t.gen is not None), maxlen=self._trackers.maxlen
            )
        elif kind == "shadows_promoted":
            self.promotions += 1
            self._unfinished = True
        elif kind == "recovery_done":
            self._unfinished = False
        elif kind == "shadow_level":
            self._level = e
        elif kind == "shadow_reclaimed":
            self._reclaims += 1
            self._last_reclaim_t = e["t"]

    def _step_done(self, rank: int, t: float, iter_s: float) -> None:
        totals = self._steps.get(rank)
        if totals is None:
            self._steps[rank] = _StepTotals(t - iter_s, t, iter_s)
            return
        totals.start = min(totals.start, t - iter_s)
        totals.end = max(totals.end, t)
        totals.productive += iter_s

    def _detected(self, e: dict[str, Any]) -> None:
        """A failure to be answered in place (``failure_detected``, or another node's
        ``epoch``): its fault is the latest injected before the detection, if any since the
        previous failure."""
        t_det = e.get("detected_t", e["t"])
        fault = next((f for f in reversed(self._faults) if f[0] <= t_det), None)
        self._faults.clear()
        tracker = _Tracker(
            t_det=t_det,
            t0=fault[0] if fault else t_det,
            failed_ranks=sorted(e.get("root_ranks", ())),
            step=fault[1] if fault else None,
        )
        self._trackers.append(tracker)

    def _awaiting_promotion(self) -> bool:
        """The newest failure is not answered yet (a remote epoch may follow a local
        detection when two nodes saw failures at once)."""
        return bool(self._trackers) and self._trackers[-1].gen is None

    def recoveries(self) -> list[Recovery]:
        """Each failure paired with the promotion and first steps that answered it."""
        out = (t.recovery() for t in self._trackers)
        return [r for r in out if r is not None]

    def ettr(self, rank: int = 0) -> float | None:
        """Productive step time over wall time, from the first step's start to the last
        step's end."""
        totals = self._steps.get(rank)
        if totals is None or totals.end <= totals.start:
            return None
        return min(1.0, totals.productive / (totals.end - totals.start))

    def restarts_and_recoveries(self) -> tuple[int, int]:
        return self.restarts, self.promotions

    def shadow_line(self) -> str | None:
        """The pre-initialisation controller in one line: level now, why, reclaims so far."""
        last = self._level
        if last is None:
            return None
        line = f"shadows L{last['level']} ({last['reason']}"
        if last.get("headroom_bytes") is not None:
            line += f": headroom {_gib(last['headroom_bytes'])}, peak {_gib(last['peak_bytes'])}"
        line += f") · reclaims {self._reclaims}"
        if self._last_reclaim_t is not None and self._last_reclaim_t > last["t"]:
            line += " · none now: relaunched once the retried step reports its memory"
        return line


def recoveries(events: list[dict[str, Any]]) -> list[Recovery]:
    """Pair each failure with the promotion and first steps that answered it."""
    return Summary.of(events).recoveries()


def ettr(events: list[dict[str, Any]], rank: int = 0) -> float | None:
    """Productive step time over wall time, from the first step's start to the last step's end."""
    return Summary.of(events).ettr(rank)


def restarts_and_recoveries(events: list[dict[str, Any]]) -> tuple[int, int]:
    """Group restarts (torchrun's path, counted against --max-restarts) and in-place recoveries."""
    return Summary.of(events).restarts_and_recoveries()


def shadow_line(events: list[dict[str, Any]]) -> str | None:
    """The pre-initialisation controller in one line: level now, why, reclaims so far."""
    return Summary.of(events).shadow_line()


def losses(events: Iterable[dict[str, Any]], rank: int = 0) -> dict[int, float]:
    """Step -> the loss ``rank`` reported for it: a ``step_done``'s own ``loss``, or the
    next one's ``prev_loss`` (CUDA reports a loss a step late, ``leto.trainer.loss``). A
    step that ran more than once (a group restart) keeps its last report."""
    out: dict[int, float] = {}
    for e in events:
        if e["kind"] != "step_done" or e["rank"] != rank:
            continue
        if e.get("prev_loss") is not None:
            out[e["step"] - 1] = e["prev_loss"]
        if e.get("loss") is not None:
            out[e["step"]] = e["loss"]
    return out


def step_periods(
    events: Iterable[dict[str, Any]], rank: int = 0, *, first_step: int = 0, after_t: float = 0.0
) -> list[float]:
    """Seconds from each step's ``step_done`` to the next step's, for ``rank``: the rate the
    device sustains where the loop does not wait for it at every step's end (a step's own
    ``iter_s`` is then the host's time to queue it), with whatever runs between steps
    included. Only pairs of consecutive steps from ``first_step`` on, the earlier one
    written after ``after_t``; a pair across a process's start or promotion (a recovery, a
    restart) or a checkpoint save (an event with ``save_s``) is left out."""
    periods, prev = [], None
    for e in sorted(events, key=lambda e: e["t"]):
        if e.get("rank") != rank:
            continue
        if "save_s" in e or e["kind"] in ("trainer_started", "promoted", "resumed"):
            prev = None
        elif e["kind"] == "step_done":
            if e.get("finished_in_recovery"):
                prev = None
                continue
            if (
                prev is not None
                and e["step"] == prev["step"] + 1
                and e["step"] >= first_step
                and prev["t"] > after_t
            ):
                periods.append(e["t"] - prev["t"])
            prev = e
    return periods


def latest_loss(event: dict[str, Any]) -> float | None:
    """The newest loss a ``step_done`` carries: its own, else the previous step's."""
    loss = event.get("loss")
    return event.get("prev_loss") if loss is None else loss


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
