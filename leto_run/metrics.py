"""Prometheus metrics of one node's agent, read from the job's event stream (opt-in).

``leto.metrics_port`` / ``--metrics-port``: every node's agent serves the text format at
``http://0.0.0.0:PORT/metrics``. A thread tails the events file (:class:`~leto.events.EventTail`)
and folds each event into aggregates (:class:`_State`; recoveries and ETTR come from
:class:`~leto.summary.Summary`, as on the dashboard); a collector on a private registry turns
them into metric families at each scrape, so the ``node`` label is the node's rank as of the
scrape (torch's rendezvous assigns it after the agent starts). ``docs/METRICS.md`` lists
the metrics.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from leto.errors import ConfigError
from leto.events import EventLog, EventTail, Kind
from leto.summary import Summary, latest_loss

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.5
"""How often the events file is read; a scrape sees the job at most this much late."""
_KEEP_RECOVERIES = 8
"""Failures whose recovery is tracked (the last complete one is reported)."""
NO_EPOCH_CAUSE = "worker_failure"
"""Cause of a group restart that no recovery epoch decided (a script without the leto API,
or torch's restart on a membership change)."""


@dataclass(slots=True)
class _RankStats:
    steps: int = 0
    last_step: int = -1
    iter_s: float = 0.0
    loss: float | None = None
    pages_rebuilt: int = 0


class _State:
    """Aggregates of this job's events so far: counts and latest values, never the events."""

    def __init__(self) -> None:
        self.summary = Summary(keep_recoveries=_KEEP_RECOVERIES)
        self.ranks: dict[int, _RankStats] = {}
        self.recoveries: Counter[str] = Counter()
        self.restarts: Counter[str] = Counter()
        self.shadow_level: int | None = None
        self.shadows_ready: set[int] = set()
        self.started_t: float | None = None
        self.finished_ok: bool | None = None
        """None while the job runs; then whether it succeeded."""
        self._shadow_gen: int | None = None
        self._cause: str | None = None
        """The pending failure's cause: the recovery epoch's ``failure`` (hof, ff, error), or
        ``hang`` when this node's agent killed a hung trainer for it."""
        self._hang = False

    def add(self, e: dict[str, Any]) -> None:
        self.summary.add(e)
        kind = e["kind"]
        if kind == "step_done":
            r = self._rank(e)
            r.steps += 1
            r.last_step = e["step"]
            if not e.get("finished_in_recovery"):  # then iter_s is the recovery's finishing work
                r.iter_s = e["iter_s"]
            loss = latest_loss(e)
            if loss is not None:
                r.loss = loss
        elif kind == "pages_rebuilt":
            self._rank(e).pages_rebuilt += sum(
                n for counts in e["lost"].values() for n in counts.values()
            )
        elif kind == "hang_detected":
            self._hang = True
        elif kind == "epoch":
            self._cause, self._hang = ("hang" if self._hang else e["failure"]), False
        elif kind == "shadows_promoted":
            self.recoveries[self._cause or "unknown"] += 1
            self._cause = None
            self.shadows_ready.clear()  # the ready shadows are the actives now
        elif kind == "group_restart":
            self.restarts[self._cause or ("hang" if self._hang else NO_EPOCH_CAUSE)] += 1
            self._cause, self._hang = None, False
            self.shadows_ready.clear()
        elif kind == "shadow_level":  # written before every spawn of a shadow generation
            self.shadow_level, self._shadow_gen = e["level"], e["gen"]
            self.shadows_ready.clear()
        elif kind == "shadow_ready":
            if e["gen"] == self._shadow_gen:
                self.shadows_ready.add(e["rank"])
        elif kind == "shadow_died":
            if e["gen"] == self._shadow_gen:
                self.shadows_ready.discard(e["rank"])
        elif kind in ("shadow_reclaimed", "shadows_given_up"):
            self.shadows_ready.clear()
        elif kind == "agent_started":
            self.started_t = e["t"]
        elif kind == "job_finished":
            self.finished_ok = bool(e["ok"])

    def _rank(self, e: dict[str, Any]) -> _RankStats:
        return self.ranks.setdefault(int(e["rank"]), _RankStats())


class _Collector(Collector):
    """Builds every metric family from :class:`_State` at scrape time."""

    def __init__(
        self, state: _State, lock: threading.Lock, node_rank: Callable[[], int | None]
    ) -> None:
        self._state, self._lock, self._node_rank = state, lock, node_rank

    def collect(self) -> Iterator[Metric]:
        rank = self._node_rank()
        node = "" if rank is None else str(rank)
        with self._lock:
            families = list(self._families(self._state, node))
        yield from families

    @staticmethod
    def _families(s: _State, node: str) -> Iterator[Metric]:
        job = GaugeMetricFamily(
            "leto_job_state",
            "1 for the job's current state on this node, else 0",
            labels=["node", "state"],
        )
        current = (
            "running" if s.finished_ok is None else ("succeeded" if s.finished_ok else "failed")
        )
        for state in ("running", "succeeded", "failed"):
            job.add_metric([node, state], float(state == current))
        yield job
        if s.started_t is not None:
            yield _one(
                GaugeMetricFamily(
                    "leto_job_start_time_seconds",
                    "When this node's agent started (unix time)",
                    labels=["node"],
                    unit="seconds",
                ),
                node,
                s.started_t,
            )

        steps = CounterMetricFamily(
            "leto_steps",
            "Training steps completed (redone steps count again)",
            labels=["node", "rank"],
        )
        last = GaugeMetricFamily(
            "leto_last_step", "The latest completed step's number", labels=["node", "rank"]
        )
        iter_s = GaugeMetricFamily(
            "leto_iteration_seconds",
            "The latest completed step's iteration time",
            labels=["node", "rank"],
            unit="seconds",
        )
        loss = GaugeMetricFamily(
            "leto_loss", "The latest loss the training script reported", labels=["node", "rank"]
        )
        ettr = GaugeMetricFamily(
            "leto_ettr_ratio",
            "Effective training time ratio: productive step time over "
            "wall time since the first step",
            labels=["node", "rank"],
            unit="ratio",
        )
        pages = CounterMetricFamily(
            "leto_pages_rebuilt",
            "Lost retained-state pages rebuilt from parity",
            labels=["node", "rank"],
        )
        for r in sorted(s.ranks):
            stats, labels = s.ranks[r], [node, str(r)]
            steps.add_metric(labels, stats.steps)
            last.add_metric(labels, stats.last_step)
            iter_s.add_metric(labels, stats.iter_s)
            if stats.loss is not None:
                loss.add_metric(labels, stats.loss)
            value = s.summary.ettr(r)
            if value is not None:
                ettr.add_metric(labels, value)
            if stats.pages_rebuilt:
                pages.add_metric(labels, stats.pages_rebuilt)
        yield from (steps, last, iter_s, loss, ettr, pages)

        for name, doc, counts in (
            ("leto_recoveries", "In-place recoveries (shadow generations promoted)", s.recoveries),
            (
                "leto_group_restarts",
                "Group restarts (torchrun's path, counted against --max-restarts)",
                s.restarts,
            ),
        ):
            family = CounterMetricFamily(name, doc, labels=["node", "cause"])
            for cause, n in sorted(counts.items()):
                family.add_metric([node, cause], n)
            yield family

        total = GaugeMetricFamily(
            "leto_last_recovery_seconds",
            "The latest complete in-place recovery, from "
            "the failure until every rank completed the interrupted step",
            labels=["node"],
            unit="seconds",
        )
        phases = GaugeMetricFamily(
            "leto_last_recovery_phase_seconds",
            "The latest complete in-place recovery's phases",
            labels=["node", "phase"],
            unit="seconds",
        )
        done = [rec for rec in s.summary.recoveries() if rec.total_s is not None]
        if done:
            total.add_metric([node], done[-1].total_s)
            for phase, seconds in done[-1].phases.items():
                phases.add_metric([node, phase], seconds)
        yield from (total, phases)

        if s.shadow_level is not None:
            yield _one(
                GaugeMetricFamily(
                    "leto_shadow_level",
                    "Pre-initialisation level of the latest shadow generation spawned",
                    labels=["node"],
                ),
                node,
                s.shadow_level,
            )
        yield _one(
            GaugeMetricFamily(
                "leto_shadows_ready",
                "Shadows of the next generation that are ready",
                labels=["node"],
            ),
            node,
            len(s.shadows_ready),
        )


def _one(family: GaugeMetricFamily, node: str, value: float) -> GaugeMetricFamily:
    family.add_metric([node], value)
    return family


class MetricsServer:
    """This node's ``/metrics`` endpoint, fed from the events file (started after the
    dashboard, stopped with it).

    ``port``: None serves nothing (start and stop do nothing); 0 binds a free port, found in
    :attr:`port` after :meth:`start`. ``node_rank``: the node's rank, or how to read it
    (None until rendezvous). ``offset``: where this job's events begin in the file."""

    def __init__(
        self,
        events: EventLog,
        port: int | None,
        *,
        node_rank: int | Callable[[], int | None],
        offset: int = 0,
        addr: str = "0.0.0.0",
        poll_interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        if events.path is None:
            raise ValueError("MetricsServer needs an events file to read")
        self.port = port
        self.addr = addr
        self._events = events
        self._poll_interval_s = poll_interval_s
        self._tail = EventTail(events.path, offset)
        self._state = _State()
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        """Private: the endpoint shows this job's metrics only, not the process's defaults."""
        self.registry.register(
            _Collector(
                self._state, self._lock, node_rank if callable(node_rank) else lambda: node_rank
            )
        )
        self._server: WSGIServer | None = None
        self._server_thread: threading.Thread | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        """Bind, say where (one line on stderr, a ``metrics_serving`` event), start polling."""
        if self.port is None:
            return
        try:
            self._server, self._server_thread = start_http_server(
                self.port, addr=self.addr, registry=self.registry
            )
        except OSError as e:
            raise ConfigError(
                f"--metrics-port / leto.metrics_port {self.port}: cannot listen on {self.addr} ({e.strerror}); "
                "choose a free port, or 0 for any"
            ) from None
        self.port = self._server.server_port
        url = f"http://{socket.gethostname()}:{self.port}/metrics"
        print(f"leto-run: metrics at {url}", file=sys.stderr, flush=True)
        self._events.emit(Kind.METRICS_SERVING, port=self.port, addr=self.addr, url=url)
        self._thread = threading.Thread(target=self._run, name="leto-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Take in the last events (the job's end), then close the endpoint."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._server is None:
            return
        self.poll()
        self._server.shutdown()
        self._server.server_close()
        if self._server_thread is not None:
            self._server_thread.join(timeout=5)
        self._server = None

    def poll(self) -> None:
        """Fold the events appended since the last call into the metrics."""
        with self._lock:
            for event in self._tail.new_events():
                try:
                    self._state.add(event)
                except (KeyError, TypeError, ValueError):  # a malformed event costs itself only
                    logger.debug("metrics: skipped malformed event %r", event)

    def _run(self) -> None:
        while True:
            self.poll()
            if self._stop.wait(self._poll_interval_s):
                return
