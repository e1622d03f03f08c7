"""The pre-initialisation controller's decisions, driven with fake memory reports.

Level choice (footprints, free memory, peaks), the controller's state machine and its
board words (a real heartbeat board, trainers played by ``Heartbeat`` handles), and a
trainer's reclaim request answered by a controller in another thread.
"""

from __future__ import annotations

import threading
import time

import pytest

from leto.config import FaultSpec
from leto.errors import ConfigError, ProtocolError
from leto.events import EventLog, Kind, read_events
from leto.faults import FaultInjector
from leto.health import Heartbeat, HeartbeatBoard
from leto.preinit import DeviceMemory, PreinitConfig, ShadowLevel, choose_level
from leto.preinit.controller import PreinitController, ShadowState
from leto.preinit.guard import OomGuard
from leto.preinit.levels import aggregate, footprints
from leto.preinit.probe import EmulatedProbe

GIB, MIB = 1 << 30, 1 << 20
FOOT = footprints(768 * MIB, 1536 * MIB)
MARGIN = 256 * MIB


def _device(
    free_gib: float, *, ranks: int = 1, peak_over_gib: float = 0.0, device: int = 0
) -> DeviceMemory:
    reserved = 10 * GIB
    return DeviceMemory(
        device=device,
        total_bytes=80 * GIB,
        free_bytes=int(free_gib * GIB),
        reserved_bytes=reserved,
        peak_bytes=reserved + int(peak_over_gib * GIB),
        ranks=ranks,
    )


def _choose(devices: list[DeviceMemory], max_level: int = 3, fallback: int = 3) -> ShadowLevel:
    return choose_level(
        devices,
        FOOT,
        max_level=ShadowLevel(max_level),
        margin_bytes=MARGIN,
        reason="t",
        fallback=ShadowLevel(fallback),
    ).level


@pytest.mark.parametrize(
    ("free_gib", "expected"),
    [(40.0, 3), (1.75, 3), (1.74, 2), (1.0, 2), (0.99, 1), (0.0, 1)],
)
def test_highest_level_that_fits_with_margin(free_gib: float, expected: int) -> None:
    assert _choose([_device(free_gib)]) == expected


def test_the_peak_beyond_what_is_reserved_counts_against_the_shadows() -> None:
    # 3 GiB free now, but the allocator will reserve 2 GiB more at its peak.
    dev = _device(3.0, peak_over_gib=2.0)
    assert dev.headroom_bytes == 1 * GIB
    assert _choose([dev]) == 2


def test_ranks_sharing_a_device_each_need_a_shadow() -> None:
    assert _choose([_device(2.0, ranks=1)]) == 3
    assert _choose([_device(2.0, ranks=2)]) == 2  # 2 x 1.5 GiB does not fit, 2 x 0.75 GiB does
    assert _choose([_device(1.5, ranks=2)]) == 1


def test_the_tightest_device_decides_and_is_reported() -> None:
    choice = choose_level(
        [_device(40.0, device=0), _device(1.2, device=1)],
        FOOT,
        max_level=ShadowLevel.L3,
        margin_bytes=MARGIN,
        reason="oom",
        fallback=ShadowLevel.L3,
    )
    assert choice.level == ShadowLevel.L2
    assert choice.headroom_bytes == int(1.2 * GIB) and choice.needed_bytes == 768 * MIB + MARGIN


def test_configured_maximum_and_fallback_without_reports() -> None:
    assert _choose([_device(40.0)], max_level=2) == 2
    assert _choose([], fallback=2) == 2
    assert _choose([], max_level=1, fallback=3) == 1


def test_aggregate_per_device() -> None:
    devices = aggregate([(0, 80, 10, 5, 7), (0, 80, 12, 6, 6), (1, 80, 30, 1, 1)])
    assert [(d.device, d.free_bytes, d.reserved_bytes, d.peak_bytes, d.ranks) for d in devices] == [
        (0, 10, 11, 13, 2),
        (1, 30, 1, 1, 1),
    ]
    assert devices[0].headroom_bytes == 8


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="l3_bytes"):
        PreinitConfig(l2_bytes=2 * GIB, l3_bytes=GIB)
    with pytest.raises(ConfigError, match="emulated_trainer_bytes"):
        PreinitConfig(emulated_device_bytes=GIB, emulated_trainer_bytes=2 * GIB)
    with pytest.raises(ConfigError, match="kind oom needs phase forward or backward"):
        FaultSpec(rank=0, step=1, phase="update", kind="oom")
    with pytest.raises(ConfigError, match="oom_bytes needs kind: oom"):
        FaultSpec(rank=0, step=1, oom_bytes=5)


# -- the controller on a real board ---------------------------------------------------------
@pytest.fixture
def board():
    b = HeartbeatBoard(2)
    yield b
    b.close()


def _emulated_guard(board: HeartbeatBoard, slot: int, trainer_gib: float, tmp_path) -> OomGuard:
    config = PreinitConfig(
        emulated_device_bytes=10 * GIB,
        emulated_trainer_bytes=int(trainer_gib * GIB),
        reclaim_timeout_s=5,
    )
    probe = EmulatedProbe(slot, config.emulated_device_bytes, config.emulated_trainer_bytes)
    return OomGuard(
        Heartbeat(board.path, slot),
        probe,
        config,
        EventLog(tmp_path / "ev.jsonl", f"t{slot}"),
        slot,
    )


def test_state_machine_rejects_undocumented_transitions(board) -> None:
    ctrl = PreinitController(PreinitConfig(), 3, board)
    with pytest.raises(ProtocolError, match="none -> reclaimed"):
        ctrl.reclaimed()
    ctrl.spawned(ShadowLevel.L3, generation=1)
    with pytest.raises(ProtocolError, match="live -> live"):
        ctrl.spawned(ShadowLevel.L2, generation=1)
    ctrl.reclaimed()
    assert ctrl.state is ShadowState.RECLAIMED
    ctrl.closed()
    assert ctrl.state is ShadowState.NONE


def test_reclaim_then_relaunch_lower_then_raise_after_recovery(board, tmp_path) -> None:
    ctrl = PreinitController(PreinitConfig(), 3, board)
    guards = [_emulated_guard(board, s, 4.0, tmp_path) for s in (0, 1)]
    ctrl.spawned(ShadowLevel.L3, generation=1)
    assert [g.shadow_level() for g in guards] == [3, 3]
    for g in guards:
        g.report()
    # Rank 1 needs 5 GiB more at its peak: it asks for the shadows' memory.
    guards[1].demand(5 * GIB + GIB // 2)
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(guards[1].reclaim(step=7)))
    t.start()
    deadline = time.monotonic() + 5
    while not ctrl.requests() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ctrl.requests() == [1]
    ctrl.reclaimed()
    ctrl.answer([1], int(ctrl.level))
    t.join(5)
    assert got == [3] and not ctrl.requests()
    assert [g.shadow_level() for g in guards] == [0, 0]
    assert not ctrl.relaunch_due()  # no step reported since the reclaim
    guards[1].report()
    assert not ctrl.relaunch_due()  # rank 0 has not reported yet
    guards[0].report()
    assert ctrl.relaunch_due()
    choice = ctrl.choose("oom")  # 10 - 9.5 GiB = 0.5 GiB headroom: only L1
    assert choice.level == ShadowLevel.L1 and choice.peak_bytes == int(9.5 * GIB)
    ctrl.spawned(choice.level, generation=1)
    assert [g.shadow_level() for g in guards] == [1, 1]
    # A recovery: fresh actives report their (lower) peak; the level rises again.
    ctrl.closed()
    fresh = [_emulated_guard(board, s, 4.0, tmp_path) for s in (0, 1)]
    for g in fresh:
        g.report()
    assert ctrl.choose("recovery").level == ShadowLevel.L3
    retry = [e for e in read_events(tmp_path / "ev.jsonl") if e["kind"] == Kind.OOM_RETRY]
    assert [(e["rank"], e["step"], e["reclaimed_level"]) for e in retry] == [(1, 7, 3)]


def test_the_level_stays_low_after_recovery_when_the_peak_does_not_allow(board, tmp_path) -> None:
    ctrl = PreinitController(PreinitConfig(), 3, board)
    ctrl.spawned(ShadowLevel.L1, generation=1)  # after reclaims
    ctrl.closed()  # promoted
    for s in (0, 1):
        _emulated_guard(board, s, 8.5, tmp_path).report()  # 1.5 GiB headroom per device
    assert ctrl.choose("recovery").level == ShadowLevel.L2  # raised as far as it fits, not to L3


def test_a_reclaim_only_lowers_and_a_recovery_only_raises(board, tmp_path) -> None:
    ctrl = PreinitController(PreinitConfig(), 3, board)
    for s in (0, 1):
        _emulated_guard(board, s, 1.0, tmp_path).report()  # plenty of headroom now
    ctrl.spawned(ShadowLevel.L2, generation=1)
    ctrl.reclaimed()
    assert ctrl.choose("oom").level == ShadowLevel.L1  # L2 evidently did not fit the step
    ctrl.closed()
    for s in (0, 1):
        _emulated_guard(board, s, 9.9, tmp_path).report()  # no headroom at all
    assert ctrl.choose("recovery").level == ShadowLevel.L2  # no lower than the live level


def test_without_reports_a_reclaim_steps_down_and_a_recovery_returns_to_the_maximum(board) -> None:
    ctrl = PreinitController(PreinitConfig(), 3, board)
    ctrl.spawned(ShadowLevel.L3, generation=1)
    assert ctrl.choose("oom").level == ShadowLevel.L2
    ctrl.closed()
    ctrl.spawned(ShadowLevel.L2, generation=1)
    assert ctrl.choose("oom").level == ShadowLevel.L1
    assert ctrl.choose("recovery").level == ShadowLevel.L3


def test_the_heartbeat_reset_keeps_the_controller_words(board, tmp_path) -> None:
    ctrl = PreinitController(PreinitConfig(), 3, board)
    ctrl.spawned(ShadowLevel.L2, generation=1)
    _emulated_guard(board, 0, 4.0, tmp_path).report()
    board.reset()  # HangWatch.arm() at every promotion
    assert board.word(0, 2) == 2 and ctrl.reports()[0].total_bytes == 10 * GIB


def test_an_unanswered_reclaim_times_out_and_reclaims_nothing(board, tmp_path) -> None:
    guard = _emulated_guard(board, 0, 4.0, tmp_path)
    guard.config.reclaim_timeout_s = 0.05
    assert guard.reclaim(step=1) == 0


def test_oom_fault_fires_only_while_shadows_exist(tmp_path) -> None:
    import torch

    claimed: set[int] = set()

    def claim(i: int) -> bool:
        new = i not in claimed
        claimed.add(i)
        return new

    events = EventLog(tmp_path / "ev.jsonl", "t")
    inj = FaultInjector(
        0, [FaultSpec(rank=0, step=3, phase="backward", kind="oom", oom_bytes=7)], events, claim
    )
    demanded: list[int] = []
    inj.on_oom = demanded.append
    inj.step = 3
    inj.point("backward")  # no shadows: nothing happens, the fault stays pending
    assert not claimed
    inj.shadow_present = lambda: True  # OomGuard.shadows_hold_memory: L2 or L3 shadows
    with pytest.raises(torch.OutOfMemoryError, match="beside this node's shadows"):
        inj.point("backward")
    assert demanded == [7] and inj.injected == 1
    inj.point("backward")  # the retry of the same step: fired once only
    assert inj.injected == 1


def test_a_trainer_without_probe_still_reports_its_steps(board, tmp_path) -> None:
    """Plain CPU: no memory words, but a committed step lets the agent relaunch."""
    ctrl = PreinitController(PreinitConfig(), 3, board)
    ctrl.spawned(ShadowLevel.L3, generation=1)
    guard = OomGuard(Heartbeat(board.path, 0), None, PreinitConfig(), EventLog(None, "t"), 0)
    ctrl.reclaimed()
    guard.report()
    assert not ctrl.relaunch_due()
    OomGuard(Heartbeat(board.path, 1), None, PreinitConfig(), EventLog(None, "t"), 1).report()
    assert ctrl.relaunch_due() and ctrl.reports() == []


def test_dashboard_line_shows_level_reason_and_reclaims() -> None:
    from leto import summary

    events = [
        {
            "t": 1.0,
            "kind": Kind.SHADOW_LEVEL.value,
            "level": 3,
            "reason": "configured",
            "headroom_bytes": None,
        },
        {"t": 2.0, "kind": Kind.SHADOW_RECLAIMED.value, "level": 3},
    ]
    assert summary.shadow_line(events) == (
        "shadows L3 (configured) · reclaims 1 · none now: relaunched once the retried step reports its memory"
    )
    events.append(
        {
            "t": 3.0,
            "kind": Kind.SHADOW_LEVEL.value,
            "level": 1,
            "reason": "oom",
            "headroom_bytes": GIB // 2,
            "peak_bytes": 9 * GIB + GIB // 2,
        }
    )
    assert (
        summary.shadow_line(events)
        == "shadows L1 (oom: headroom 0.50 GiB, peak 9.50 GiB) · reclaims 1"
    )
    assert summary.shadow_line([]) is None


def test_a_shadow_announcing_after_its_promotion_does_not_make_the_next_ready(board) -> None:
    """A shadow promoted while it pre-initialised announces its readiness late, after the
    agent spawned the next generation; that generation is not ready until its own shadows
    say so (the agent's warm/cold first-step judgement, a fault's wait for a ready shadow)."""
    ctrl = PreinitController(PreinitConfig(), 3, board)
    guards = [
        OomGuard(Heartbeat(board.path, s), None, PreinitConfig(), EventLog(None, "t"), s)
        for s in range(2)
    ]
    ctrl.spawned(ShadowLevel.L3, generation=1)
    guards[0].announce_ready(1)
    assert guards[0].shadow_ready() and not guards[1].shadow_ready() and not ctrl.ready()
    ctrl.closed()  # generation 1 promoted while its rank-1 shadow pre-initialised
    ctrl.spawned(ShadowLevel.L3, generation=2)
    guards[1].announce_ready(1)  # the late announcement
    assert not guards[1].shadow_ready() and not ctrl.ready()
    guards[0].announce_ready(2)
    guards[1].announce_ready(2)
    assert all(g.shadow_ready() for g in guards) and ctrl.ready()
