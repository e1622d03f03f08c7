"""The forward replay: what the active records of its model's first call, and what the
shadow's scratch copy runs from it (in process, on CPU). A real job is
tests/launcher/test_replay_recovery.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from leto.events import Kind, read_events
from leto.preinit.replay import ForwardRecorder, ForwardSpec, Unsupported, replay

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_gpt import GPT


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, idx, scale=None, *, mask=None, extra=()):
        h = self.lin(self.emb(idx))
        if mask is not None:
            h = h.masked_fill(~mask.unsqueeze(-1), 0.0)
        return {"logits": h * (1.0 if scale is None else scale), "aux": [h.mean()]}


def test_a_call_round_trips_through_json_with_its_autocast():
    idx = torch.randint(0, 16, (2, 5))
    mask = torch.zeros(2, 5, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        spec = ForwardSpec.of((idx, 0.5), {"mask": mask, "extra": (None, True, [3, "x"])})
    back = ForwardSpec.from_json(spec.to_json())
    assert back == spec and back.autocast == "bfloat16"
    args, kwargs = back.inputs(torch.device("cpu"))
    assert args[0].shape == (2, 5) and args[0].dtype == torch.long and not args[0].any()
    assert args[1] == 0.5
    assert kwargs["mask"].dtype == torch.bool and kwargs["mask"].all(), "masks replay all true"
    assert kwargs["extra"] == (None, True, [3, "x"])
    assert ForwardSpec.of((idx,), {}).autocast is None


def test_the_recorder_publishes_the_first_call_once_and_removes_itself():
    net, published = _Net(), []
    ForwardRecorder(net, published.append)
    net(torch.zeros(1, 3, dtype=torch.long))
    net(torch.zeros(4, 7, dtype=torch.long))
    assert len(published) == 1 and not net._forward_pre_hooks
    assert ForwardSpec.from_json(published[0]).args[0]["tensor"] == [1, 3]


def test_an_argument_it_cannot_describe_is_published_as_unsupported():
    net, published = _Net(), []
    ForwardRecorder(net, published.append)
    net(torch.zeros(1, 3, dtype=torch.long), scale=torch.tensor(2.0), extra=(object(),))
    assert "object" in json.loads(published[0])["unsupported"]
    with pytest.raises(Unsupported, match="object"):
        ForwardSpec.from_json(published[0])


def test_the_replay_runs_a_scratch_copy_and_leaves_the_meta_model_alone():
    with torch.device("meta"):
        model = GPT(vocab=32, dim=16, layers=2, heads=2, seq=8, dropout=0.1)
    idx = torch.zeros(2, 8, dtype=torch.long)
    spec = ForwardSpec.of((idx, idx), {})
    result = replay(model, spec, torch.device("cpu"))
    params = list(model.parameters())
    assert result.backward and result.parameters == len(params)
    assert all(p.is_meta and p.grad is None for p in params), "the model itself is untouched"
    assert all(b.is_meta for b in model.buffers())


def test_a_model_without_a_differentiable_output_still_runs_forward():
    with torch.device("meta"):
        net = torch.nn.Embedding(4, 2)
    spec = ForwardSpec.of((torch.zeros(3, dtype=torch.long),), {})
    with torch.no_grad():
        result = replay(net, spec, torch.device("cpu"))
    assert not result.backward and result.parameters == 0


@pytest.mark.parametrize("bf16", [False, True])
def test_a_fully_sharded_model_replays_unsharded_without_collectives(bf16):
    """FSDP2 refuses ``deepcopy``; the replay runs a plain copy of its modules (full shapes,
    FSDP's compute dtype, no FSDP hooks): with the process group gone, a collective in it
    would raise."""
    import argparse

    import torch.distributed as dist
    from train_llama_fsdp import build

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        args = argparse.Namespace(
            vocab=64, dim=16, layers=2, heads=2, seq=8, bf16=bf16, reshard=False, compile=False
        )
        model = build(args, torch.device("cpu"), 1)
    finally:
        dist.destroy_process_group()
    idx = torch.zeros(2, 8, dtype=torch.long)
    seen: list[torch.dtype] = []
    model.blocks[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))  # a script's
    result = replay(model, ForwardSpec.of((idx, idx), {}), torch.device("cpu"))
    params = list(model.parameters())
    assert result.backward and result.parameters == len(params)
    assert seen == [torch.bfloat16 if bf16 else torch.float32], (
        "the script's hook ran, in FSDP's dtype"
    )
    assert all(p.is_meta and p.grad is None for p in params), "the model itself is untouched"


def test_a_shadow_replays_a_fully_sharded_model_despite_its_collectives(tmp_path):
    """FSDP2's gradient sync says its forward runs collectives (its all-gathers): the
    unsharded copy has none, so the replay is not skipped for it; a model-parallel
    integration's plain model still is."""
    import dataclasses

    from leto.preinit.replay import skip_reason
    from tests.preinit.test_model_warmup import _shadow

    site, _ = _shadow(tmp_path, 3)
    site = dataclasses.replace(
        site,
        forward_collectives=True,
        env=dataclasses.replace(
            site.env, preinit=dataclasses.replace(site.env.preinit, replay_forward=True)
        ),
    )
    with torch.device("meta"):
        plain = _Net()
    assert "collectives" in skip_reason(site, plain)
    import argparse

    import torch.distributed as dist
    from train_llama_fsdp import build

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        args = argparse.Namespace(
            vocab=64, dim=16, layers=1, heads=2, seq=8, bf16=False, reshard=False, compile=False
        )
        assert skip_reason(site, build(args, torch.device("cpu"), 1)) is None
    finally:
        dist.destroy_process_group()


def test_a_shadow_of_a_fully_sharded_model_computes_the_clips_sharding_ahead(tmp_path):
    """Over meta gradients with the parameters' DTensor layouts: the first real clip over
    DTensors then computes no sharding (DTensor's dispatcher takes its slow path only where
    its cache misses), where a model of other shapes computes it in its first clip."""
    import argparse

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from train_llama_fsdp import build

    from leto.preinit.model_warmup import SHARDED_CLIP, warm_sharded_clip
    from tests.preinit.test_model_warmup import _report, _shadow

    site, hb_board = _shadow(tmp_path, 3)
    _report(hb_board, total=0, free=0, reserved=0, peak=0)
    dispatcher = DTensor._op_dispatcher
    slow = dispatcher._propagate_op_sharding_dispatch_slow_path
    computed: list[str] = []

    def counting(op, *args, **kwargs):
        computed.append(str(op))
        return slow(op, *args, **kwargs)

    def first_clip(model: torch.nn.Module) -> list[str]:
        model.to_empty(device="cpu")
        for p in model.parameters():
            local = torch.randn(p.to_local().shape)
            p.grad = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        computed.clear()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        return list(computed)

    def args(dim: int) -> argparse.Namespace:
        return argparse.Namespace(
            vocab=64, dim=dim, layers=2, heads=2, seq=8, bf16=False, reshard=False, compile=False
        )

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dispatcher._propagate_op_sharding_dispatch_slow_path = counting
    try:
        model = build(args(16), torch.device("cpu"), 1)
        result = warm_sharded_clip(site, list(model.parameters()))
        assert result is not None and result.ran, result
        assert any("_foreach_norm" in op for op in computed), "the warm-up computed them"
        assert first_clip(model) == []
        assert any(
            "_foreach_norm" in op for op in first_clip(build(args(24), torch.device("cpu"), 1))
        )
    finally:
        del dispatcher._propagate_op_sharding_dispatch_slow_path
        dist.destroy_process_group()
    (event,) = [e for e in read_events(tmp_path / "events.jsonl") if e["kind"] == Kind.MODEL_WARMED]
    assert event["name"] == SHARDED_CLIP and event["ran"]


class _Cached(torch.nn.Module):
    """Fills a cache of its own on its first call (as some rotary embeddings do)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.cache: dict[int, torch.Tensor] = {}
        self.alias = self.lin  # another reference to a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.setdefault(x.shape[0], x.detach())
        return self.alias(x)


def test_the_unsharded_copy_keeps_what_its_forward_caches_to_itself():
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from leto.preinit.replay import unsharded_copy

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.device("meta"):
            model = _Cached()
        fully_shard(model)
    finally:
        dist.destroy_process_group()
    copy_ = unsharded_copy(model)
    assert copy_.alias is copy_.lin and copy_.lin is not model.lin
    result = replay(model, ForwardSpec.of((torch.zeros(3, 8),), {}), torch.device("cpu"))
    assert result.backward and result.parameters == 2
    assert model.cache == {}, "the model's own cache was not filled by the replay"
