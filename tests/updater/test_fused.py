"""The fused RMU path (``triton_kernels.adamw_rmu``; the interpreter on CPU): it matches the
unfused reference to float rounding, its undo restores a half-run kernel exactly, and a
kill anywhere in a fused update, plus lost pages, finishes bit-identically to a fault-free
fused run."""

from __future__ import annotations

import pytest
import torch

from leto.erasure import ErasureConfig
from leto.errors import ConfigError
from leto.retained.marker import Phase
from leto.updater.fused import BLOCK, fused_token, resolve_fused
from tests.updater.rig import Killed, Rig, kill_at, model, no_faults
from tests.updater.test_rmu import CHUNK, ERASURE, LRS, _clip, _step, sweep_kill_points

WIDE = 16384
"""Chunk bytes for tests that need several kernel blocks per chunk (4096 elements)..."""
DIM = 48
"""...and a model big enough for several such chunks (14 k parameters)."""
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""The kernels run on the GPU where there is one, else in Triton's interpreter (conftest)."""


def _run(
    fused: bool,
    erasure: ErasureConfig | None = ERASURE,
    steps: int = 3,
    chunk: int = CHUNK,
    dim: int = 24,
) -> Rig:
    rig = Rig.build(model(dim=dim), erasure=erasure, chunk_bytes=chunk, fused=fused, device=DEVICE)
    for s in range(steps):
        _step(rig, s, no_faults())
    return rig


def _compare(ref: Rig, fused: Rig, **tol: float) -> None:
    """param / exp_avg / exp_avg_sq within ``tol``; step counters and RNG equal."""
    lay = ref.layout
    for i, slot in enumerate(lay.params):
        for s in (slot, lay.optim[i]["exp_avg"], lay.optim[i]["exp_avg_sq"]):
            torch.testing.assert_close(s.view(fused.state), s.view(ref.state), **tol)
        assert torch.equal(
            lay.optim[i]["step"].view(ref.state), lay.optim[i]["step"].view(fused.state)
        )
    assert torch.equal(lay.rng.view(ref.state), lay.rng.view(fused.state))


def test_one_fused_step_is_within_two_roundings_of_the_unfused_one() -> None:
    """From the same state, one step. Both paths round once per op; they differ where op
    association or FMA contraction differs (see adamw_rmu), by about one rounding of the
    largest operand: 2 ulps relative, or 2 ulps of the lr-sized update (``p`` after
    decoupled decay can cancel to near zero, so its own ulp is no measure)."""
    _compare(_run(False, steps=1), _run(True, steps=1), rtol=2**-22, atol=1e-2 * 2**-22)


def test_fused_matches_unfused_to_rounding_over_steps() -> None:
    """Three steps: the per-op differences compound through Adam's scale-free m / sqrt(v)
    (1e-4 relative here); the fused path's parity stays current."""
    fused = _run(True)
    _compare(_run(False), fused, rtol=1e-4, atol=1e-6)
    for g in fused.protected.groups:
        t1, t2 = g.tier1.clone(), g.tier2.clone()
        g.encode_all()
        assert torch.equal(t1, g.tier1) and torch.equal(t2, g.tier2)


def test_the_kernel_applies_the_gradient_factor_as_clipping_in_place_would() -> None:
    """The factor in ``Layout.grad_scale`` is one float32 multiply of each gradient as the
    kernel reads it: the same bytes as torch's in-place ``_foreach_mul_`` and a factor of 1."""
    folded, in_place = (
        Rig.build(model(dim=24), erasure=None, chunk_bytes=CHUNK, fused=True, device=DEVICE)
        for _ in range(2)
    )
    coef = torch.tensor(0.3711, dtype=torch.float32, device=DEVICE)
    for rig, factor in ((folded, coef), (in_place, torch.ones((), device=DEVICE))):
        rig.set_grads(seed=7)
        if rig is in_place:
            torch._foreach_mul_([s.view(rig.grads) for s in rig.layout.grads], coef)
        rig.layout.grad_scale.view(rig.grads).copy_(factor)
        rig.grads_ready(1e-2)
        rig.updater(no_faults()).run(0)
    assert torch.equal(folded.state, in_place.state)


def test_fused_is_deterministic() -> None:
    assert torch.equal(_run(True).state, _run(True).state)


@pytest.mark.parametrize("chunk", [0, 1, 2])
def test_restore_of_a_half_run_kernel_is_exact(chunk: int) -> None:
    """Kill inside chunk ``chunk``'s kernel (half its blocks done, one torn): prepare()
    puts back exactly the bytes of before the chunk."""
    rig = Rig.build(model(dim=DIM), erasure=ERASURE, chunk_bytes=WIDE, fused=True, device=DEVICE)
    _step(rig, 0, no_faults())
    fresh = rig.updater(no_faults())
    n_chunks = len(fresh.chunks)
    assert n_chunks > chunk
    # the state just before chunk `chunk` of step 1: a fault-free run killed at its boundary
    before = Rig.build(model(dim=DIM), erasure=ERASURE, chunk_bytes=WIDE, fused=True, device=DEVICE)
    _step(before, 0, no_faults())
    with pytest.raises(Killed):
        _step(before, 1, kill_at(1, "boundary", chunk))
    # Stale bytes in the undo image (an earlier chunk's, a predecessor's): the gaps the
    # kernel does not save must have been copied over them before it ran.
    flags_at = rig.undo.numel() - fresh.fused.flag_nbytes
    rig.undo[:flags_at] = torch.randint(0, 256, (flags_at,), dtype=torch.uint8)
    with pytest.raises(Killed):
        _step(rig, 1, kill_at(1, "optimizer", chunk))
    up = rig.updater(no_faults())
    assert rig.marker.phase == Phase.CHUNK_SAVED and rig.marker.chunk == chunk
    plan = up.fused.plans[chunk]
    flags = up.fused.flags[: plan.blocks]
    done = int((flags == fused_token(1, chunk)).sum())
    assert 0 < done < plan.blocks, "the abort must leave some blocks run and some not"
    assert not torch.equal(rig.state, before.state)
    up.prepare()
    assert torch.equal(rig.state, before.state)


def test_without_erasure_a_kill_inside_a_chunk_rolls_it_forward() -> None:
    """No parity folds the chunk from its undo image, so the kernel may drop a done block's
    undo words (the abort leaves them stale): prepare() puts back only the torn block, the
    done blocks keep their new values, and the chunk's launch after it redoes exactly the
    blocks not done, never one twice (the result is the fault-free run's)."""
    from triton_kernels import adamw_rmu

    chunk = 1

    def rig() -> Rig:
        return Rig.build(model(dim=DIM), erasure=None, chunk_bytes=WIDE, fused=True, device=DEVICE)

    ref, killed = rig(), rig()
    for r in (ref, killed):
        _step(r, 0, no_faults())
    before = killed.state.clone()
    _step(ref, 1, no_faults())
    with pytest.raises(Killed):
        _step(killed, 1, kill_at(1, "optimizer", chunk))
    up = killed.updater(no_faults())
    plan = up.fused.plans[chunk]
    token = fused_token(1, chunk)
    done = up.fused.done[: plan.blocks] == token
    torn = (up.fused.flags[: plan.blocks] == token) & ~done
    assert 0 < int(done.sum()) < plan.blocks and int(torn.sum()) == 1
    up.prepare()
    for pc in plan.pieces:
        blocks = done[pc.flag_base : pc.flag_base + adamw_rmu.num_blocks(pc.n)]
        mask = blocks.repeat_interleave(BLOCK)[: pc.n]
        for k in range(3):
            at = slice(pc.offsets[k], pc.offsets[k] + pc.n)
            now = up.fused.state_f[at]
            assert torch.equal(now[mask], ref.state.view(torch.float32)[at][mask])
            assert torch.equal(now[~mask], before.view(torch.float32)[at][~mask])
    assert up.resume(1) == "restore+finish"
    assert torch.equal(killed.state, ref.state)


@pytest.mark.parametrize("erasure", [ERASURE, None], ids=["parity", "no-erasure"])
def test_an_update_ignores_flags_left_in_its_undo_region(erasure: ErasureConfig | None) -> None:
    """Between updates the undo region may be lent to activations, which can hold any
    words, the tokens of the coming update's chunks among them: a block whose done flag
    already held its token would be skipped. The update clears the flags first."""
    ref, lent = (
        Rig.build(model(dim=DIM), erasure=erasure, chunk_bytes=WIDE, fused=True, device=DEVICE)
        for _ in range(2)
    )
    for r in (ref, lent):
        _step(r, 0, no_faults())
    fused = lent.updater(no_faults()).fused
    for j in range(len(fused.plans)):  # every word a token of step 1, chunk after chunk
        fused.flags[j :: len(fused.plans)] = fused_token(1, j)
        fused.done[j :: len(fused.plans)] = fused_token(1, j)
    for r in (ref, lent):
        _step(r, 1, no_faults())
    assert torch.equal(lent.state, ref.state)


@pytest.mark.parametrize("erasure", [ERASURE, None], ids=["parity", "no-erasure"])
def test_every_kill_point_of_a_fused_update_finishes_exactly(erasure: ErasureConfig | None) -> None:
    ref = _run(True, erasure, chunk=WIDE, dim=DIM)
    n_chunks = len(ref.updater(no_faults()).chunks)
    assert n_chunks >= 3 and WIDE // 4 > BLOCK
    sweep_kill_points(
        ref,
        n_chunks,
        erasure,
        lambda: Rig.build(
            model(dim=DIM), erasure=erasure, chunk_bytes=WIDE, fused=True, device=DEVICE
        ),
    )


def test_rmu_fused_setting_resolves_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Rig.build(model(), erasure=None, chunk_bytes=CHUNK).layout
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_fused(None, cuda, layout) and not resolve_fused(None, cpu, layout)
    assert not resolve_fused(False, cuda, layout)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_fused(True, cpu, layout)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="rmu_fused: true needs a CUDA device"):
        resolve_fused(True, cpu, layout)


def test_the_kernel_s_operands_are_checked_once_when_bound() -> None:
    """``check_operands`` refuses what the kernel cannot launch on (it runs when the fused
    path binds its views, not at every chunk)."""
    from triton_kernels import adamw_rmu

    flat = torch.zeros(8)
    flags = torch.zeros(2, dtype=torch.int64)
    adamw_rmu.check_operands(flat, flat, flat[:1], flat, flags, flags)
    with pytest.raises(TypeError, match="scale must be a flat"):
        adamw_rmu.check_operands(flat, flat, torch.ones(()), flat, flags, flags)  # 0-d, not flat
    with pytest.raises(TypeError, match="flags must be a flat"):
        adamw_rmu.check_operands(flat, flat, flat[:1], flat, flags.view(torch.float64), flags)
    with pytest.raises(TypeError, match="done must be a flat"):
        adamw_rmu.check_operands(flat, flat, flat[:1], flat, flags, flags.view(torch.float64))


@pytest.mark.skipif(DEVICE != "cuda", reason="Triton's interpreter compiles no kernel to keep")
def test_a_chunk_s_later_launches_go_straight_to_its_compiled_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One updater, three steps: each chunk goes through Triton's JIT launch once, then
    through the compiled kernel it returned, with the same results as launches that all go
    through the JIT."""
    from triton_kernels import adamw_rmu

    jit = adamw_rmu._adamw_chunk_kernel
    through_jit: list[object] = []

    class Counted:
        def __getitem__(self, grid: object) -> object:
            through_jit.append(grid)
            return jit[grid]

    monkeypatch.setattr(adamw_rmu, "_adamw_chunk_kernel", Counted())

    def three_steps() -> tuple[Rig, int]:
        through_jit.clear()
        rig = Rig.build(
            model(dim=DIM), erasure=ERASURE, chunk_bytes=WIDE, fused=True, device=DEVICE
        )
        updater = rig.updater(no_faults())
        for s in range(3):
            rig.set_grads(seed=100 + s)
            _clip(rig)
            rig.grads_ready(LRS[s])
            updater.run(s)
        updater.drain()
        return rig, len(updater.chunks)

    kept, chunks = three_steps()
    assert chunks > 1 and len(through_jit) == chunks

    class Never:  # no launch's result is kept: every one goes through the JIT
        pass

    monkeypatch.setattr(adamw_rmu, "CompiledKernel", Never)
    every, _ = three_steps()
    assert len(through_jit) == 3 * chunks
    _compare(every, kept, rtol=0, atol=0)
