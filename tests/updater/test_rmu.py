"""The RMU in-process: AdamW equals torch's; a kill at any point of the update, plus H1
lost pages per group, finishes bit-identically; without incremental parity it does not."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from leto.erasure import ErasureConfig
from leto.errors import InvalidTransitionError
from leto.faults import FaultInjector
from leto.retained.marker import MARKER_BYTES, Marker, Phase, pack
from leto.updater.rmu import WORKING_PHASES
from tests.updater.rig import Killed, Rig, kill_at, model, no_faults

ERASURE = ErasureConfig(page_bytes=4096, data_pages=8, tier1_parity=4, tier2_parity=1)
CHUNK = 4096  # bytes of parameters per chunk: the rig's model makes 4 chunks
LRS = [1e-2, 2e-2, 3e-2]


def _params(rig: Rig) -> list[torch.Tensor]:
    return [s.view(rig.state) for s in rig.layout.params]


def _clip(rig: Rig, max_norm: float = 1.0) -> None:
    """clip_grad_norm_'s arithmetic on the retained gradient views (they have no .grad), as
    a trainer clips: the fused kernel gets the coefficient as its gradient factor
    (``Layout.grad_scale``), the unfused paths clipped gradients."""
    grads = [s.view(rig.grads) for s in rig.layout.grads]
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    assert coef < 1, "the tests' gradients are clipped"
    scale = rig.layout.grad_scale.view(rig.grads)
    if rig.fused:
        scale.copy_(coef)
    else:
        torch._foreach_mul_(grads, coef)
        scale.fill_(1.0)


def _step(rig: Rig, step: int, injector: FaultInjector) -> None:
    rig.set_grads(seed=100 + step)
    _clip(rig)
    rig.grads_ready(LRS[step])
    injector.step = step  # as the trainer does at the start of each step
    rig.updater(injector).run(step)


def _recover(rig: Rig, step: int, erase_per_group: int) -> str:
    """What a promoted trainer does: prepare, lose pages, rebuild, resume."""
    updater = rig.updater(no_faults())
    phase = rig.marker.phase
    updater.prepare()
    if rig.protected is not None and erase_per_group:
        lost = rig.erase_pages(erase_per_group, seed=step)
        d = ERASURE.data_pages
        groups = updater.working_groups() if phase in WORKING_PHASES else rig.protected.groups
        for i, g in enumerate(groups):
            g.rebuild([p - i * d for p in lost if i * d <= p < (i + 1) * d])
    return updater.resume(step)


def _reference(erasure: ErasureConfig | None, steps: int = 3) -> Rig:
    rig = Rig.build(model(), erasure=erasure, chunk_bytes=CHUNK)
    for s in range(steps):
        _step(rig, s, no_faults())
    return rig


# -- the optimizer -------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", ["foreach", "for-loop", "fused"])
@pytest.mark.parametrize("kind", ["adamw", "adam_l2"])
def test_chunked_adamw_equals_torch(impl: str, kind: str) -> None:
    """Leto's AdamW against torch's: bit-equal to the foreach path and (its pieces stepped by
    torch's own fused kernel, off the Triton path) to the fused one, to float rounding of
    the for-loop one; ``fused=True`` is planned as Leto's AdamW, not probed."""
    net = model(seed=1)
    ref = copy.deepcopy(net)
    cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    flags = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    ref_opt = cls(ref.parameters(), lr=1e-2, weight_decay=0.1, **flags)
    rig = Rig.build(
        net,
        erasure=ERASURE,
        chunk_bytes=CHUNK,
        optimizer=lambda n: cls(n.parameters(), lr=1e-2, weight_decay=0.1, **flags),
    )
    assert rig.layout.rule.kind == "adamw"
    assert len(rig.updater(no_faults()).chunks) >= 3
    for step in range(3):
        rig.set_grads(seed=step)
        for p, slot in zip(ref.parameters(), rig.layout.grads, strict=True):
            p.grad = slot.view(rig.grads).clone()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
        for g in ref_opt.param_groups:
            g["lr"] = LRS[step]
        ref_opt.step()
        _clip(rig)
        rig.grads_ready(LRS[step])
        rig.updater(no_faults()).run(step)
    exact = impl != "for-loop"  # same kernels (foreach; fused: torch's own on the slices)
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-6, "atol": 1e-7}
    for p, slot, oslots in zip(ref.parameters(), rig.layout.params, rig.layout.optim, strict=True):
        torch.testing.assert_close(slot.view(rig.state), p.detach(), **tol)
        st = ref_opt.state[p]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(oslots[key].view(rig.state), st[key].cpu(), **tol)
    # parity was kept current chunk by chunk: equal to a fresh encode of the data
    for g in rig.protected.groups:
        t1, t2 = g.tier1.clone(), g.tier2.clone()
        g.encode_all()
        assert torch.equal(t1, g.tier1) and torch.equal(t2, g.tier2)


# -- the marker ------------------------------------------------------------------------------------
def test_marker_packs_chunk_and_checks_transactions() -> None:
    m = Marker(torch.zeros(MARKER_BYTES, dtype=torch.uint8))
    m.initialise(7)
    m.advance(Phase.GRADS_READY)
    m.advance(Phase.PARITY_LOADED, sel=0)
    with pytest.raises(InvalidTransitionError):
        m.advance(Phase.CHUNK_SAVED, chunk=1)
    m.advance(Phase.CHUNK_SAVED, chunk=0)
    with pytest.raises(InvalidTransitionError):
        m.advance(Phase.FLUSHING)
    m.advance(Phase.CHUNK_COMMITTED, chunk=0, sel=1)
    m.advance(Phase.CHUNK_SAVED, chunk=1)
    assert (m.step, m.phase, m.chunk, m.parity_sel) == (0, Phase.CHUNK_SAVED, 1, 1)
    assert m.word == pack(0, Phase.CHUNK_SAVED, 1, 1)
    m.advance(Phase.CHUNK_COMMITTED, chunk=1, sel=0)
    m.advance(Phase.FLUSHING)
    m.advance(Phase.IDLE, 1)
    assert (m.step, m.phase, m.chunk) == (1, Phase.IDLE, 0)


# -- kill-point sweep ------------------------------------------------------------------------------
def _points(n_chunks: int) -> list[tuple[str | None, int | None]]:
    pts: list[tuple[str | None, int | None]] = []
    for j in range(n_chunks):
        pts += [("boundary", j), ("optimizer", j), ("parity", j)]
    return [*pts, ("flush", None), (None, None)]


@pytest.mark.parametrize("erasure", [ERASURE, None], ids=["parity", "no-erasure"])
def test_every_kill_point_with_lost_pages_finishes_exactly(erasure: ErasureConfig | None) -> None:
    ref = _reference(erasure)
    n_chunks = len(ref.updater(no_faults()).chunks)
    assert n_chunks >= 3
    sweep_kill_points(
        ref, n_chunks, erasure, lambda: Rig.build(model(), erasure=erasure, chunk_bytes=CHUNK)
    )


def sweep_kill_points(
    ref: Rig, n_chunks: int, erasure: ErasureConfig | None, build: Callable[[], Rig]
) -> None:
    """Kill step 1 of a fresh ``build()`` rig at every point, lose H1 pages per group,
    recover and run step 2: the state (and parity) equal ``ref``'s, bit for bit."""
    actions = set()
    for point, chunk in _points(n_chunks):
        if erasure is None and point in ("parity", "flush"):
            continue
        rig = build()
        _step(rig, 0, no_faults())
        with pytest.raises(Killed):
            _step(rig, 1, kill_at(1, point, chunk))
        actions.add(_recover(rig, 1, erase_per_group=ERASURE.tier1_parity if erasure else 0))
        assert rig.marker.step == 2 and rig.marker.phase == Phase.IDLE
        _step(rig, 2, no_faults())
        assert torch.equal(rig.state, ref.state), f"diverged after a kill at {point} {chunk}"
        if erasure is not None:
            for g, r in zip(rig.protected.groups, ref.protected.groups, strict=True):
                assert torch.equal(g.tier1, r.tier1) and torch.equal(g.tier2, r.tier2)
    assert {"restore+finish", "resume+finish"} <= actions


def test_kill_during_the_parity_load_reruns_from_grads_ready() -> None:
    """A kill before PARITY_LOADED: host parity still matches M_t; the update starts over."""
    ref = _reference(ERASURE)
    rig = Rig.build(model(), erasure=ERASURE, chunk_bytes=CHUNK)
    _step(rig, 0, no_faults())
    rig.set_grads(seed=101)
    _clip(rig)
    rig.grads_ready(LRS[1])
    rig.parity.random_(0, 255)  # torn load
    assert _recover(rig, 1, erase_per_group=4) == "finish"
    _step(rig, 2, no_faults())
    assert torch.equal(rig.state, ref.state)


def test_without_incremental_parity_a_mid_update_rebuild_is_wrong() -> None:
    """The paper's "RMP alone": parity lags the partially updated data, so the pages
    rebuilt after the kill are wrong (the run diverges)."""
    ref = _reference(ERASURE)
    fault_free = Rig.build(model(), erasure=ERASURE, chunk_bytes=CHUNK, incremental=False)
    for s in range(3):
        _step(fault_free, s, no_faults())
    assert torch.equal(fault_free.state, ref.state), "without faults the data path is the same"
    rig = Rig.build(model(), erasure=ERASURE, chunk_bytes=CHUNK, incremental=False)
    _step(rig, 0, no_faults())
    with pytest.raises(Killed):
        _step(rig, 1, kill_at(1, "optimizer", 2))
    _recover(rig, 1, erase_per_group=ERASURE.tier1_parity)
    _step(rig, 2, no_faults())
    assert not torch.equal(rig.state, ref.state)


class _CheckEveryCommit:
    """Injector that, at every chunk boundary, checks the working-parity invariants."""

    def __init__(self, rig: Rig) -> None:
        self.rig, self.updater, self.checked, self.stale_seen = rig, None, 0, 0

    def scheduled(self, phase: str, *, chunk: int | None = None) -> bool:
        return False

    def point(
        self, phase: str, *, at: str | None = None, chunk: int | None = None, on_fire=None
    ) -> None:
        if at != "boundary" or self.updater is None:
            return
        up, cfg = self.updater, self.rig.protected.cfg
        sel = self.rig.marker.parity_sel
        h1, pb = cfg.tier1_parity, cfg.page_bytes
        for i, (auth, spare) in enumerate(zip(up._working[sel], up._working[1 - sel], strict=True)):
            # Q[sel] is the syndrome form of the data as it is now
            fresh = torch.empty_like(auth.tier1)
            auth.encode_tier1(fresh)
            assert torch.equal(auth.tier1, fresh), (
                f"chunk {chunk}: Q[sel] of group {i} lags the data"
            )
            # Q[1-sel] equals Q[sel] outside the stale ranges
            a, s = auth.tier1.view(h1, pb).clone(), spare.tier1.view(h1, pb).clone()
            for lo, hi in up._stale.get(i, []):
                a[:, lo:hi] = 0
                s[:, lo:hi] = 0
                self.stale_seen += 1
            assert torch.equal(a, s), (
                f"chunk {chunk}: Q[1-sel] of group {i} differs outside its stale ranges"
            )
        self.checked += 1


@pytest.mark.parametrize("shape", ["rig", "many-groups"])
def test_working_parity_invariants_hold_at_every_chunk_boundary(shape: str) -> None:
    """The out-of-place fold: at every commit Q[sel] holds the syndromes of the data, and
    the spare lags it only on the ranges recorded as stale (which the next chunk rewrites
    or copies). "many-groups": 4-page groups, so consecutive chunks often move to other
    groups and the stale ranges they leave behind must be copied."""
    erasure = (
        ERASURE
        if shape == "rig"
        else ErasureConfig(page_bytes=4096, data_pages=4, tier1_parity=3, tier2_parity=1)
    )
    rig = Rig.build(model(dim=24 if shape == "rig" else 48), erasure=erasure, chunk_bytes=CHUNK)
    for step in range(2):
        check = _CheckEveryCommit(rig)
        rig.set_grads(seed=100 + step)
        _clip(rig)
        rig.grads_ready(LRS[step])
        up = rig.updater(check)
        check.updater = up
        up.run(step)
        assert check.checked == len(up.chunks) and check.stale_seen > 0
    ref = Rig.build(model(dim=24 if shape == "rig" else 48), erasure=erasure, chunk_bytes=CHUNK)
    for step in range(2):
        _step(ref, step, no_faults())
    assert torch.equal(rig.state, ref.state)
