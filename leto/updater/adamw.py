"""AdamW on slices of flat retained buffers, the same arithmetic as ``torch.optim.AdamW``.

The RMU applies the optimizer chunk by chunk, so the math must be element-wise and must
not depend on how the elements are cut: each op below is the one PyTorch's multi-tensor
(foreach, non-capturable) Adam path runs, in the same order, with bias corrections
computed in Python doubles from the retained ``step`` counter. Results equal
``torch.optim.AdamW`` + ``clip_grad_norm_`` on the same inputs within float rounding
(bit-equal on CPU in the tests), and re-running a chunk from its undo copy reproduces it
bit for bit.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import torch

from leto.errors import ConfigError


@dataclass(frozen=True, slots=True)
class AdamWHyper:
    """Hyper-parameters of one parameter group for one step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    """AdamW (decoupled weight decay) when True, Adam's L2 penalty otherwise."""
    fused: bool = False
    """The group asked for ``fused=True``: its pieces are stepped by torch's own fused
    kernel (``adamw_fused_pieces``) where Leto's Triton kernel does not run the update."""

    @classmethod
    def from_group(
        cls, group: dict[str, Any], optimizer: torch.optim.Optimizer, lr: float
    ) -> AdamWHyper:
        for key in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(key):
                raise ConfigError(
                    f"consistency: rmu does not support Adam {key}=True yet; use consistency: snapshot"
                )
        if any(isinstance(group[k], torch.Tensor) for k in ("lr", "betas")) or isinstance(
            group["betas"][0], torch.Tensor
        ):
            raise ConfigError("consistency: rmu needs float lr and betas (not tensors)")
        decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(
            group.get("decoupled_weight_decay")
        )
        beta1, beta2 = group["betas"]
        return cls(
            float(lr),
            float(beta1),
            float(beta2),
            float(group["eps"]),
            float(group["weight_decay"]),
            decoupled,
            bool(group.get("fused")),
        )


def adamw_pieces(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[float],
    h: AdamWHyper,
) -> None:
    """One optimizer step, in place, on matching slices; ``steps`` are the post-increment
    step counts of each slice's parameter (bias correction)."""
    if not params:
        return
    if h.weight_decay != 0:
        if h.decoupled:
            torch._foreach_mul_(params, 1 - h.lr * h.weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=h.weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - h.beta1)
    torch._foreach_mul_(exp_avg_sqs, h.beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - h.beta2)
    bias_correction1 = [1 - h.beta1**s for s in steps]
    bias_correction2 = [1 - h.beta2**s for s in steps]
    step_size = [(h.lr / bc) * -1 for bc in bias_correction1]
    bias_correction2_sqrt = [bc**0.5 for bc in bias_correction2]
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, h.eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, step_size)


def adamw_fused_pieces(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    h: AdamWHyper,
) -> None:
    """One optimizer step, in place, on matching slices, by torch's fused Adam/AdamW kernel
    (what ``fused=True`` runs in torch itself: one call, not a dozen foreach ops); ``steps``
    are the slices' parameters' step counters, already incremented. Element-wise, so a
    chunk's slices get the bytes the whole parameters would."""
    if not params:
        return
    kernel = torch._fused_adamw_ if h.decoupled else torch._fused_adam_
    kernel(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        amsgrad=False,
        lr=h.lr,
        beta1=h.beta1,
        beta2=h.beta2,
        weight_decay=h.weight_decay,
        eps=h.eps,
        maximize=False,
        grad_scale=None,
        found_inf=None,
    )


def f32_add_one(x: float) -> float:
    """``x + 1`` rounded to float32: a device step counter's increment, on the host."""
    return struct.unpack("<f", struct.pack("<f", x + 1.0))[0]
