"""The shadow's kernel warm-up (``leto.preinit.warmup``) launches every Triton specialisation
that a recovery and a resumed update launch, touches no retained memory, and runs only
where it should. Kernels run in Triton's interpreter when no GPU is present; a launch's
specialisation key is computed with Triton's own ``native_specialize_impl``, as its JIT does.
"""

from __future__ import annotations

import inspect
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton_kernels is imported

from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

import leto.erasure.engine as erasure_engine
from leto.erasure import ErasureConfig
from leto.preinit import warmup
from tests.updater.rig import Killed, Rig, kill_at, model, no_faults
from tests.updater.test_rmu import _step
from triton_kernels import adamw_rmu, gf16_mac, gf16_syndrome

# D=6 with 4 KiB pages (the replicas use 2 KiB), H1=3, H2=1; chunks of several kernel blocks.
ERASURE = ErasureConfig(page_bytes=4096, data_pages=6, tier1_parity=3, tier2_parity=1)
CHUNK = 16384
DIM = 48

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="records launches of the interpreter's kernels; the GPU run is tests/gpu",
)


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: records the specialisation key of each launch."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.keys: set[tuple[object, ...]] = set()
        fn = kernel.fn  # type: ignore[attr-defined]
        self._sig = inspect.signature(fn)
        self._dns = set(kernel.kwargs.get("do_not_specialize") or ())  # type: ignore[attr-defined]

    def key(self, args: tuple, kwargs: dict) -> tuple[object, ...]:
        launch = {k: v for k, v in kwargs.items() if k not in self._sig.parameters}
        bound = self._sig.bind(
            *args, **{k: v for k, v in kwargs.items() if k in self._sig.parameters}
        )
        parts: list[object] = []
        for name, value in bound.arguments.items():
            if "constexpr" in str(self._sig.parameters[name].annotation):
                parts.append((name, value))
            else:
                parts.append(
                    (
                        name,
                        native_specialize_impl(
                            BaseBackend, value, False, name not in self._dns, True
                        ),
                    )
                )
        return (*parts, tuple(sorted(launch.items())))

    def __getitem__(self, grid: object):
        def launch(*args: object, **kwargs: object) -> object:
            self.keys.add(self.key(args, kwargs))
            return self.kernel[grid](*args, **kwargs)  # type: ignore[index]

        return launch


@pytest.fixture
def recorders(monkeypatch: pytest.MonkeyPatch) -> dict[str, Recorder]:
    rec = {
        "gf16_mac": Recorder(gf16_mac._gf16_mac_kernel),
        "adamw_rmu": Recorder(adamw_rmu._adamw_chunk_kernel),
        "gf16_syndrome": Recorder(gf16_syndrome._syndrome_kernel),
    }
    monkeypatch.setattr(gf16_mac, "_gf16_mac_kernel", rec["gf16_mac"])
    monkeypatch.setattr(gf16_syndrome, "_syndrome_kernel", rec["gf16_syndrome"])
    monkeypatch.setattr(
        erasure_engine, "SYNDROME_KERNEL", True
    )  # the GPU default, whatever the environment;
    monkeypatch.setattr(
        erasure_engine, "SYNDROME_MIN_PAGES", 2
    )  # runs of 1 page (generic) and more (Horner)
    monkeypatch.setattr(adamw_rmu, "_adamw_chunk_kernel", rec["adamw_rmu"])
    return rec


def _rig() -> Rig:
    return Rig.build(
        model(dim=DIM), erasure=ERASURE, chunk_bytes=CHUNK, fused=True, backend="triton"
    )


def _target(rig: Rig) -> warmup.WarmupTarget:
    return warmup.WarmupTarget.plan(
        device=torch.device("cpu"),
        layout=rig.layout,
        optimizer=rig.opt,
        erasure=ERASURE,
        rmu=True,
        chunk_bytes=CHUNK,
        fused=True,
    )


def _real_launches(rig: Rig) -> None:
    """What trainers launch: fused updates with parity folds and flushes, a kill in the
    middle of an update and its resume over rebuilt pages, and rebuilds of every count of
    lost data / tier-1 / tier-2 pages at random positions (real groups, 4 KiB pages)."""
    for s in range(2):
        _step(rig, s, no_faults())
    with pytest.raises(Killed):
        _step(rig, 2, kill_at(2, "parity", 1))
    up = rig.updater(no_faults())
    up.prepare()
    for g in up.working_groups():
        g.rebuild(random.Random(2).sample(range(g.num_pages), min(2, g.num_pages)))
    assert up.resume(2) == "restore+finish"
    rnd = random.Random(0)
    h1, h2 = ERASURE.tier1_parity, ERASURE.tier2_parity
    for g in rig.protected.groups:
        for nd in range(min(h1, g.num_pages) + 1):
            for n1 in range(h1 + 1):
                for n2 in range(h2 + 1):
                    if nd + n1 + n2 == 0 or nd + (n1 if n1 + n2 > h2 else 0) > h1:
                        continue
                    g.rebuild(
                        rnd.sample(range(g.num_pages), nd),
                        rnd.sample(range(h1), n1),
                        rnd.sample(range(h2), n2),
                    )


@pytest.mark.slow  # CI runs test_warm_up_touches_no_retained_memory and tests/launcher/test_kernel_warmup.py
def test_warm_up_launches_every_specialisation_a_recovery_launches(
    recorders: dict[str, Recorder],
) -> None:
    rig = _rig()
    target = _target(rig)
    _real_launches(rig)
    real = {name: set(r.keys) for name, r in recorders.items()}
    assert all(real.values()), "the real calls launched both kernels"
    for r in recorders.values():
        r.keys.clear()
    report = warmup.warm_up(target)
    assert report.calls["gf16_mac"] > 0 and report.calls["adamw_rmu"] > 0
    for name, r in recorders.items():
        missing = real[name] - r.keys
        assert not missing, (
            f"{name}: {len(missing)} specialisation(s) not warmed, e.g. {min(map(str, missing))}"
        )
    # the fused kernel is warmed for tokens of steps >= 256 too (an i64 argument)
    assert any(("token", ("i64", None)) in k for k in recorders["adamw_rmu"].keys)
    assert not any(("token", ("i64", None)) in k for k in real["adamw_rmu"])


def test_warm_up_touches_no_retained_memory() -> None:
    rig = _rig()
    _step(rig, 0, no_faults())
    buffers = [rig.state, rig.grads, rig.undo, rig.parity, rig.marker_mem]
    buffers += [t for g in rig.protected.groups for t in (g.tier1, g.tier2)]
    before = [b.clone() for b in buffers]
    rng = torch.get_rng_state()
    report = warmup.warm_up(_target(rig))
    assert report.calls["rmu_update"] == 2, "the update's rehearsal ran its two steps"
    assert all(torch.equal(a, b) for a, b in zip(before, buffers, strict=True))
    assert torch.equal(rng, torch.get_rng_state()), "the warm-up must not draw from the global RNG"


def test_fused_warm_up_launches_once_per_alignment_and_token_width(
    recorders: dict[str, Recorder],
) -> None:
    """Element offsets live in the chunk's piece table (int64 loads), so only the chunk's
    alignment, the token's width and whether it drops the undo words key a launch."""
    launches = [(4, 1 << 33, False), (4, 1 << 34, False), (4, 5, False), (1, 5, False)]
    assert adamw_rmu.warm_up(torch.device("cpu"), launches) == 3
    keys = recorders["adamw_rmu"].keys
    assert {k for k in keys if ("token", ("i64", None)) in k} and {
        k for k in keys if ("token", ("i32", None)) in k
    }
    assert {a for k in keys for name, a in k[:-1] if name == "ALIGN"} == {1, 4}


def test_runs_only_at_level_3_on_cuda_or_the_interpreter_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert warmup.skip_reason(cuda, 3, True) is None
    assert "level 2" in warmup.skip_reason(cuda, 2, True)
    assert "level 1" in warmup.skip_reason(cuda, 1, True)
    assert "disabled" in warmup.skip_reason(cuda, 3, False)
    monkeypatch.delenv(warmup.ENV_CPU, raising=False)
    assert "no CUDA device" in warmup.skip_reason(cpu, 3, True)  # CPU: a no-op
    monkeypatch.setenv(warmup.ENV_CPU, "1")
    assert warmup.skip_reason(cpu, 3, True) is None  # TRITON_INTERPRET=1 is set in this module


def test_a_new_kernel_is_one_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(warmup, "WARMERS", dict(warmup.WARMERS))
    seen = []
    warmup.register("parity_x")(lambda t: seen.append(t) or 3)
    report = warmup.warm_up(warmup.WarmupTarget(device=torch.device("cpu")))
    assert report.calls == {
        "gf16_mac": 0,
        "adamw_rmu": 0,
        "grad_landing": 0,
        "rmu_update": 0,
        "parity_x": 3,
    }
    assert len(seen) == 1
    with pytest.raises(ValueError, match="already registered"):
        warmup.register("parity_x")(lambda t: 0)


def test_warms_the_gradient_landings_copy_for_each_gradient_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process's first multi-tensor copy of a dtype pays its kernel's first use; the
    landing's copies (``leto.trainer.grad_landing``) are of the gradients' dtypes."""
    rig = _rig()
    copied: list[torch.dtype] = []
    real = torch._foreach_copy_

    def recording(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        copied.extend(t.dtype for t in targets)
        real(targets, sources)

    monkeypatch.setattr(torch, "_foreach_copy_", recording)
    report = warmup.warm_up(_target(rig), {"grad_landing": warmup.warm_grad_landing})
    dtypes = {slot.dtype for slot in rig.layout.grads}
    assert report.calls == {"grad_landing": len(dtypes)}
    assert set(copied) == dtypes
