"""FSDP2 shards as retained slots (``leto.trainer.sharding``), on torch's fake process group:
one process plays one rank of a larger world, so ``fully_shard`` cuts real chunks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from leto.errors import ConfigError, UnrecoverableStateError
from leto.retained.layout import Layout
from leto.retained.marker import MARKER_BYTES, Marker
from leto.retained.slot import Slot
from leto.trainer.buffers import own_view
from leto.trainer.sharding import FsdpShards


@pytest.fixture
def world():
    def join(size: int, rank: int = 0) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)

    yield join
    if dist.is_initialized():
        dist.destroy_process_group()


def _model(device: str = "meta") -> nn.Module:
    with torch.device(device):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 5, bias=False), nn.Linear(5, 7))


def _sharded(size: int, device: str = "meta") -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(device)
    mesh = init_device_mesh("cpu", (size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _find(model: nn.Module, opt: torch.optim.Optimizer) -> FsdpShards:
    params = [p for g in opt.param_groups for p in g["params"]]
    return FsdpShards.find(model, opt, params, dist.get_world_size())


def test_each_shard_is_a_padded_chunk_of_dim_0(world) -> None:
    world(4, rank=3)
    model, opt = _sharded(4)
    shards = _find(model, opt)
    # weight (5, 3) over 4 ranks: chunks of 2 rows, rank 3 has none; bias (7,): 2, 2, 2, 1
    assert [(s.padded_shape, s.rows) for s in shards.shards.values()] == [
        ((2, 3), 0),
        ((2, 5), 1),
        ((2,), 1),
    ]
    assert [tuple(t.shape) for t in shards.stand_ins(list(model.parameters()))] == [
        (2, 3),
        (2, 5),
        (2,),
    ]


def _digest(size: int) -> int:
    model, opt = _sharded(size)
    params = list(model.parameters())
    shards = _find(model, opt)
    return Layout.plan(
        shards.stand_ins(params), [], opt, sharding=shards.description(params)
    ).digest


def test_a_world_of_another_size_is_refused_at_reattach(world) -> None:
    """The layout records the mesh and the global shapes (the weight's local chunk has 2
    rows over 3 ranks and over 4), so the marker refuses another world's retained state."""
    world(4)
    four = _digest(4)
    world(3)
    three = _digest(3)
    assert four != three and _digest(3) == three
    marker = Marker(torch.zeros(MARKER_BYTES, dtype=torch.uint8))
    marker.initialise(four)
    marker.check_layout(four)
    with pytest.raises(UnrecoverableStateError, match="different model/optimizer layout"):
        marker.check_layout(three)


def test_binding_makes_the_slot_what_fsdp_all_gathers(world) -> None:
    world(2, rank=1)
    model, opt = _sharded(2, device="cpu")
    shards = _find(model, opt)
    p = model[1].weight  # (7, 5): rank 1 holds rows 4..6, padded to 4 rows
    shard = shards.shards[1]
    before = p.to_local().clone()
    region = torch.full((4 * 5 * 4,), 0xFF, dtype=torch.uint8)
    padded = own_view(region, Slot(0, shard.padded_shape, torch.float32))
    shards.bind_param(1, p, padded, fresh=True)
    assert shard.fsdp_param._sharded_param_data.data_ptr() == region.data_ptr()
    assert p.to_local().data_ptr() == region.data_ptr() and p is model[1].weight
    assert torch.equal(p.to_local(), before) and torch.equal(padded[3], torch.zeros(5))
    grad = shards.seen(1, torch.zeros(shard.padded_shape))
    assert grad.to_local().shape == (3, 5) and tuple(grad.shape) == (7, 5)


def test_what_cannot_be_retained_is_refused_with_its_reason(world) -> None:
    world(4)
    model, _ = _sharded(4)
    muon = torch.optim.Muon([model[0].weight], lr=1e-3)
    with pytest.raises(ConfigError, match="Muon under fully_shard"):
        FsdpShards.find(model, muon, [model[0].weight], 4)

    half = _model()
    fully_shard(half[0], mesh=init_device_mesh("cpu", (4,)))  # the root left unsharded
    opt = torch.optim.AdamW(half.parameters())
    with pytest.raises(ConfigError, match="0.weight|1.weight|apply fully_shard to the root"):
        _find(half, opt)

    hsdp = _model()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(hsdp, mesh=mesh)
    with pytest.raises(ConfigError, match="2-D mesh"):
        _find(hsdp, torch.optim.AdamW(hsdp.parameters()))


def test_a_shadow_below_level_3_builds_its_group_at_promotion_not_in_device_mesh(world) -> None:
    """``init_device_mesh`` without a process group would make one from torch's environment;
    in a shadow below L3 it waits for promotion (which builds the generation's group)."""
    from torch.distributed import device_mesh

    from leto.trainer.context import mesh_waits_for_promotion

    torch_init = device_mesh.init_process_group
    promotions = []

    def promote() -> None:
        promotions.append(dist.is_initialized())
        world(2)

    mesh_waits_for_promotion(promote)
    try:
        mesh = init_device_mesh("cpu", (2,))
    finally:
        patched = device_mesh.init_process_group
        device_mesh.init_process_group = torch_init
    assert promotions == [False] and mesh.size() == 2
    assert patched is torch_init, "the wait is undone once the group exists"
