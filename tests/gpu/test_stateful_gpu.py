"""Buffers and stateful objects on a GPU: CUDA-memory slots with their own version counters,
the buffer undo copy in device memory (its tag written in stream order), and
examples/train_scheduled.py (BatchNorm, OneCycleLR stepped after ``state.step()``, a named
cursor) recovering bit-identically from kills in forward, the update and backward (one rank,
NCCL). The CPU twins: tests/trainer/test_buffers.py, tests/launcher/test_stateful_recovery.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from leto.config import FaultSpec
from leto.events import Kind
from leto.pool import cuda_vmm
from leto.retained.layout import Layout
from leto.trainer.buffers import BufferUndo, own_view
from tests.launcher.harness import REPO, assert_recovered, fault_free_digests, run_leto

SCRIPT = str(REPO / "examples" / "train_scheduled.py")


def _region(nbytes: int) -> tuple[torch.Tensor, object]:
    """A CUDA region wrapped as RegionMemory wraps one (``__cuda_array_interface__``)."""
    backing = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    return torch.as_tensor(
        cuda_vmm.array_interface(backing.data_ptr(), nbytes), device="cuda"
    ), backing


def test_cuda_slots_train_batchnorm_and_undo_its_statistics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.ReLU(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 2),
    ).cuda()
    params, buffers = list(model.parameters()), list(model.buffers())
    layout = Layout.plan(params, buffers, torch.optim.AdamW(params))
    region, _backing = _region(layout.state_bytes)
    for t, slot in [
        *zip(params, layout.params, strict=True),
        *zip(buffers, layout.buffers, strict=True),
    ]:
        data = own_view(region, slot)
        data.copy_(t.detach())
        torch.utils.swap_tensors(t, nn.Parameter(data) if isinstance(t, nn.Parameter) else data)
    undo_region, _undo_backing = _region(
        BufferUndo.region_bytes(BufferUndo.span(layout.buffers)[1])
    )
    undo = BufferUndo(region, layout.buffers, undo_region, list)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    undo.save(7)
    x, y = torch.randn(16, 4, device="cuda"), torch.randint(0, 2, (16,), device="cuda")
    nn.functional.cross_entropy(model(x), y).backward()  # the clash would raise here
    assert int(model[4].num_batches_tracked) == 1 and params[0].grad is not None
    assert undo.saved_step() == 7 and undo.restore(7)
    for k, v in model.state_dict().items():
        assert torch.equal(v, start[k]), k


@pytest.mark.timeout(1200)
def test_scheduled_bn_job_recovers_bit_identically_on_a_gpu(tmp_path) -> None:
    args = ["--scheduler", "onecycle"]
    steps = 12
    (tmp_path / "ref").mkdir()
    reference = fault_free_digests(
        tmp_path / "ref", steps=steps, nproc=1, script=SCRIPT, model_args=args, timeout_s=550
    )
    faults = [
        FaultSpec(rank=0, step=2, phase="forward"),
        FaultSpec(rank=0, step=5, phase="update"),
        FaultSpec(rank=0, step=8, phase="backward"),
    ]
    proc, events = run_leto(
        tmp_path, steps=steps, nproc=1, faults=faults, script=SCRIPT, model_args=args, timeout_s=550
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_recovered(reference, events, faults, nproc=1, resumed_at=[2, 6, 8])
    resumed = [
        (e["step"], e["extras"], e["buffers_restored"]) for e in events if e["kind"] == Kind.RESUMED
    ]
    assert resumed == [(2, "begin", True), (6, "pre+replay", False), (8, "begin", True)], resumed
