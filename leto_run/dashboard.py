"""The live view of a job, rendered from the event stream (rich; plain lines off a TTY).

It lives in the agent for the whole job, so it keeps aggregates (``leto.summary.Summary``,
the latest step of each rank), never the events themselves.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from leto.summary import Summary


@dataclass(slots=True)
class _Rank:
    role: str = "-"
    gen: int = 0
    shadow_level: str = "-"
    step: int = -1
    iter_s: float = 0.0
    loss: float | None = None


_PLAIN_KINDS = {
    "workers_started",
    "shadows_spawned",
    "shadow_ready",
    "fault_injected",
    "failure_detected",
    "actives_stopped",
    "shadows_promoted",
    "resumed",
    "recovery_done",
    "job_finished",
    "pages_erased",
    "pages_rebuilt",
    "unrecoverable_state",
    "group_restart",
    "epoch",
    "hang_detected",
    "checkpoint_loaded",
    "checkpoint_failed",
    "shadow_reclaimed",
    "shadow_level",
    "oom_retry",
}
_RECENT_RECOVERIES = 100
"""Recoveries kept for the summary table (the counts cover all of them)."""
_READ_BYTES = 1 << 18


class Dashboard:
    """Tails the events file in a thread; prints the recovery summary at the end."""

    def __init__(
        self,
        events_path: str,
        enabled: bool = True,
        console: Console | None = None,
        offset: int = 0,
    ) -> None:
        """``offset``: where this job's events begin in the file (a reused file's end)."""
        self.path = events_path
        self.console = console or Console(stderr=False)
        self.live_mode = enabled and self.console.is_terminal
        self.plain_mode = not self.live_mode
        self.summary = Summary(keep_recoveries=_RECENT_RECOVERIES)
        self.ranks: dict[int, _Rank] = {}
        self._offset = offset
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="leto-dashboard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll()
        # The live view's last frame already holds the summary; plain mode prints it once.
        if self.plain_mode and self.summary.worked:
            self.console.print(self.summary_table())

    def _run(self) -> None:
        if not self.live_mode:
            while not self._stop.wait(0.2):
                self.poll()
            return
        with Live(
            self.render(), console=self.console, refresh_per_second=8, transient=False
        ) as live:
            while not self._stop.wait(0.125):
                self.poll()
                live.update(self.render())
            self.poll()
            live.update(self.render())

    def poll(self) -> None:
        """Take in the complete lines appended since the last call."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                while True:
                    data = f.read(_READ_BYTES)
                    end = data.rfind(b"\n") + 1
                    if not end:
                        if len(data) == _READ_BYTES:  # no event is this long: skip it
                            self._offset += len(data)
                            continue
                        return  # nothing, or one line still being written
                    self._offset += end
                    f.seek(self._offset)
                    for line in data[:end].splitlines():
                        try:
                            event = json.loads(line)
                        except ValueError:
                            continue
                        self._apply(event)
        except FileNotFoundError:
            return

    def _apply(self, e: dict[str, Any]) -> None:
        self.summary.add(e)
        kind, rank = e["kind"], e.get("rank")
        if rank is not None and isinstance(rank, int):
            r = self.ranks.setdefault(rank, _Rank())
            if kind == "trainer_started" and e["role"] == "active":
                r.role, r.gen = "active", e["gen"]
            elif kind == "shadow_ready":
                r.shadow_level = f"L{e['level']}"
            elif kind == "promoted":
                r.role, r.gen, r.shadow_level = "active (promoted)", e["gen"], "-"
            elif kind == "step_done":
                r.step, r.iter_s, r.loss = e["step"], e["iter_s"], e.get("loss")
        if kind == "shadows_spawned":
            for r in self.ranks.values():
                r.shadow_level = "L0 (starting)"
        elif kind == "shadow_reclaimed":
            for r in self.ranks.values():
                r.shadow_level = "reclaimed"
        if self.plain_mode and kind in _PLAIN_KINDS:
            fields = {k: v for k, v in e.items() if k not in ("t", "kind", "src", "points")}
            print(
                f"[leto {time.strftime('%H:%M:%S', time.localtime(e['t']))}] {kind} {fields}",
                file=sys.stderr,
                flush=True,
            )

    def render(self) -> Group:
        table = Table(title="leto-run", expand=False)
        for col in ("rank", "role", "gen", "shadow", "step", "iter (ms)", "loss"):
            table.add_column(col)
        for rank in sorted(self.ranks):
            r = self.ranks[rank]
            table.add_row(
                str(rank),
                r.role,
                str(r.gen),
                r.shadow_level,
                str(r.step),
                f"{r.iter_s * 1e3:.1f}",
                "-" if r.loss is None else f"{r.loss:.4f}",
            )
        return Group(table, self.summary_table())

    def summary_table(self) -> Table:
        table = Table(title="recoveries")
        for col in ("gen", "failed ranks", "step", "pages rebuilt", "phases (ms)", "total (ms)"):
            table.add_column(col)
        for rec in self.summary.recoveries():
            phases = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in rec.phases.items())
            total = "-" if rec.total_s is None else f"{rec.total_s * 1e3:.0f}"
            table.add_row(
                str(rec.gen),
                str(rec.failed_ranks),
                str(rec.step),
                str(rec.pages_rebuilt),
                phases,
                total,
            )
        value = self.summary.ettr()
        restarts, recoveries = self.summary.restarts_and_recoveries()
        counts = f"in-place recoveries {recoveries} · group restarts {restarts}"
        caption = f"ETTR {value * 100:.1f} % · {counts}" if value is not None else counts
        shadows = self.summary.shadow_line()
        table.caption = f"{caption}\n{shadows}" if shadows else caption
        return table
