"""The compute phase borrows the RMU's undo buffer on a GPU (``leto.pool.lend``).

In process: large activations, including those the autograd engine's device thread
allocates in backward, land in the lent region, small ones never do, and a block kept past
the compute phase stops the step. End to end: a job with lending on and kills in forward,
backward and the update recovers to the digests of the same job with lending off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leto.config import FaultSpec
from leto.errors import LetoError, ProtocolError
from leto.events import Kind
from leto.pool.cuda_vmm import CudaChunks, array_interface
from leto.pool.lend import ActivationLender
from tests.launcher.harness import assert_exact, fault_free_digests, run_leto

MIB = 1 << 20
MODEL = ["--dim", "256", "--layers", "4", "--heads", "8", "--seq", "256", "--batch", "32", "--bf16"]


def test_activations_land_in_the_lent_region_and_a_kept_one_stops_the_update() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    with pytest.raises(
        LetoError, match="caching allocator"
    ):  # memory the allocator owns cannot be lent
        ActivationLender(
            device, {"rmu.undo": torch.zeros(64 * MIB, dtype=torch.uint8, device=device)}
        )
    # The undo region as the trainer has it: pool memory, a CUDA VMM mapping outside the allocator.
    chunks = CudaChunks(device.index)
    addr = chunks.reserve(256 * MIB)
    chunks.map(addr, chunks.create(256 * MIB), 256 * MIB)
    chunks.enable(addr, 256 * MIB)
    region = torch.as_tensor(array_interface(addr, 256 * MIB), device=device)
    lo, hi = region.data_ptr(), region.data_ptr() + region.numel()
    lender = ActivationLender(device, {"rmu.undo": region})

    def lent(t: torch.Tensor) -> bool:
        return lo <= t.data_ptr() < hi

    with lender.lending():
        big = torch.empty(8 * MIB, dtype=torch.uint8, device=device)
        small = torch.empty(1024, dtype=torch.uint8, device=device)
        x = torch.randn(4096, 1024, device=device, requires_grad=True)  # 16 MiB
        (x * 2).sum().backward()  # x.grad is allocated on the autograd engine's device thread
    assert lent(big) and lent(x) and lent(x.grad)
    assert not lent(small)
    with pytest.raises(ProtocolError, match="still in use"):
        lender.check_returned()
    del big, x
    lender.check_returned()  # only the small block is left, outside the lent region
    assert lender.arena.lent_bytes() > 0  # the segments stay cached in the pool
    with lender.lending():  # the next compute phase reuses them
        again = torch.empty(8 * MIB, dtype=torch.uint8, device=device)
    assert lent(again)
    del again
    lender.check_returned()


@pytest.mark.timeout(1200)
def test_recovery_with_lent_activations_equals_the_run_without_lending(tmp_path) -> None:
    reference = fault_free_digests(
        tmp_path,
        steps=14,
        nproc=1,
        model_args=MODEL,
        timeout_s=550,
        leto={"lend_activation_memory": False},
    )
    faults = [
        FaultSpec(rank=0, step=3, phase="forward"),
        FaultSpec(rank=0, step=7, phase="backward"),
        FaultSpec(rank=0, step=11, phase="update"),
    ]
    proc, events = run_leto(
        tmp_path,
        steps=14,
        nproc=1,
        model_args=MODEL,
        faults=faults,
        timeout_s=550,
        leto={"lend_activation_memory": True},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact(reference, events)
    assert len([e for e in events if e["kind"] == Kind.SHADOWS_PROMOTED]) == len(faults)
    # Until the first kill the trainer lends; a promoted shadow keeps its forward replay's
    # blocks for the compute phase instead (RetainedState._recover) and reports no lent bytes.
    before = [e for e in events if e["kind"] == Kind.STEP_DONE and e["step"] < faults[0].step]
    assert before and all(e.get("lent_bytes", 0) > 0 for e in before), (
        "no activation landed in the lent undo buffer"
    )


def test_a_job_that_keeps_an_activation_past_the_compute_phase_is_stopped(tmp_path) -> None:
    """The check runs after the update is queued (off the step's critical path), but still
    before the script's next line: the kept step fails with the error naming the cause,
    and no later step runs."""
    script = str(Path(__file__).with_name("scripts") / "keep_activation.py")
    proc, events = run_leto(
        tmp_path,
        steps=6,
        nproc=1,
        model_args=[],
        script=script,
        script_args=["--keep-step", "3"],
        extra=["--max-restarts", "0"],
        timeout_s=300,
        leto={"lend_activation_memory": True},
    )
    assert proc.returncode != 0
    assert "still in use after it" in proc.stderr
    done = sorted(e["step"] for e in events if e["kind"] == Kind.STEP_DONE)
    assert done == [0, 1, 2], done
