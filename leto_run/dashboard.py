"""The live view of a job, rendered from the event stream (rich on a terminal, JSON lines off it).

It lives in the agent for the whole job, so it keeps aggregates (``leto.summary.Summary``,
the latest step of each rank), never the events themselves.

On a terminal the view owns it: while it runs, file descriptors 1 and 2 of the agent (and so
of every worker, torch's log handler and any C++ library, which all write to them directly)
lead into a pipe, and each line read from it is printed above the live region, in order and
unchanged (torchrun's ``[default0]:`` prefixes included, when ``--tee`` asks for them).
Off a terminal (Slurm, Kubernetes) each event worth a line is printed as its own JSON
object, with a progress object every few steps.
"""

from __future__ import annotations

import json
import math
import os
import select
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from leto.events import SCHEMA_VERSION, EventTail, Kind
from leto.summary import Summary, latest_loss


@dataclass(slots=True)
class _Rank:
    role: str = "starting"
    gen: int = 0
    shadow: str = "-"
    step: int | None = None
    iter_s: float | None = None
    loss: float | None = None


_PLAIN_KINDS = frozenset(
    {
        "agent_started",
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
        "shadow_died",
        "shadows_given_up",
        "state_manager_died",
        "device_unhealthy",
        "metrics_serving",
    }
)
"""Events printed as a JSON line in plain mode (per-step events are summed up by progress lines)."""
_RECENT_RECOVERIES = 100
"""Recoveries kept for the summary table (the counts cover all of them)."""
_LIVE_RECOVERIES = 3
"""Recoveries shown in the live region (the newest)."""
_PLAIN_PROGRESS_S = 30.0
"""Plain mode: a progress line at least this often while steps complete."""


def _clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """Steps done out of the total, elapsed time and ETA, from ``step_done`` events.

    The job's step is its slowest rank's; the rate is measured over the steps this run has
    completed (a resumed job's earlier steps took no time here)."""

    def __init__(self) -> None:
        self.t_start: float | None = None
        self.total: int | None = None
        self._rank_step: dict[int, int] = {}
        self._first: tuple[float, int] | None = None
        self._last: tuple[float, int] | None = None

    def add(self, e: dict[str, Any]) -> None:
        kind = e["kind"]
        if kind == "agent_started" and self.t_start is None:
            self.t_start = e["t"]
        elif kind == "step_done" and isinstance(e.get("rank"), int):
            if e.get("total") is not None:
                self.total = int(e["total"])
            self._rank_step[e["rank"]] = max(self._rank_step.get(e["rank"], -1), e["step"])
            done = self.done
            if self._first is None:
                self._first = (e["t"], done)
            if self._last is None or done > self._last[1]:
                self._last = (e["t"], done)

    @property
    def done(self) -> int:
        """Steps completed on every rank (the slowest rank's count)."""
        return min(self._rank_step.values()) + 1 if self._rank_step else 0

    def elapsed_s(self, now: float) -> float | None:
        return None if self.t_start is None else now - self.t_start

    def eta_s(self) -> float | None:
        if self.total is None or self._first is None or self._last is None:
            return None
        (t0, n0), (t1, n1) = self._first, self._last
        if n1 <= n0 or t1 <= t0:
            return None
        return (self.total - self.done) * (t1 - t0) / (n1 - n0)

    def fraction(self) -> float | None:
        return None if not self.total else min(1.0, self.done / self.total)


class TerminalPassthrough:
    """Points this process's terminal fds (1, 2) at a pipe and forwards each line read from it.

    Every process started afterwards inherits the pipe, so a worker's output reaches the
    terminal only through :meth:`route`'s sink: above the live region while it runs. The
    original terminal stays reachable at :attr:`tty_fd`. :meth:`restore` puts fds 1 and 2
    back; lines still arriving (a child that outlives the view) are then written through.
    """

    def __init__(self) -> None:
        self.tty_fd = os.dup(1)
        self._saved: dict[int, int] = {}
        tty = os.fstat(self.tty_fd).st_rdev
        sys.stdout.flush()
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        for fd in (1, 2):
            if os.isatty(fd) and os.fstat(fd).st_rdev == tty:  # a stderr sent elsewhere stays there
                self._saved[fd] = os.dup(fd)
                os.dup2(write_end, fd)
        os.close(write_end)
        self._read_end = read_end
        self._pending = b""
        """Bytes read after the last newline."""
        self._lock = threading.Lock()
        self._sink: Callable[[str], None] = self._write_through
        self._thread = threading.Thread(target=self._pump, name="leto-output", daemon=True)
        self._thread.start()

    def route(self, sink: Callable[[str], None] | None) -> None:
        """Send each line to ``sink`` from now on (None: straight to the terminal)."""
        with self._lock:
            self._sink = sink or self._write_through

    def restore(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.flush(timeout_s=0.5)
        self.route(None)
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        self._saved.clear()

    def flush(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) until what was written to the pipe has been forwarded."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self._read_end], [], [], 0)
            if not readable and not self._pending:
                return
            time.sleep(0.01)

    def _write_through(self, line: str) -> None:
        os.write(self.tty_fd, (line + "\n").encode(errors="replace"))

    def _emit(self, raw: bytes) -> None:
        if b"\r" in raw:  # a progress bar redrawn in place: its last state is the line
            parts = [p for p in raw.split(b"\r") if p]
            raw = parts[-1] if parts else b""
        with self._lock:
            self._sink(raw.decode(errors="replace"))

    def _pump(self) -> None:
        idle_since = time.monotonic()
        while True:
            readable, _, _ = select.select([self._read_end], [], [], 0.1)
            if readable:
                data = os.read(self._read_end, 1 << 16)
                if not data:
                    break  # every writer closed its end
                *lines, self._pending = (self._pending + data).split(b"\n")
                for line in lines:
                    self._emit(line)
                idle_since = time.monotonic()
            elif self._pending and time.monotonic() - idle_since > 0.2:
                pending, self._pending = self._pending, b""  # a prompt or a bar without newline
                self._emit(pending)
        if self._pending:
            self._emit(self._pending)
        self._pending = b""


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
        self.progress = Progress()
        self.ranks: dict[int, _Rank] = {}
        self.state = "starting"
        self._recovering_since: float | None = None
        self._tail = EventTail(events_path, offset)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._passthrough: TerminalPassthrough | None = None
        self._plain_next_step = 0
        self._plain_last_t = 0.0

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._say(f"events: {self.path}")
        if self.live_mode:
            self._passthrough = TerminalPassthrough()
            out = open(self._passthrough.tty_fd, "w", closefd=False)  # noqa: SIM115 - lives with the view
            self.console = Console(
                file=out, force_terminal=True, color_system=self.console.color_system
            )
        self._thread = threading.Thread(target=self._run, name="leto-dashboard", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.poll()
        if self._passthrough is not None:
            self._passthrough.restore()
        # The live view's last frame already holds the summary; plain mode prints it once.
        if self.plain_mode and self.summary.worked:
            self.console.print(self.summary_table())
        self._say(f"events: {self.path}")

    def _say(self, line: str) -> None:
        """A line of the launcher's own (the events path), on stderr as torchrun's logs."""
        print(f"leto-run: {line}", file=sys.stderr, flush=True)

    def _run(self) -> None:
        if not self.live_mode:
            while not self._stop.wait(0.2):
                self.poll()
            return
        assert self._passthrough is not None
        self._fit()
        live = Live(
            self.render(),
            console=self.console,
            refresh_per_second=4,
            transient=False,
            redirect_stdout=False,
            redirect_stderr=False,
        )
        # Through the console from before the first frame to after the last: a line written
        # to the terminal past it would land where the next frame is drawn, and be erased.
        self._passthrough.route(
            lambda line: self.console.print(Text.from_ansi(line), soft_wrap=True)
        )
        with live:
            while not self._stop.wait(0.25):
                self.poll()
                self._fit()
                live.update(self.render())
            self._passthrough.flush(timeout_s=0.5)  # the last lines above the final frame
            self.poll()
            live.update(self.render(), refresh=True)

    def _fit(self) -> None:
        """Follow the terminal's size (fds 1 and 2 are the pipe now: ask the saved tty)."""
        assert self._passthrough is not None
        try:
            size = os.get_terminal_size(self._passthrough.tty_fd)
        except OSError:
            return
        self.console.size = (size.columns, size.lines)

    # -- events ------------------------------------------------------------------------------
    def poll(self) -> None:
        """Take in the complete lines appended since the last call."""
        for event in self._tail.new_events():
            self._apply(event)

    def _apply(self, e: dict[str, Any]) -> None:
        self.summary.add(e)
        self.progress.add(e)
        kind, rank = e["kind"], e.get("rank")
        if isinstance(rank, int):
            r = self.ranks.setdefault(rank, _Rank())
            if kind == "trainer_started" and e["role"] == "active":
                r.role, r.gen = "active", e["gen"]
            elif kind == "shadow_ready":
                r.shadow = f"L{e['level']}"
            elif kind == "promoted":
                r.role, r.gen, r.shadow = "promoted", e["gen"], "-"
            elif kind == "step_done":
                r.step, r.iter_s = e["step"], e["iter_s"]
                loss = latest_loss(e)  # on CUDA a step late; none after a promotion
                if loss is not None:
                    r.loss = loss
        if kind == "step_done":
            if self.state in ("starting", "restarting"):
                self.state = "training"
        elif kind == "workers_started":
            for global_rank in e.get("ranks", ()):  # a plain script reports nothing else
                self.ranks.setdefault(global_rank, _Rank())
            for r in self.ranks.values():
                r.role, r.shadow = "running", "-"
        elif kind == "shadows_spawned":
            for r in self.ranks.values():
                r.shadow = f"L{e['level']} starting" if "level" in e else "starting"
        elif kind == "shadow_reclaimed":
            for r in self.ranks.values():
                r.shadow = "reclaimed"
        elif kind == "failure_detected":
            self.state, self._recovering_since = "recovering", e.get("detected_t", e["t"])
            for failed in e["ranks"]:
                self.ranks.setdefault(failed, _Rank()).role = "failed"
        elif kind == "recovery_done":
            self.state, self._recovering_since = "training", None
        elif kind == "group_restart":
            self.state, self._recovering_since = "restarting", None
        elif kind == "job_finished":
            self.state = "finished" if e.get("ok") else "failed"
        if self.plain_mode:
            self._plain(e)

    def _plain(self, e: dict[str, Any]) -> None:
        """Off a terminal: the event itself as one JSON line; progress every few steps."""
        if e["kind"] in _PLAIN_KINDS:
            self._line(json.dumps(e, separators=(",", ":")))
        elif e["kind"] == "step_done":
            done = self.progress.done
            every = max(1, (self.progress.total or 200) // 20)
            if done >= self._plain_next_step or (
                done and e["t"] - self._plain_last_t >= _PLAIN_PROGRESS_S
            ):
                self._plain_next_step = (done // every + 1) * every
                self._plain_last_t = e["t"]
                self._line(json.dumps(self._progress_fields(e["t"]), separators=(",", ":")))

    def _progress_fields(self, now: float) -> dict[str, Any]:
        p = self.progress
        fields: dict[str, Any] = {
            "t": now,
            "kind": Kind.PROGRESS.value,
            "src": "dashboard",
            "schema_version": SCHEMA_VERSION,
            "step": p.done,
            "total": p.total,
        }
        frac = p.fraction()
        if frac is not None:
            fields["percent"] = round(100 * frac, 1)
        elapsed, eta = p.elapsed_s(now), p.eta_s()
        fields["elapsed_s"] = None if elapsed is None else round(elapsed, 1)
        fields["eta_s"] = None if eta is None else round(eta, 1)
        iters = [r.iter_s for r in self.ranks.values() if r.iter_s is not None]
        fields["iter_ms"] = round(1e3 * sum(iters) / len(iters), 2) if iters else None
        losses = [r.loss for r in self.ranks.values() if r.loss is not None]
        fields["loss"] = losses[0] if losses else None
        return fields

    def _line(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    # -- rendering ---------------------------------------------------------------------------
    def render(self) -> Group:
        """The live region: whole lines, each cut to the terminal's width (never wrapped)."""
        now = time.time()
        lines: list[Text] = [self._header(now), self._progress_line(now), Text("")]
        lines.append(
            Text(
                f"{'rank':>4}  {'role':<9} {'gen':>3}  {'shadow':<11} {'step':>8} "
                f"{'iter ms':>9}  {'loss':>9}",
                style="bold",
            )
        )
        for rank in sorted(self.ranks):
            r = self.ranks[rank]
            style = "red" if r.role == "failed" else ""
            step = "-" if r.step is None else str(r.step)
            it = "-" if r.iter_s is None else f"{r.iter_s * 1e3:.1f}"
            loss = "-" if r.loss is None else f"{r.loss:.4f}"
            lines.append(
                Text(
                    f"{rank:>4}  {r.role:<9} {r.gen:>3}  {r.shadow:<11} {step:>8} {it:>9}  {loss:>9}",
                    style=style,
                )
            )
        lines.append(Text(""))
        for rec in self.summary.recoveries()[-_LIVE_RECOVERIES:]:
            lines.append(Text(self._recovery_line(rec)))
        lines.append(Text(self._counts_line()))
        shadows = self.summary.shadow_line()
        if shadows:
            lines.append(Text(shadows))
        for line in lines:
            line.no_wrap, line.overflow = True, "ellipsis"
        return Group(*lines)

    def _header(self, now: float) -> Text:
        state = self.state
        if state == "recovering" and self._recovering_since is not None:
            state = f"recovering… {max(0.0, now - self._recovering_since):.1f} s"
        text = Text("leto-run", style="bold")
        text.append(f"  {len(self.ranks)} ranks · ")
        text.append(
            state,
            style={"recovering": "yellow", "failed": "red", "restarting": "yellow"}.get(
                self.state, "green"
            ),
        )
        return text

    def _progress_line(self, now: float) -> Text:
        p = self.progress
        frac = p.fraction()
        total = "?" if p.total is None else str(p.total)
        text = Text(f"step {p.done}/{total} ")
        if frac is not None:
            width = 24
            filled = int(frac * width)
            text.append("━" * filled, style="green")
            text.append("━" * (width - filled), style="grey37")
            text.append(f" {100 * frac:3.0f} %")
        text.append(f" · elapsed {_clock(p.elapsed_s(now))} · ETA {_clock(p.eta_s())}")
        return text

    @staticmethod
    def _recovery_line(rec: Any) -> str:
        total = "…" if rec.total_s is None else f"{rec.total_s * 1e3:.0f} ms"
        phases = " · ".join(f"{k} {v * 1e3:.0f}" for k, v in rec.phases.items())
        return f"gen {rec.gen} · ranks {rec.failed_ranks} · step {rec.step}: {total} ({phases})"

    def _counts_line(self) -> str:
        restarts, recoveries = self.summary.restarts_and_recoveries()
        counts = f"in-place recoveries {recoveries} · group restarts {restarts}"
        value = self.summary.ettr()
        return f"ETTR {value * 100:.1f} % · {counts}" if value is not None else counts

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
        caption = self._counts_line()
        shadows = self.summary.shadow_line()
        table.caption = f"{caption}\n{shadows}" if shadows else caption
        return table
