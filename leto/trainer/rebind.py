"""Rebinding the script's tensor objects to retained memory.

``ctx.retain()`` makes each parameter and buffer live in a retained region while the module
and the optimizer keep the same Python object (``torch.utils.swap_tensors``). The gradient
hooks a script registered on a parameter before that (``register_hook``,
``register_post_accumulate_grad_hook``) are installed on the tensor the object held, and
would stop firing after the swap: the job would train without them, silently. ``rebind``
installs them on the new one; the script's hook handles still remove them."""

from __future__ import annotations

import torch


def rebind(tensor: torch.Tensor, new: torch.Tensor) -> None:
    """Make ``tensor`` hold ``new``'s data (``torch.utils.swap_tensors``), its gradient
    hooks still firing."""
    torch.utils.swap_tensors(tensor, new)
    # The object keeps its hook dicts; setting one installs it on the tensor it now holds.
    if tensor._backward_hooks:
        tensor._backward_hooks = tensor._backward_hooks
    if tensor._post_accumulate_grad_hooks:
        tensor._post_accumulate_grad_hooks = tensor._post_accumulate_grad_hooks
