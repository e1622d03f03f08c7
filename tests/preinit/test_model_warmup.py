"""The model warm-up's decisions: who runs it, at which level, with how much memory.

A shadow's view of the job is played by a real heartbeat board (the active's memory report
in its words), a real ``HashStore`` (the promotion key) and a real event log; the warm-up
itself is a callable that records that it ran. The end-to-end test (a Megatron job under
leto-run, the shadows warming and then promoted) is tests/integrations/test_megatron_warmup.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch
import torch.distributed as dist

from leto import contract
from leto.contract import GenerationEnv
from leto.events import EventLog, Kind, read_events
from leto.health import Heartbeat, HeartbeatBoard
from leto.preinit import PreinitConfig, board
from leto.preinit.model_warmup import ModelWarmupConfig, warm_model
from leto.preinit.site import ShadowSite

MIB = 1 << 20


def _shadow(tmp_path, level: int, *, active: bool = False) -> tuple[ShadowSite, HeartbeatBoard]:
    hb_board = HeartbeatBoard(1)
    site = ShadowSite(
        rank=0,
        device=torch.device("cpu"),
        env=_env(level),
        heartbeat=Heartbeat(hb_board.path, 0),
        store=dist.HashStore(),
        events=EventLog(tmp_path / "events.jsonl", "trainer0"),
        is_shadow=not active,
    )
    return site, hb_board


def _env(level: int) -> GenerationEnv:
    return GenerationEnv(
        role=contract.ROLE_SHADOW,
        generation=1,
        pool_socket="",
        shadow_level=level,
        preinit=PreinitConfig(margin_bytes=4 * MIB),
    )


def _report(hb_board: HeartbeatBoard, *, total: int, free: int, reserved: int, peak: int) -> None:
    """The active trainer's memory after a committed step (as ``OomGuard.report`` writes it)."""
    for index, value in zip(board.MEM_WORDS, (0, total, free, reserved, peak), strict=True):
        hb_board.set_word(0, index, value)
    hb_board.set_word(0, board.MEM_SEQ, hb_board.word(0, board.MEM_SEQ) + 1)


class _Work:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        torch.nn.Linear(4, 4)(torch.randn(2, 4)).sum().backward()


def _warmed(tmp_path) -> list[dict]:
    return [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == Kind.MODEL_WARMED]


def test_an_l3_shadow_warms_up_once_the_active_reported(tmp_path):
    ctx, hb_board = _shadow(tmp_path, 3)
    _report(hb_board, total=0, free=0, reserved=0, peak=0)  # CPU: a report without memory figures
    work = _Work()
    before = torch.get_rng_state()
    result = warm_model(ctx, work, name="test", transient_bytes=MIB)
    assert work.calls == 1 and result.ran and result.reason == "ok"
    assert torch.equal(torch.get_rng_state(), before), "the warm-up must not move the RNG"
    [event] = _warmed(tmp_path)
    assert (
        event["ran"]
        and event["level"] == 3
        and event["name"] == "test"
        and event["transient_bytes"] == MIB
    )


def test_lower_levels_and_actives_skip_it(tmp_path):
    for level in (1, 2):
        ctx, hb_board = _shadow(tmp_path, level)
        _report(hb_board, total=0, free=0, reserved=0, peak=0)
        work = _Work()
        result = warm_model(ctx, work, name="test")
        assert work.calls == 0 and not result.ran and f"shadow level {level} < 3" in result.reason
    assert [e["level"] for e in _warmed(tmp_path)] == [1, 2]
    assert not any(e["ran"] for e in _warmed(tmp_path))
    ctx, _ = _shadow(tmp_path, 3, active=True)
    work = _Work()
    assert warm_model(ctx, work, name="test") is None and work.calls == 0
    assert len(_warmed(tmp_path)) == 2, "an active trainer emits nothing"


def test_a_group_of_shadows_warms_up_all_or_none(tmp_path):
    """``agree`` (tensor parallelism: the warm-up runs TP collectives) gets each shadow's
    go/no-go; a peer's no-go turns this shadow's go into a skip, and a no-go is still voted."""
    ctx, hb_board = _shadow(tmp_path, 3)
    _report(hb_board, total=0, free=0, reserved=0, peak=0)
    votes, work = [], _Work()
    result = warm_model(ctx, work, name="test", agree=lambda go: votes.append(go) or False)
    assert votes == [True] and work.calls == 0 and not result.ran and "peer" in result.reason
    result = warm_model(ctx, work, name="test", agree=lambda go: votes.append(go) or True)
    assert votes == [True, True] and work.calls == 1 and result.ran
    ctx = dataclasses.replace(ctx, env=_env(2))
    result = warm_model(ctx, work, name="test", agree=lambda go: votes.append(go) or True)
    assert votes == [True, True, False] and work.calls == 1 and "level 2" in result.reason


def test_it_runs_only_within_the_headroom_the_actives_left(tmp_path):
    # free 100 MiB, but the active's peak is 40 MiB above what it holds now: headroom 60 MiB
    ctx, hb_board = _shadow(tmp_path, 3)
    _report(hb_board, total=1000 * MIB, free=100 * MIB, reserved=200 * MIB, peak=240 * MIB)
    work = _Work()
    result = warm_model(ctx, work, name="test", transient_bytes=57 * MIB)  # + 4 MiB margin > 60
    assert work.calls == 0 and not result.ran and result.reason.startswith("headroom 62914560 B")
    result = warm_model(ctx, work, name="test", transient_bytes=56 * MIB)
    assert work.calls == 1 and result.ran


def test_it_waits_for_the_first_report_and_yields_to_a_promotion(tmp_path):
    ctx, hb_board = _shadow(tmp_path, 3)
    threading.Timer(
        0.2, _report, args=(hb_board,), kwargs={"total": 0, "free": 0, "reserved": 0, "peak": 0}
    ).start()
    work = _Work()
    t0 = time.monotonic()
    assert warm_model(ctx, work, name="test").ran and time.monotonic() - t0 >= 0.2
    ctx, hb_board = _shadow(tmp_path, 3)  # no report ever: promoted meanwhile
    threading.Timer(
        0.2, ctx.store.set, args=(contract.promote(ctx.env.generation, ctx.rank), "1")
    ).start()
    result = warm_model(ctx, work, name="test")
    assert work.calls == 1 and not result.ran and result.reason.startswith("promoted before")
    ctx, hb_board = _shadow(tmp_path, 3)  # no report, no promotion: gives up
    result = warm_model(ctx, work, name="test", config=ModelWarmupConfig(report_wait_s=0.1))
    assert work.calls == 1 and not result.ran and result.reason.startswith("no memory report")


def test_a_warm_up_that_raises_is_reported_not_fatal(tmp_path):
    ctx, hb_board = _shadow(tmp_path, 3)
    _report(hb_board, total=0, free=0, reserved=0, peak=0)

    def broken() -> None:
        raise IndexError("index 0 is out of bounds for dimension 0 with size 0")

    result = warm_model(ctx, broken, name="test", transient_bytes=MIB)
    assert not result.ran and result.reason.startswith("failed: IndexError: index 0"), result
    [event] = _warmed(tmp_path)
    assert not event["ran"] and event["reason"] == result.reason
