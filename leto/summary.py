"""Recovery timings and ETTR derived from the event stream.

Recovery time follows the paper's §8.1: from the failure (the fault's kill, or its
detection when the kill came from outside) until the interrupted step completes again on
every rank — initialisation plus recomputation.
"""

from __future__ import annotations

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


def recoveries(events: list[dict[str, Any]]) -> list[Recovery]:
    """Pair each failure with the promotion and first steps that answered it."""
    out: list[Recovery] = []
    faults = [e for e in events if e["kind"] == "fault_injected"]
    # Only failures answered in place; an FF or a script error restarts the group instead.
    for det in (e for e in events if e["kind"] == "failure_detected" and e.get("failure", "hof") == "hof"):
        t_det = det.get("detected_t", det["t"])
        after = [e for e in events if e["t"] >= t_det]
        prior_faults = [f for f in faults if f["t"] <= t_det]
        fault = prior_faults[-1] if prior_faults else None
        t0 = fault["t"] if fault else t_det
        promoted = _first(after, "shadows_promoted")
        if promoted is None:
            continue
        gen, t_promote = promoted["gen"], promoted.get("promote_t", promoted["t"])
        rec = Recovery(gen=gen, failed_ranks=sorted(int(r) for r in det.get("root_ranks", det["ranks"])), step=fault["step"] if fault else None)
        stopped = _first(after, "actives_stopped")
        ranks_promoted = [e for e in after if e["kind"] == "promoted" and e["gen"] == gen]
        resumed = [e for e in after if e["kind"] == "resumed" and e.get("gen") == gen]
        rec.phases["detect"] = t_det - t0
        rebuilt = [e for e in after if e["kind"] == "pages_rebuilt" and e.get("gen") == gen]
        rec.pages_rebuilt = sum(n for e in rebuilt for counts in e["lost"].values() for n in counts.values())
        if stopped:
            rec.phases["stop"] = stopped["t"] - t_det
            rec.phases["promote"] = t_promote - stopped["t"]
        if ranks_promoted:
            rec.phases["wake"] = max(e["t"] for e in ranks_promoted) - t_promote
        if resumed:
            resume_step = min(e["step"] for e in resumed)
            start = max(e["t"] for e in ranks_promoted) if ranks_promoted else t_promote
            rec.phases["attach+decide"] = max(e["t"] for e in resumed) - start
            target = rec.step if rec.step is not None else resume_step
            done = [e for e in after if e["kind"] == "step_done" and e["step"] >= target and e["t"] >= t_promote]
            by_rank: dict[str, float] = {}
            for e in done:
                by_rank.setdefault(e["src"], e["t"])
            if by_rank:
                t_done = max(by_rank.values())
                rec.phases["first step"] = t_done - max(e["t"] for e in resumed)
                rec.total_s = t_done - t0
        out.append(rec)
    return out


def ettr(events: list[dict[str, Any]], rank: int = 0) -> float | None:
    """Productive step time over wall time, from the first step's start to the last step's end."""
    steps = [e for e in events if e["kind"] == "step_done" and e.get("rank") == rank]
    if not steps:
        return None
    start = min(e["t"] - e["iter_s"] for e in steps)
    end = max(e["t"] for e in steps)
    productive = sum(e["iter_s"] for e in steps)
    return min(1.0, productive / (end - start)) if end > start else None


def _first(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((e for e in events if e["kind"] == kind), None)


def restarts_and_recoveries(events: list[dict[str, Any]]) -> tuple[int, int]:
    """Group restarts (torchrun's path, counted against --max-restarts) and in-place recoveries."""
    restarts = sum(1 for e in events if e["kind"] == "group_restart")
    recoveries = sum(1 for e in events if e["kind"] == "shadows_promoted")
    return restarts, recoveries


def shadow_line(events: list[dict[str, Any]]) -> str | None:
    """The pre-initialisation controller in one line: level now, why, reclaims so far."""
    levels = [e for e in events if e["kind"] == "shadow_level"]
    if not levels:
        return None
    last = levels[-1]
    reclaimed = [e["t"] for e in events if e["kind"] == "shadow_reclaimed"]
    line = f"shadows L{last['level']} ({last['reason']}"
    if last.get("headroom_bytes") is not None:
        line += f": headroom {_gib(last['headroom_bytes'])}, peak {_gib(last['peak_bytes'])}"
    line += f") · reclaims {len(reclaimed)}"
    if reclaimed and reclaimed[-1] > last["t"]:
        line += " · none now: relaunched once the retried step reports its memory"
    return line


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
