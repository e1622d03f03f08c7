"""The event stream's contract: ``docs/EVENTS.md`` describes ``leto.events.SCHEMA`` exactly,
and a real job with failures in two phases writes only events that validate against it,
with a ``step_done`` for every step on every rank and each recovery's phases in its
``recovery_done``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from leto.config import FaultSpec
from leto.events import (
    COMMON,
    SCHEMA,
    SCHEMA_VERSION,
    EventLog,
    Kind,
    last_event,
    read_events,
    type_name,
    validate,
)
from leto.summary import Summary
from leto.trainer.state import report_unreported
from tests.launcher.harness import run_leto

DOC = Path(__file__).resolve().parents[1] / "docs" / "EVENTS.md"
STEPS = 12
FAULTS = [
    FaultSpec(rank=1, step=5, phase="update", shadow_ready_steps_before=1),
    FaultSpec(rank=0, step=9, phase="backward", shadow_ready_steps_before=1),
]


def _rows(section: str) -> dict[str, tuple[str, str, bool]]:
    """A field table: name -> (type, unit, required)."""
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        name, type_, unit, required = cells[0].strip("`"), cells[1], cells[2], cells[3]
        assert required in ("yes", "no"), line
        assert name not in rows, f"{name} listed twice"
        rows[name] = (type_, unit, required == "yes")
    return rows


def _spec(fields: dict) -> dict[str, tuple[str, str, bool]]:
    return {name: (type_name(f.type), f.unit, f.required) for name, f in fields.items()}


def test_the_doc_describes_the_schema_exactly() -> None:
    text = DOC.read_text()
    common = text[
        text.index("## Common fields") : text.index("## ", text.index("## Common fields") + 3)
    ]
    assert _rows(common) == _spec(COMMON)
    kinds = {}
    for m in re.finditer(r"^### `(\w+)`\n(.*?)(?=^### |\Z)", text, re.MULTILINE | re.DOTALL):
        writer = re.search(r"^Writer: \*\*(\w+)\*\*", m.group(2), re.MULTILINE)
        assert writer, f"{m.group(1)}: no writer"
        kinds[m.group(1)] = (writer.group(1), _rows(m.group(2)))
    assert sorted(kinds) == sorted(k.value for k in SCHEMA)
    for kind, spec in SCHEMA.items():
        writer, rows = kinds[kind.value]
        assert writer == spec.writer, kind
        assert rows == _spec(spec.fields), kind
    assert set(SCHEMA) == set(Kind)


def test_units_follow_the_field_names() -> None:
    suffixes = {"_s": "s", "_ms": "ms", "_t": "unix s", "_bytes": "bytes"}
    for fields in (COMMON, *(s.fields for s in SCHEMA.values())):
        for name, f in fields.items():
            want = next((u for suffix, u in suffixes.items() if name.endswith(suffix)), "")
            assert f.unit == (want or {"t": "unix s", "seconds": "s"}.get(name, "")), name


def test_validate_names_what_is_wrong() -> None:
    ok = {
        "t": 1.0,
        "kind": Kind.STEP_DONE.value,
        "src": "trainer0",
        "schema_version": 1,
        "rank": 0,
        "step": 3,
        "iter_s": 1,
    }
    assert validate(ok) == []
    assert validate({**ok, "loss": None, "total": 12, "finished_in_recovery": True}) == []
    assert validate({**ok, "rank": "0"}) == ["step_done.rank: '0' is not int"]
    assert validate({**ok, "rank": True}) == ["step_done.rank: True is not int"]
    assert validate({**ok, "ranks": [0]}) == ["step_done: unknown field 'ranks'"]
    assert validate({k: v for k, v in ok.items() if k != "iter_s"}) == [
        "step_done: missing field 'iter_s'"
    ]
    assert validate({**ok, "kind": "stepped"}) == ["unknown kind 'stepped'"]
    lost = {
        "t": 1.0,
        "kind": Kind.PAGES_REBUILT.value,
        "src": "trainer0",
        "schema_version": 1,
        "rank": 0,
        "gen": 1,
        "lost": {"state": {"data": "2"}},
        "rebuild_s": 0.1,
        "localize_s": 0.0,
        "phase": "IDLE",
    }
    assert validate(lost) == [
        "pages_rebuilt.lost: {'state': {'data': '2'}} is not dict[str, dict[str, int]]"
    ]


def test_emit_writes_the_schema_version(tmp_path) -> None:
    log = EventLog(tmp_path / "e.jsonl", source="agent")
    log.emit(Kind.STATE_MANAGER_DIED, how="exit code 1", gen=0)
    log.close()
    (event,) = read_events(tmp_path / "e.jsonl")
    assert event["schema_version"] == SCHEMA_VERSION and validate(event) == []


def test_last_event_reads_back_across_blocks_and_skips_a_cut_line(tmp_path) -> None:
    path = tmp_path / "e.jsonl"
    log, other = EventLog(path, source="trainer1"), EventLog(path, source="trainer0")
    other.emit(Kind.STEP_DONE, rank=0, step=0, iter_s=0.1)
    for step in range(5000):  # many 64 KiB blocks
        log.emit(Kind.STEP_DONE, rank=1, step=step, iter_s=0.1)
    with open(path, "ab") as f:
        f.write(b'{"t":1.0,"kind":"step_done","src":"trainer1","ra')  # a line cut short
    assert last_event(path, lambda e: e["src"] == "trainer1")["step"] == 4999
    assert last_event(path, lambda e: e["src"] == "trainer0")["step"] == 0
    assert last_event(path, lambda e: e["src"] == "trainer0", within_bytes=1 << 12) is None
    assert last_event(tmp_path / "missing.jsonl", lambda e: True) is None


@pytest.mark.parametrize(("last_reported", "written"), [(None, [4]), (3, [4]), (4, []), (5, [])])
def test_a_promoted_trainer_reports_the_step_its_predecessor_did_not(
    tmp_path, last_reported, written
) -> None:
    path = tmp_path / "e.jsonl"
    log = EventLog(path, source="trainer1")
    if last_reported is not None:
        log.emit(Kind.STEP_DONE, rank=1, step=last_reported, iter_s=0.1, loss=2.5)
    EventLog(path, source="trainer0").emit(Kind.STEP_DONE, rank=0, step=4, iter_s=0.1)
    report_unreported(log, rank=1, step=4, total=STEPS, iter_s=0.25)
    new = [e for e in read_events(path) if e.get("finished_in_recovery")]
    assert [e["step"] for e in new] == written
    for e in new:
        assert (e["rank"], e["loss"], e["iter_s"], e["total"]) == (
            1,
            None,
            0.25,
            STEPS,
        ) and validate(e) == []


def test_a_node_that_did_not_see_the_failure_times_its_recovery_from_the_epoch() -> None:
    def ev(t: float, kind: str, src: str = "agent", **fields) -> dict:
        return {"t": t, "kind": kind, "src": src, "schema_version": 1, **fields}

    epoch = {
        "epoch": 1,
        "action": "in_place",
        "failure": "hof",
        "node": 0,
        "cold": False,
        "reason": "trainer killed",
        "detected_t": 10.0,
        "root_ranks": [1],
    }
    events = [
        ev(10.2, Kind.EPOCH.value, remote=True, **epoch),
        ev(10.3, Kind.ACTIVES_STOPPED.value, gen=0, stop_s=0.3),
        ev(10.4, Kind.SHADOWS_PROMOTED.value, gen=1, epoch=1, promote_t=10.4, node=1, cold=False),
        ev(
            10.5,
            Kind.PROMOTED.value,
            "trainer2",
            rank=2,
            gen=1,
            level=3,
            device_check_s=0.01,
            group_built=False,
        ),
        ev(10.7, Kind.RESUMED.value, "trainer2", rank=2, step=6, action="none", gen=1),
        ev(10.8, Kind.STEP_DONE.value, "trainer2", rank=2, step=6, iter_s=0.1),
    ]
    (rec,) = Summary.of(events).recoveries()
    assert rec.failed_ranks == [1] and rec.total_s == pytest.approx(0.8)
    assert rec.phases == pytest.approx(
        {
            "detect": 0.0,
            "stop": 0.3,
            "promote": 0.1,
            "wake": 0.1,
            "attach+decide": 0.2,
            "first step": 0.1,
        }
    )
    # a node that saw a failure itself and then lost the decision to another node's record
    # follows that record: one recovery, not two
    local = ev(
        10.0,
        Kind.FAILURE_DETECTED.value,
        ranks=[2],
        exit_codes=[-9],
        root_ranks=[2],
        gen=0,
        detected_t=10.0,
        failure="hof",
        in_a_row=1,
    )
    assert len(Summary.of([local, *events]).recoveries()) == 1


def test_a_failure_answered_by_a_group_restart_pairs_with_no_later_promotion() -> None:
    def ev(t: float, kind: str, **fields) -> dict:
        return {"t": t, "kind": kind, "src": "agent", "schema_version": 1, **fields}

    def failure(t: float, root: int) -> dict:
        return ev(
            t,
            Kind.FAILURE_DETECTED.value,
            ranks=[0, 1],
            exit_codes=[-9, -9],
            root_ranks=[root],
            gen=0,
            detected_t=t,
            failure="hof",
            in_a_row=1,
        )

    events = [
        failure(5.0, 1),  # no shadows: answered by a group restart
        ev(
            5.5,
            Kind.GROUP_RESTART.value,
            restart=1,
            reason="hof on node 0: no shadows",
            recoveries=0,
        ),
        failure(20.0, 0),
        ev(20.25, Kind.ACTIVES_STOPPED.value, gen=0, stop_s=0.25),
        ev(20.5, Kind.SHADOWS_PROMOTED.value, gen=1, epoch=1, promote_t=20.5, node=0, cold=False),
    ]
    (rec,) = Summary.of(events).recoveries()
    assert rec.failed_ranks == [0] and rec.phases["detect"] == 0.0 and rec.phases["stop"] == 0.25


# -- a real job --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    proc, events = run_leto(tmp_path_factory.mktemp("events"), steps=STEPS, faults=FAULTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return events


@pytest.mark.timeout(400)
def test_a_job_with_failures_writes_only_valid_events(job) -> None:
    problems = [(e["kind"], p) for e in job for p in validate(e)]
    assert problems == []
    assert {e["schema_version"] for e in job} == {SCHEMA_VERSION}
    kinds = {e["kind"] for e in job}
    assert {
        Kind.AGENT_STARTED,
        Kind.WORKERS_STARTED,
        Kind.SHADOWS_SPAWNED,
        Kind.SHADOW_LEVEL,
        Kind.TRAINER_STARTED,
        Kind.SHADOW_READY,
        Kind.FAULT_INJECTED,
        Kind.FAILURE_DETECTED,
        Kind.EPOCH,
        Kind.ACTIVES_STOPPED,
        Kind.SHADOWS_PROMOTED,
        Kind.PROMOTED,
        Kind.RESUMED,
        Kind.STEP_DONE,
        Kind.RECOVERY_DONE,
        Kind.DIGEST,
        Kind.JOB_FINISHED,
    } <= kinds
    assert json.dumps(job)  # plain JSON throughout


@pytest.mark.timeout(400)
def test_every_step_is_done_on_every_rank(job) -> None:
    done = [e for e in job if e["kind"] == Kind.STEP_DONE]
    for rank in (0, 1):
        assert {e["step"] for e in done if e["rank"] == rank} == set(range(STEPS)), rank
    # rank 1 finished step 5's update in the recovery; any rank stopped in the instant
    # between committing the step before a failure (5, or 8 before the kill in step 9) and
    # writing its step_done has it reported by its successor
    finished = {(e["rank"], e["step"], e["loss"]) for e in done if e.get("finished_in_recovery")}
    assert (1, 5, None) in finished
    assert finished <= {(r, s, None) for r in (0, 1) for s in (5, 8)}
    (resumed,) = [e for e in job if e["kind"] == Kind.RESUMED and e["rank"] == 1 and e["gen"] == 1]
    assert resumed["action"] == "restore+finish" and resumed["step"] == 6
    assert all(isinstance(e["loss"], float) for e in done if not e.get("finished_in_recovery"))


@pytest.mark.timeout(400)
def test_ranks_are_integers_and_lists_line_up(job) -> None:
    failures = [e for e in job if e["kind"] == Kind.FAILURE_DETECTED]
    assert [e["root_ranks"] for e in failures] == [[1], [0]]
    for e in failures:
        assert (
            e["ranks"] == [0, 1]
            and len(e["exit_codes"]) == 2
            and all(c < 0 for c in e["exit_codes"])
        )
    started = {(e["gen"], e["rank"], e["pid"]) for e in job if e["kind"] == Kind.TRAINER_STARTED}
    promoted = {e["gen"] for e in job if e["kind"] == Kind.SHADOWS_PROMOTED}
    for e in job:
        if e["kind"] in (Kind.WORKERS_STARTED, Kind.SHADOWS_SPAWNED):
            assert e["ranks"] == [0, 1] and len(e["pids"]) == 2
        gen = 0 if e["kind"] == Kind.WORKERS_STARTED else e.get("gen")
        if e["kind"] == Kind.WORKERS_STARTED or (
            e["kind"] == Kind.SHADOWS_SPAWNED and gen in promoted
        ):
            assert {
                (gen, r, pid) for r, pid in zip(e["ranks"], e["pids"], strict=True)
            } <= started, e


@pytest.mark.timeout(400)
def test_recovery_done_carries_the_summarys_phases(job) -> None:
    done = [e for e in job if e["kind"] == Kind.RECOVERY_DONE]
    recs = {r.gen: r for r in Summary.of(job).recoveries()}
    assert [e["gen"] for e in done] == [1, 2] and sorted(recs) == [1, 2]
    for e in done:
        rec = recs[e["gen"]]
        assert e["phases_s"] == rec.phases and e["total_s"] == rec.total_s
        assert list(e["phases_s"]) == [
            "detect",
            "stop",
            "promote",
            "wake",
            "attach+decide",
            "first step",
        ]
        assert all(v >= 0 for v in e["phases_s"].values())
        assert e["total_s"] == pytest.approx(sum(e["phases_s"].values()))
