"""The fatal-failure checkpoint's names for a trainer's retained state
(``leto.trainer.checkpointing.named_views``): every parameter the optimizer holds, also one
outside the model (a learned temperature), and the frozen parameters outside the optimizer,
each a view of its retained slot (a real trainer ``Context`` in this process)."""

from __future__ import annotations

import torch
from torch import nn

from leto.trainer.checkpointing import named_views
from tests.trainer.local import local_context


def test_every_retained_parameter_has_a_checkpoint_name(monkeypatch) -> None:
    with local_context(monkeypatch) as ctx:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        model[0].requires_grad_(False)
        temperature = nn.Parameter(torch.zeros(()))
        opt = torch.optim.AdamW([*model[1].parameters(), temperature], lr=0.1)
        state = ctx.retain(model, opt)
        views = named_views(state)
        named = {
            "model.1.weight": model[1].weight,
            "model.1.bias": model[1].bias,
            "model.<optimizer param 2>": temperature,
            "model.0.weight": model[0].weight,
            "model.0.bias": model[0].bias,
        }
        for key, p in named.items():
            assert views[key].data_ptr() == p.data_ptr(), key
        assert "optim.<optimizer param 2>.exp_avg" in views
