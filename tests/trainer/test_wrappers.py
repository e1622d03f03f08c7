"""A model wrapped in torch's ``DistributedDataParallel`` (a torchrun script ported as is) is
refused at ``retain()`` with what to pass instead, before any retained memory is planned:
the wrapper holds references to its parameters, which then cannot become views of retained
memory (torch's ``swap_tensors`` failed with a use-count error). A real trainer ``Context``
in this process (tests/trainer/local.py), on a gloo group of one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from leto.errors import ConfigError
from tests.trainer.local import local_context


def test_a_ddp_wrapped_model_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    try:
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        ddp = nn.parallel.DistributedDataParallel(net)
        with local_context(monkeypatch) as ctx:
            opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
            with pytest.raises(ConfigError, match="got a DistributedDataParallel: do not wrap"):
                ctx.retain(ddp, opt)
    finally:
        dist.destroy_process_group()
