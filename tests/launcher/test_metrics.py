"""The agent's Prometheus endpoint (``--metrics-port``), scraped over real HTTP.

A synthetic events file shaped as a real job writes it (a kill answered in place, a fatal
failure answered by a group restart) pins every value; one real job is scraped while it runs.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from leto.errors import ConfigError
from leto.events import EventLog, Kind, read_events, validate
from leto.summary import Summary
from leto_run.metrics import MetricsServer, _State
from tests.launcher.harness import GPT, LETO_RUN, _env

JOB = """\
{"t":100.0,"kind":"agent_started","src":"agent","schema_version":1,"entrypoint":"examples/train_gpt.py","nproc":2}
{"t":100.5,"kind":"workers_started","src":"agent","schema_version":1,"restart":0,"pids":[10,11],"ranks":[0,1],"warm":false}
{"t":101.0,"kind":"trainer_started","src":"trainer0","schema_version":1,"rank":0,"gen":0,"role":"active","pid":10,"before_init_s":4.3,"store_s":0.01,"context_s":0.002,"deterministic":false}
{"t":101.0,"kind":"trainer_started","src":"trainer1","schema_version":1,"rank":1,"gen":0,"role":"active","pid":11,"before_init_s":4.3,"store_s":0.01,"context_s":0.002,"deterministic":false}
{"t":101.0,"kind":"shadow_level","src":"agent","schema_version":1,"gen":1,"level":3,"reason":"configured","headroom_bytes":null,"free_bytes":null,"peak_bytes":null,"needed_bytes":0}
{"t":101.25,"kind":"shadows_spawned","src":"agent","schema_version":1,"gen":1,"pids":[20,21],"ranks":[0,1],"level":3,"launch":0}
{"t":102.0,"kind":"step_done","src":"trainer0","schema_version":1,"rank":0,"step":0,"iter_s":0.5,"loss":5.0}
{"t":102.0,"kind":"step_done","src":"trainer1","schema_version":1,"rank":1,"step":0,"iter_s":0.5,"loss":5.0}
{"t":102.25,"kind":"shadow_ready","src":"trainer0","schema_version":1,"rank":0,"gen":1,"level":3,"init_s":1.0}
{"t":102.25,"kind":"shadow_ready","src":"trainer1","schema_version":1,"rank":1,"gen":1,"level":3,"init_s":1.0}
{"t":102.5,"kind":"step_done","src":"trainer0","schema_version":1,"rank":0,"step":1,"iter_s":0.5,"loss":4.9375}
{"t":102.5,"kind":"step_done","src":"trainer1","schema_version":1,"rank":1,"step":1,"iter_s":0.5,"loss":4.9375}
{"t":103.0,"kind":"step_done","src":"trainer0","schema_version":1,"rank":0,"step":2,"iter_s":0.5,"loss":4.875}
{"t":103.0,"kind":"step_done","src":"trainer1","schema_version":1,"rank":1,"step":2,"iter_s":0.5,"loss":4.875}
{"t":103.5,"kind":"step_done","src":"trainer0","schema_version":1,"rank":0,"step":3,"iter_s":0.5,"loss":4.8125}
{"t":103.5,"kind":"step_done","src":"trainer1","schema_version":1,"rank":1,"step":3,"iter_s":0.5,"loss":4.8125}
{"t":104.0,"kind":"step_done","src":"trainer0","schema_version":1,"rank":0,"step":4,"iter_s":0.5,"loss":4.75}
{"t":104.0,"kind":"step_done","src":"trainer1","schema_version":1,"rank":1,"step":4,"iter_s":0.5,"loss":4.75}
{"t":104.5,"kind":"step_done","src":"trainer0","schema_version":1,"rank":0,"step":5,"iter_s":0.5,"loss":4.6875}
{"t":104.5,"kind":"fault_injected","src":"trainer1","schema_version":1,"rank":1,"step":5,"phase":"update","fault":0,"point":null,"chunk":null,"fault_kind":"kill"}
{"t":104.75,"kind":"failure_detected","src":"agent","schema_version":1,"ranks":[0,1],"exit_codes":[-9,-9],"root_ranks":[1],"gen":0,"detected_t":104.625,"failure":"hof","in_a_row":1}
{"t":104.75,"kind":"epoch","src":"agent","schema_version":1,"epoch":1,"action":"in_place","failure":"hof","node":0,"remote":false,"cold":false,"reason":"trainer killed","detected_t":104.625,"root_ranks":[1]}
{"t":104.75,"kind":"actives_stopped","src":"agent","schema_version":1,"gen":0,"stop_s":0.125}
{"t":105.0,"kind":"shadows_promoted","src":"agent","schema_version":1,"gen":1,"epoch":1,"promote_t":105.0,"node":0,"cold":false}
{"t":105.0,"kind":"shadow_level","src":"agent","schema_version":1,"gen":2,"level":3,"reason":"recovery","headroom_bytes":null,"free_bytes":null,"peak_bytes":null,"needed_bytes":0}
{"t":105.25,"kind":"promoted","src":"trainer1","schema_version":1,"rank":1,"gen":1,"level":3,"device_check_s":0.002,"group_built":false}
{"t":105.25,"kind":"promoted","src":"trainer0","schema_version":1,"rank":0,"gen":1,"level":3,"device_check_s":0.002,"group_built":false}
{"t":105.25,"kind":"shadows_spawned","src":"agent","schema_version":1,"gen":2,"pids":[30,31],"ranks":[0,1],"level":3,"launch":0}
{"t":105.375,"kind":"pages_rebuilt","src":"trainer1","schema_version":1,"rank":1,"gen":1,"rebuild_s":0.01,"localize_s":0.001,"phase":"UPDATE","lost":{"state":{"data":2,"tier1":1,"tier2":0},"grads":{"data":1,"tier1":0,"tier2":0}}}
{"t":105.4375,"kind":"step_done","src":"trainer1","schema_version":1,"rank":1,"step":5,"total":null,"iter_s":0.0625,"loss":null,"finished_in_recovery":true}
{"t":105.5,"kind":"resumed","src":"trainer0","schema_version":1,"rank":0,"gen":1,"step":6,"action":"none","points":[[6,0],[5,4]],"attach_s":0.03,"decide_s":0.02}
{"t":105.5,"kind":"resumed","src":"trainer1","schema_version":1,"rank":1,"gen":1,"step":6,"action":"restore+finish","points":[[6,0],[5,4]],"attach_s":0.03,"decide_s":0.02}
{"t":106.0,"kind":"step_done","src":"trainer1","schema_version":1,"rank":1,"step":6,"iter_s":0.5,"loss":4.625}
{"t":106.0,"kind":"step_done","src":"trainer0","schema_version":1,"rank":0,"step":6,"iter_s":0.5,"loss":4.625}
{"t":106.0,"kind":"recovery_done","src":"agent","schema_version":1,"gen":1,"epoch":1,"detected_t":104.625,"stopped_t":104.75,"cold":false,"done_t":106.0,"phases_s":{"detect":0.125,"stop":0.125,"promote":0.25,"wake":0.25,"attach+decide":0.25,"first step":0.5},"total_s":1.5}
{"t":107.0,"kind":"fault_injected","src":"trainer0","schema_version":1,"rank":0,"step":7,"phase":"forward","fault":1,"point":null,"chunk":null,"fault_kind":"fatal"}
{"t":107.25,"kind":"failure_detected","src":"agent","schema_version":1,"ranks":[0,1],"exit_codes":[-9,-15],"root_ranks":[0],"gen":1,"detected_t":107.125,"failure":"ff","in_a_row":1}
{"t":107.25,"kind":"epoch","src":"agent","schema_version":1,"epoch":2,"action":"restart","failure":"ff","node":0,"remote":false,"cold":false,"reason":"fatal failure: hardware or retained state unusable","detected_t":107.125,"root_ranks":[0]}
{"t":107.5,"kind":"group_restart","src":"agent","schema_version":1,"restart":1,"recoveries":1,"reason":"ff on node 0: fatal failure: hardware or retained state unusable"}
{"t":108.0,"kind":"workers_started","src":"agent","schema_version":1,"restart":1,"pids":[40,41],"ranks":[0,1],"warm":true}
{"t":108.5,"kind":"shadow_level","src":"agent","schema_version":1,"gen":1,"level":1,"reason":"headroom","headroom_bytes":1073741824,"free_bytes":2147483648,"peak_bytes":1073741824,"needed_bytes":536870912}
{"t":108.75,"kind":"shadows_spawned","src":"agent","schema_version":1,"gen":1,"pids":[50,51],"ranks":[0,1],"level":1,"launch":0}
{"t":109.0,"kind":"shadow_ready","src":"trainer0","schema_version":1,"rank":0,"gen":1,"level":1,"init_s":0.25}
{"t":109.5,"kind":"step_done","src":"trainer0","schema_version":1,"rank":0,"step":6,"iter_s":0.5,"loss":4.625}
{"t":109.5,"kind":"step_done","src":"trainer1","schema_version":1,"rank":1,"step":6,"iter_s":0.5,"loss":4.625}
{"t":110.0,"kind":"step_done","src":"trainer0","schema_version":1,"rank":0,"step":7,"iter_s":0.5,"loss":4.5625}
{"t":110.0,"kind":"step_done","src":"trainer1","schema_version":1,"rank":1,"step":7,"iter_s":0.5,"loss":4.5625}
"""
"""Two ranks, as the agent and the trainers write them (shapes from a real run's file): rank 1
killed in step 5's update and recovered in place (the kill at 104.5 until step 6 on both ranks
at 106.0: 1.5 s), then a fatal failure, answered by a group restart (steps 6 and 7 again).
Times are exact in binary, so phases compare with ``==``."""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _get(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def _labels(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


def test_scrape_reports_a_synthetic_job_exactly(tmp_path, capsys) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(
        json.dumps(
            {
                "t": 1.0,
                "kind": Kind.STEP_DONE.value,
                "src": "trainer0",
                "rank": 0,
                "step": 0,
                "iter_s": 1.0,
            }
        )
        + "\n"
    )
    offset = path.stat().st_size  # an earlier job's events in a reused file are not this job's
    with open(path, "a") as f:
        f.write(JOB)
    events = [json.loads(line) for line in JOB.splitlines()]
    assert [p for e in events for p in validate(e)] == []
    log = EventLog(path, source="agent")
    server = MetricsServer(log, 0, node_rank=3, offset=offset)
    server.start()
    try:
        port = server.port
        assert port
        line = f"leto-run: metrics at http://{socket.gethostname()}:{port}/metrics"
        assert capsys.readouterr().err.splitlines() == [line]
        (serving,) = [e for e in read_events(path) if e["kind"] == Kind.METRICS_SERVING]
        assert serving["port"] == port
        server.poll()  # the thread polls too; this makes the first scrape complete
        s = _scrape(port)
        node = {"node": "3"}
        assert {name for name, _ in s} <= {
            f"leto_{n}"
            for n in (  # a private registry: no process metrics
                "job_state",
                "job_start_time_seconds",
                "steps_total",
                "last_step",
                "iteration_seconds",
                "loss",
                "ettr_ratio",
                "pages_rebuilt_total",
                "recoveries_total",
                "group_restarts_total",
                "last_recovery_seconds",
                "last_recovery_phase_seconds",
                "shadow_level",
                "shadows_ready",
            )
        }
        assert _series(s, "leto_job_state") == {
            _labels(**node, state="running"): 1.0,
            _labels(**node, state="succeeded"): 0.0,
            _labels(**node, state="failed"): 0.0,
        }
        assert _get(s, "leto_job_start_time_seconds", **node) == 100.0
        # steps 0-5, 6 after the recovery, 6-7 after the restart; rank 1's step 5 was finished
        # by its promoted shadow (restore+finish), which reports it
        assert _get(s, "leto_steps_total", **node, rank="0") == 9
        assert _get(s, "leto_steps_total", **node, rank="1") == 9
        assert _get(s, "leto_last_step", **node, rank="1") == 7
        assert _get(s, "leto_iteration_seconds", **node, rank="0") == 0.5
        assert _get(s, "leto_loss", **node, rank="1") == 5.0 - 7 / 16
        summary = Summary.of(events)
        for rank in ("0", "1"):
            assert _get(s, "leto_ettr_ratio", **node, rank=rank) == summary.ettr(int(rank))
        assert _series(s, "leto_recoveries_total") == {_labels(**node, cause="hof"): 1}
        assert _series(s, "leto_group_restarts_total") == {_labels(**node, cause="ff"): 1}
        assert _get(s, "leto_last_recovery_seconds", **node) == 1.5
        phases = {
            dict(labels)["phase"]: v
            for labels, v in _series(s, "leto_last_recovery_phase_seconds").items()
        }
        assert phases == {
            "detect": 0.125,
            "stop": 0.125,
            "promote": 0.25,
            "wake": 0.25,
            "attach+decide": 0.25,
            "first step": 0.5,
        }
        assert phases == summary.recoveries()[0].phases
        assert _series(s, "leto_pages_rebuilt_total") == {_labels(**node, rank="1"): 4}
        assert _get(s, "leto_shadow_level", **node) == 1  # the restarted job's generation
        assert _get(s, "leto_shadows_ready", **node) == 1

        # The thread takes in what is appended later.
        with open(path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "t": 110.0,
                        "kind": Kind.JOB_FINISHED.value,
                        "src": "agent",
                        "ok": True,
                        "recoveries": 1,
                        "restarts": 1,
                    }
                )
                + "\n"
            )
        deadline = time.monotonic() + 10
        while _get(_scrape(port), "leto_job_state", **node, state="succeeded") != 1.0:
            assert time.monotonic() < deadline, "the poll thread never took in job_finished"
            time.sleep(0.05)
    finally:
        server.stop()
        log.close()
    with pytest.raises(OSError):
        _scrape(port)  # stopped: the port is closed


def test_causes_of_hangs_and_of_restarts_without_an_epoch() -> None:
    state = _State()
    for line in (
        '{"t":1.0,"kind":"hang_detected","src":"agent","rank":0,"gen":0,"idle_s":61.0,"timeout_s":60.0,"proc_state":"S"}',
        '{"t":1.5,"kind":"failure_detected","src":"agent","ranks":[0],"exit_codes":[-9],"root_ranks":[0],"gen":0,"detected_t":1.5,"failure":"hof","in_a_row":1}',
        '{"t":1.5,"kind":"epoch","src":"agent","epoch":1,"action":"in_place","failure":"hof","node":0,"remote":false,"cold":false,"reason":"trainer killed"}',
        '{"t":1.75,"kind":"shadows_promoted","src":"agent","gen":1,"epoch":1,"promote_t":1.75,"node":0,"cold":false}',
        # a script without the leto API: torchrun's restart, which no epoch decided
        '{"t":3.0,"kind":"group_restart","src":"agent","restart":1,"recoveries":1,"reason":"worker failure"}',
    ):
        state.add(json.loads(line))
    assert state.recoveries == {"hang": 1}
    assert state.restarts == {"worker_failure": 1}


def test_a_port_in_use_is_one_line_naming_the_flag(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = EventLog(tmp_path / "events.jsonl", source="agent")
        server = MetricsServer(log, port, node_rank=0)
        with pytest.raises(
            ConfigError, match=rf"--metrics-port / leto.metrics_port {port}: .*or 0 for any"
        ):
            server.start()
        server.stop()
        log.close()


@pytest.mark.timeout(180)
def test_a_running_job_is_scraped_over_http(tmp_path) -> None:
    events_path, err_path = tmp_path / "events.jsonl", tmp_path / "stderr.txt"
    cmd = [
        *LETO_RUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-dashboard",
        "--events",
        str(events_path),
        "--metrics-port",
        "0",
        "--inject-fault",
        "rank=1,step=5,phase=update",
        GPT,
        "--steps",
        "40",
    ]
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=err
        )
    try:
        deadline = time.monotonic() + 150
        port = None
        while port is None:
            assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()[-3000:]
            serving = [e for e in read_events(events_path) if e["kind"] == Kind.METRICS_SERVING]
            port = serving[0]["port"] if serving else None
            time.sleep(0.1)
        while True:  # the recovery at step 5 leaves ~35 steps (seconds) to see it in
            assert proc.poll() is None and time.monotonic() < deadline, (
                "the job ended before a scrape saw its recovery\n" + err_path.read_text()[-3000:]
            )
            s = _scrape(port)
            steps = [_get(s, "leto_steps_total", node="0", rank=r) or 0 for r in ("0", "1")]
            if min(steps) > 0 and _get(s, "leto_recoveries_total", node="0", cause="hof") == 1:
                break
            time.sleep(0.2)
        assert _get(s, "leto_job_state", node="0", state="running") == 1.0
        assert _get(s, "leto_shadow_level", node="0") == 3
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = err_path.read_text()
    assert proc.returncode == 0, err[-3000:]
    assert err.count("leto-run: metrics at http://") == 1
    assert f"leto-run: metrics at http://{socket.gethostname()}:{port}/metrics" in err.splitlines()


def test_a_loss_reported_a_step_late_is_the_latest_loss() -> None:
    """On CUDA a step's ``step_done`` carries the previous step's loss (``prev_loss``), the
    last step its own; a promoted trainer's first step carries none and keeps the gauge."""
    state = _State()
    for step, fields in enumerate(({}, {"prev_loss": 4.0}, {}, {"loss": 3.0, "prev_loss": 3.5})):
        state.add(
            {
                "t": float(step),
                "kind": "step_done",
                "rank": 0,
                "step": step,
                "iter_s": 0.1,
                "loss": None,
                **fields,
            }
        )
        if step == 1:
            assert state.ranks[0].loss == 4.0
        if step == 2:
            assert state.ranks[0].loss == 4.0
    assert state.ranks[0].loss == 3.0
