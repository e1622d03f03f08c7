"""Triton kernel: one RMU chunk piece in one pass — undo copy, progress flag, AdamW in place.

The unfused RMU path (``leto.updater.rmu`` with ``fused=False``) copies a chunk's bytes to
the undo buffer, then runs torch's foreach AdamW ops over it: about eight passes over
param / exp_avg / exp_avg_sq. This kernel reads param, grad, exp_avg and exp_avg_sq once
and writes the undo copy and the new values once (10 words per element instead of ~30).
Its pure-PyTorch reference is ``leto.updater.adamw.adamw_pieces`` plus the undo copy.

Crash consistency. The marker says CHUNK_SAVED before the kernel starts, but the kernel
writes the undo copy as it goes, so after a kill some blocks' undo slots still hold an
older chunk. Each program therefore stores its block's undo words, then (barrier, one
``acq_rel`` atomic, barrier) sets ``flags[flag_base + pid] = token``, and only then stores
the new values. A restore copies back exactly the blocks whose flag equals the chunk's
token (``leto.updater.rmu.fused_token``): a block without the flag was never modified.

The parity delta is not materialised: the GF(2^16) update kernel (``gf16_mac``) reads the
undo copy and the new state and XORs them itself.

Arithmetic. The ops and their association are those of torch's CUDA foreach AdamW
(``lerp`` with weight < 0.5 as ``m + w (g - m)``, ``addcmul`` as ``v + c (g g)``,
``addcdiv`` as ``p + s (m / d)``), with IEEE-rounded sqrt and division and scalars rounded
to fp32 as torch's opmath does; whether the compiler contracts a multiply-add into an FMA
may still differ from torch's build, so fused and unfused agree to a few ulps, not
always bit for bit. Recovery only needs the fused path to agree with itself, which it does:
the kernel is element-wise and deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Elements per program; also the granularity of the restore (one flag per block)."""
NUM_WARPS = 4
VECTOR = 4
"""float32 elements per 16-byte access: a piece whose offsets and length are multiples of
it is launched with ``ALIGN = VECTOR`` (vector loads and stores), any other with 1."""


@triton.jit(
    do_not_specialize=[
        "p_off",
        "m_off",
        "v_off",
        "g_off",
        "up_off",
        "um_off",
        "uv_off",
        "n",
        "flag_base",
        "token",
    ]
)
def _adamw_undo_kernel(
    state_ptr,
    grad_ptr,
    undo_ptr,
    flag_ptr,
    p_off,
    m_off,
    v_off,
    g_off,
    up_off,
    um_off,
    uv_off,
    n,
    flag_base,
    token,
    decay,
    l2_wd,
    w1,
    beta2,
    w2,
    step_size,
    bc2_sqrt,
    eps,
    WD_MODE: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    if ALIGN > 1:  # every offset and n are multiples of ALIGN (the caller checked): 16-byte
        # vector loads and stores need the compiler to know it, which it infers from these
        p_off = p_off // ALIGN * ALIGN
        m_off = m_off // ALIGN * ALIGN
        v_off = v_off // ALIGN * ALIGN
        g_off = g_off // ALIGN * ALIGN
        up_off = up_off // ALIGN * ALIGN
        um_off = um_off // ALIGN * ALIGN
        uv_off = uv_off // ALIGN * ALIGN
        n = n // ALIGN * ALIGN
    pid = tl.program_id(0)
    idx = tl.cast(pid, tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    ok = idx < n
    p = tl.load(state_ptr + p_off + idx, mask=ok, other=0.0)
    m = tl.load(state_ptr + m_off + idx, mask=ok, other=0.0)
    v = tl.load(state_ptr + v_off + idx, mask=ok, other=0.0)
    g = tl.load(grad_ptr + g_off + idx, mask=ok, other=0.0)
    tl.store(undo_ptr + up_off + idx, p, mask=ok)
    tl.store(undo_ptr + um_off + idx, m, mask=ok)
    tl.store(undo_ptr + uv_off + idx, v, mask=ok)
    # the undo words of every thread of the block are visible before the flag, and the flag
    # before any new value
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr + flag_base + pid, token, sem="acq_rel")
    tl.debug_barrier()
    if WD_MODE == 1:  # AdamW: decoupled decay
        p = p * decay
    elif WD_MODE == 2:  # Adam: L2 penalty in the gradient
        g = g + l2_wd * p
    m = m + w1 * (g - m)
    v = v * beta2
    v = v + w2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p + step_size * tl.div_rn(m, denom)
    tl.store(state_ptr + m_off + idx, m, mask=ok)
    tl.store(state_ptr + v_off + idx, v, mask=ok)
    tl.store(state_ptr + p_off + idx, p, mask=ok)


def num_blocks(n: int) -> int:
    """Programs (and flags) for a piece of ``n`` elements."""
    return triton.cdiv(n, BLOCK)


def adamw_undo(
    state: torch.Tensor,
    grads: torch.Tensor,
    undo: torch.Tensor,
    flags: torch.Tensor,
    offsets: tuple[int, int, int, int, int, int, int],
    n: int,
    flag_base: int,
    token: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    step: float,
) -> None:
    """AdamW on ``n`` elements of one parameter, saving their old values first.

    ``state``/``grads``/``undo`` are flat float32 views, ``flags`` flat int64;
    ``offsets`` = element offsets of (param, exp_avg, exp_avg_sq) in ``state``, of the
    gradient in ``grads``, and of the undo copies of (param, exp_avg, exp_avg_sq) in
    ``undo``. ``step`` is the post-increment step count (bias correction).
    """
    for name, t, dt in (
        ("state", state, torch.float32),
        ("grads", grads, torch.float32),
        ("undo", undo, torch.float32),
        ("flags", flags, torch.int64),
    ):
        if t.dtype != dt or t.dim() != 1:
            raise TypeError(f"{name} must be a flat {dt} view, got {t.dtype} {tuple(t.shape)}")
    if n <= 0:
        return
    args, meta = _launch_args(
        (state, grads, undo, flags),
        offsets,
        n,
        flag_base,
        token,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        decoupled=decoupled,
        step=step,
    )
    _adamw_undo_kernel[(num_blocks(n),)](*args, **meta)


def _launch_args(
    tensors: tuple[torch.Tensor, ...],
    offsets: tuple[int, ...],
    n: int,
    flag_base: int,
    token: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    step: float,
) -> tuple[list[object], dict[str, int]]:
    """The kernel's positional arguments and launch keywords for one :func:`adamw_undo` call."""
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    wd_mode = 0 if weight_decay == 0 else (1 if decoupled else 2)
    args = [
        *tensors,
        *offsets,
        n,
        flag_base,
        token,
        1 - lr * weight_decay,
        weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        -(lr / bc1),
        bc2**0.5,
        eps,
    ]
    align = VECTOR if all(x % VECTOR == 0 for x in (*offsets, n)) else 1
    return args, {"WD_MODE": wd_mode, "ALIGN": align, "BLOCK_SIZE": BLOCK, "num_warps": NUM_WARPS}


_INTS = slice(4, 14)
"""Positions of the integer arguments (offsets, n, flag_base, token) in ``_launch_args``."""


def warm_up(device: torch.device, calls: Iterable[dict[str, Any]]) -> int:
    """Compile and load the specialisations that :func:`adamw_undo` would launch for ``calls``.

    Each call is the keyword arguments of :func:`adamw_undo` minus the four tensors
    (``offsets``, ``n``, ``flag_base``, ``token``, the hyper-parameters, ``step``). Triton
    keys a launch by its constexprs (``WD_MODE`` from the weight decay, ``ALIGN`` from the
    offsets' and length's divisibility) and by the width
    of every integer argument even where it does not specialise the value (i32 below
    2**31, i64 above: the flag token ``(step << 23) + chunk + 1`` passes 2**31 at step 256,
    element offsets in a state region beyond 8 GiB do too). One launch per distinct key,
    on scratch memory of ``device``, with ``n = 0`` and ``flag_base = 0`` (the same
    width): every element access is masked off, so the real offsets are never
    dereferenced; the only write is the progress flag of block 0 in a scratch word.
    Returns the number of launches.
    """
    from triton.runtime.jit import mangle_type

    scratch = torch.zeros(BLOCK, dtype=torch.float32, device=device)
    flags = torch.zeros(2, dtype=torch.int64, device=device)
    tensors = (scratch, scratch, scratch, flags)
    seen: set[tuple[object, ...]] = set()
    for call in calls:
        args, meta = _launch_args(tensors, **call)
        key = (*(mangle_type(a) for a in args[_INTS]), meta["WD_MODE"], meta["ALIGN"])
        if key in seen:
            continue
        seen.add(key)
        n_at, flag_at = _INTS.start + 7, _INTS.start + 8
        for at, what in ((n_at, "n"), (flag_at, "flag_base")):
            if mangle_type(args[at]) != mangle_type(0):
                raise ValueError(
                    f"adamw_rmu.warm_up: {what}={args[at]} is too wide to warm without touching memory"
                )
            args[at] = 0
        _adamw_undo_kernel[(1,)](*args, **meta)
    return len(seen)
