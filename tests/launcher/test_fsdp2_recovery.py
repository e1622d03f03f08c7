"""FSDP2 (``fully_shard``) jobs recover in place, shard by shard, bit for bit.

Real leto-run jobs of ``examples/train_llama_fsdp.py`` (a Llama-style model built on
``meta``, ``fully_shard`` per block and at the root over a gloo CPU mesh): kills in
forward, backward (FSDP2's reduce-scatters run there), the gradient sync point and inside
an update chunk, with lost model-state and parity pages; every rank's digest of its
retained shards at every step equals the fault-free run's. The fault-free run trains
exactly as the same script under torch alone, and the sharded state goes through DCP for
a relaunch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from leto.checkpoint import complete_steps
from leto.config import FaultSpec
from leto.events import Kind
from leto.preinit.model_warmup import COMPILER
from tests.launcher.harness import (
    REPO,
    assert_exact,
    assert_recovered,
    digests,
    fault_free_run,
    resume_steps,
    run_leto,
    run_plain,
)

SCRIPT = str(REPO / "examples" / "train_llama_fsdp.py")
MODEL = ["--dim", "32", "--layers", "2", "--seq", "16", "--batch", "2", "--vocab", "128"]
MIXED = [*MODEL, "--bf16", "--reshard"]  # MixedPrecisionPolicy(bf16, fp32), reshard_after_forward
ERASURE = {"page_bytes": 4096, "data_pages": 32, "tier1_parity": 16, "tier2_parity": 1}
LETO = {"consistency": "rmu", "erasure": ERASURE, "rmu_chunk_bytes": 65536}
STEPS = 20


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[dict]]:
    return fault_free_run(
        tmp_path_factory.mktemp("ref"), steps=STEPS, leto=LETO, script=SCRIPT, model_args=MIXED
    )


@pytest.mark.timeout(600)
def test_kills_in_every_phase_with_lost_pages_recover_bit_identically(tmp_path, mixed) -> None:
    faults = [
        FaultSpec(rank=1, step=3, phase="forward", erase_device_pages=16, erase_host_pages=1),
        FaultSpec(rank=0, step=7, phase="backward", erase_device_region="grads"),
        FaultSpec(rank=1, step=11, phase="sync"),
        FaultSpec(
            rank=0, step=15, phase="update", point="optimizer", chunk=1, erase_device_pages=16
        ),
    ]
    proc, events = run_leto(
        tmp_path, steps=STEPS, faults=faults, leto=LETO, script=SCRIPT, model_args=MIXED
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(mixed[0], events, faults, nproc=2, resumed_at=[3, 7, 11, 16])
    rebuilt = [e for e in events if e["kind"] == Kind.PAGES_REBUILT]
    assert rebuilt, "the lost pages were never rebuilt"


@pytest.mark.timeout(300)
def test_trains_exactly_as_torch_alone(tmp_path, mixed) -> None:
    """The retained shards are what FSDP2 all-gathers: leto-run's last loss equals that of
    the same script with torch's own optimizer step under torchrun (bits of the float)."""
    plain = _plain_last_loss(tmp_path, STEPS, MIXED)
    done = [e for e in mixed[1] if e["kind"] == Kind.STEP_DONE and e["rank"] == 0]
    assert done[-1]["step"] == STEPS - 1
    assert repr(done[-1]["loss"]) == plain


@pytest.mark.slow  # CI runs the 2-rank kills in every phase; this widens to 4 ranks, SGD, L1
@pytest.mark.timeout(900)
def test_four_ranks_sgd_level1_shadows(tmp_path) -> None:
    """4 ranks, SGD with momentum (state torch creates lazily, stepped by its own class per
    chunk), shadows at level 1: they have no process group, so ``init_device_mesh`` in the
    script waits for promotion and the group is built then."""
    args = [*MODEL, "--optimizer", "sgd"]
    section = {"consistency": "rmu", "rmu_chunk_bytes": 16384}
    steps = 12
    (tmp_path / "ref").mkdir()
    ref, _ = fault_free_run(
        tmp_path / "ref", steps=steps, nproc=4, leto=section, script=SCRIPT, model_args=args
    )
    faults = [
        FaultSpec(rank=3, step=3, phase="backward"),
        FaultSpec(rank=1, step=8, phase="update", point="optimizer", chunk=0),
    ]
    proc, events = run_leto(
        tmp_path,
        steps=steps,
        nproc=4,
        faults=faults,
        leto=section,
        script=SCRIPT,
        model_args=args,
        extra=["--shadow-level", "1"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(ref, events, faults, nproc=4, resumed_at=[3, 9])
    promoted = [e for e in events if e["kind"] == Kind.PROMOTED]
    assert len(promoted) == 8 and all(e["level"] == 1 and e["group_built"] for e in promoted)


@pytest.mark.timeout(600)
def test_sharded_checkpoint_resumes_a_relaunch(tmp_path: Path, mixed) -> None:
    """DCP saves the shards as DTensors; a new job on the directory loads them in place."""
    ckpt = tmp_path / "ckpt"
    section = {**LETO, "checkpoint": {"dir": str(ckpt), "interval_steps": 4}}
    kwargs = {"leto": section, "script": SCRIPT, "model_args": MIXED}
    proc, events = run_leto(tmp_path, steps=8, **kwargs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert complete_steps(ckpt) == [4, 8]
    proc, events = run_leto(tmp_path, steps=12, **kwargs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = [e for e in events if e["kind"] == Kind.CHECKPOINT_LOADED]
    assert sorted((e["rank"], e["step"]) for e in loaded) == [(0, 8), (1, 8)]
    assert min(step for _, step in digests(events)) == 8
    assert_exact({k: v for k, v in mixed[0].items() if 8 <= k[1] <= 12}, events)


@pytest.mark.timeout(600)
def test_a_frozen_embedding_outside_the_optimizer_is_retained(tmp_path: Path) -> None:
    """A fine-tuning job's frozen parameter under fully_shard (the token embedding, outside
    the optimizer): its shards are retained with the rest, kills in backward and inside the
    update recover bit for bit, and the job trains as torch alone does."""
    args = [*MODEL, "--frozen-embedding"]
    section = {"consistency": "rmu", "rmu_chunk_bytes": 16384}
    steps = 10
    (tmp_path / "ref").mkdir()
    ref, ref_events = fault_free_run(
        tmp_path / "ref", steps=steps, leto=section, script=SCRIPT, model_args=args
    )
    faults = [
        FaultSpec(rank=0, step=3, phase="backward"),
        FaultSpec(rank=1, step=6, phase="update", point="optimizer", chunk=0),
    ]
    proc, events = run_leto(
        tmp_path, steps=steps, faults=faults, leto=section, script=SCRIPT, model_args=args
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(ref, events, faults, nproc=2, resumed_at=[3, 7])
    last = _plain_last_loss(tmp_path, steps, args)
    done = [e for e in ref_events if e["kind"] == Kind.STEP_DONE and e["rank"] == 0]
    assert repr(done[-1]["loss"]) == last


@pytest.mark.timeout(600)
def test_parameters_without_a_gradient_train_as_torch(tmp_path: Path) -> None:
    """A frozen embedding left in the optimizer (``AdamW(model.parameters())``) and a block's
    MLP dropped at every third step (LayerDrop on a schedule every rank shares): torch's
    AdamW skips a parameter whose ``.grad`` FSDP2 left None, and so does Leto's update,
    weight decay included (``leto.retained.presence``; FSDP2 runs the sharded parameters'
    post-accumulate-grad hooks for the gradients it reduced). A kill inside the update of a
    step that dropped the MLP finishes it skipping the same parameters: the resume allows
    the step counts to lag (the retained word that says so survives the zeroing of the
    gradient region at every step's start)."""
    args = [*MODEL, "--frozen-embedding", "--frozen-in-optimizer", "--drop-mlp-every", "3"]
    section = {"consistency": "rmu", "rmu_chunk_bytes": 16384}
    steps = 7
    (tmp_path / "ref").mkdir()
    ref, ref_events = fault_free_run(
        tmp_path / "ref", steps=steps, leto=section, script=SCRIPT, model_args=args
    )
    done = [e for e in ref_events if e["kind"] == Kind.STEP_DONE and e["rank"] == 0]
    assert repr(done[-1]["loss"]) == _plain_last_loss(tmp_path, steps, args)
    faults = [FaultSpec(rank=1, step=3, phase="update", point="optimizer", chunk=0)]
    proc, events = run_leto(
        tmp_path, steps=steps, faults=faults, leto=section, script=SCRIPT, model_args=args
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(ref, events, faults, nproc=2, resumed_at=[4])


@pytest.mark.timeout(600)
def test_compiled_blocks_recover_exactly(tmp_path: Path) -> None:
    """torchtitan's recipe: each block ``torch.compile``'d, then sharded. Each shadow warms
    the compiler before it is ready (``model_warmup.warm_compiler``); a promoted trainer
    traces its blocks afresh (Inductor's cache on disk spares the code generation). Leto's
    hooks stay outside the compiled blocks (``leto.compiled``), so the graphs of a job with
    faults are the fault-free job's: every digest equals the fault-free run's, a kill in
    the backward and one inside the update (which finishes it) included."""
    section = {"consistency": "rmu", "rmu_chunk_bytes": 16384}
    args = [*MODEL, "--compile"]
    (tmp_path / "ref").mkdir()
    ref, _ = fault_free_run(
        tmp_path / "ref", steps=9, leto=section, script=SCRIPT, model_args=args, timeout_s=500
    )
    faults = [
        FaultSpec(rank=1, step=3, phase="backward", shadow_ready_steps_before=1),
        FaultSpec(
            rank=0, step=6, phase="update", point="optimizer", chunk=0, shadow_ready_steps_before=1
        ),
    ]
    proc, events = run_leto(
        tmp_path,
        steps=9,
        faults=faults,
        leto=section,
        script=SCRIPT,
        model_args=args,
        timeout_s=500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(ref, events, faults, nproc=2, resumed_at=resume_steps(faults))
    promoted = {(e["rank"], e["gen"]): e["t"] for e in events if e["kind"] == Kind.PROMOTED}
    for gen, fault in enumerate(faults, start=1):  # the kill waited for this shadow's readiness
        key = (fault.rank, gen)
        (*_, warmed) = [
            e
            for e in events
            if e["kind"] == Kind.MODEL_WARMED
            and e["name"] == COMPILER
            and (e["rank"], e["gen"]) == key
            and e["t"] < promoted[key]
        ]
        assert warmed["ran"], (key, warmed["reason"])


def _plain_last_loss(tmp: Path, steps: int, args: list[str]) -> str:
    """The last loss (repr) of the same script under torch alone, torchrun on 2 ranks."""
    (last,) = re.findall(r"last loss (\S+)", run_plain(tmp, SCRIPT, steps, args, timeout_s=240))
    return last
