"""The fused update's kernel, its process SIGKILLed around the launch, on the GPU.

A writer process runs ``triton_kernels.adamw_rmu`` over one large piece in retained device
regions (a state manager holds them), dropping done blocks' undo words from the L2
(``discard``), and is SIGKILLed at several delays around the kernel's time on the device.
A reader maps the same regions and does what ``FusedChunks.restore`` does without erasure:
it puts back the torn blocks (saved flag, no done flag) from their undo words, launches the
chunk again with the same token (the done blocks are skipped), and compares with a
fault-free launch, bit for bit.

On an H100 the dead process's queued launch (some 25 ms of device work) ran to its end at
every delay tried, even for a kill before the kernel started (presumably its CUDA teardown
outlasts the queue). So the torn blocks' restore is tested with emulated tears
(``tests/updater/test_fused.py``); what this test holds on a real kill is that the flags the
reader finds say what the kernel did, whatever that was, and that the launch after the
restore applies no block twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from leto.pool.process import StateManagerProcess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 1 << 29
"""Elements of the piece: about 4 ms of kernel on an H100, 14 GiB of regions."""
TOKEN = 5
SLEEP_S = 0.02
"""The device sleeps this long before the kernel, so the kill can be timed into it."""

_COMMON = textwrap.dedent("""
    import os, signal, sys, time, torch
    from leto.pool.client import PoolClient
    from leto.trainer.memory import RegionMemory
    from triton_kernels import adamw_rmu

    n, token = int(sys.argv[2]), int(sys.argv[3])
    dev = torch.device("cuda", 0)
    mem = RegionMemory(PoolClient(sys.argv[1]), 0, dev)
    blocks = adamw_rmu.num_blocks(n)
    (state, existing), (grads, _), (undo, _), (flags, _) = (
        mem.device_region(name, nbytes)
        for name, nbytes in (("state", 12 * n), ("grads", 4 * n), ("undo", 12 * n), ("flags", 16 * blocks))
    )
    state, grads, undo = (t.view(torch.float32) for t in (state, grads, undo))
    saved, done = flags.view(torch.int64).chunk(2)
    table = adamw_rmu.PieceTable.build([((0, n, 2 * n, 0, 0, n, 2 * n), n, 0, 0)], dev)
    row = adamw_rmu.scalar_row(
        lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decoupled=True, step=3.0
    )
    scalars = torch.tensor([row], dtype=torch.float64).to(torch.float32).to(dev)
    scale = torch.ones(1, device=dev)

    def fill(state, grads):
        gen = torch.Generator(device=dev).manual_seed(0)
        state.normal_(generator=gen)
        state[2 * n :].abs_()
        grads.normal_(generator=gen)

    def launch(state, undo, saved, done):
        adamw_rmu.adamw_chunk(state, grads, scale, undo, saved, done, table, scalars, token, True)
""")

_WRITER = _COMMON + textwrap.dedent("""
    adamw_rmu.warm_up(dev, [(table.align, token, True)])  # compiled before the timed launch
    fill(state, grads)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(float(sys.argv[4]) * float(sys.argv[5])))
    launch(state, undo, saved, done)
    print("launched", flush=True)
    time.sleep(float(sys.argv[6]))
    os.kill(os.getpid(), signal.SIGKILL)
""")

_READER = _COMMON + textwrap.dedent("""
    assert existing, "the regions were retained"
    n_done = int((done == token).sum())
    torn = (saved == token) & (done != token)
    # the fault-free launch from the same start
    ref = torch.empty_like(state)
    fill(ref, torch.empty_like(grads))
    launch(ref, torch.empty_like(undo), torch.zeros_like(saved), torch.zeros_like(done))
    # FusedChunks.restore without erasure, then the launch again
    mask = torn.repeat_interleave(adamw_rmu.BLOCK)[:n]
    for k in range(3):
        part = slice(k * n, (k + 1) * n)
        state[part] = torch.where(mask, undo[part], state[part])
    launch(state, undo, saved, done)
    print(f"done {n_done} torn {int(torn.sum())} of {blocks} equal {torch.equal(state, ref)}", flush=True)
""")


def _run(code: str, *args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        timeout=300,
    )


def _clock_hz() -> float:
    """Cycles per second of ``torch.cuda._sleep``, measured."""
    torch.cuda._sleep(1)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(100_000_000)
    b.record()
    b.synchronize()
    return 100_000_000 / (a.elapsed_time(b) / 1e3)


def test_a_kernel_whose_process_is_killed_is_finished_exactly_from_its_flags() -> None:
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("discard needs compute capability 8.0")
    hz = _clock_hz()
    outcomes = []
    for delay in (0.018, 0.021, 0.024, 0.030):
        sm = StateManagerProcess.start()
        try:
            writer = _run(_WRITER, sm.socket_path, N, TOKEN, SLEEP_S, hz, delay)
            assert writer.returncode == -signal.SIGKILL and "launched" in writer.stdout, (
                writer.stderr[-3000:]
            )
            reader = _run(_READER, sm.socket_path, N, TOKEN)
            assert reader.returncode == 0, reader.stderr[-3000:]
        finally:
            sm.stop()
        line = reader.stdout.strip().splitlines()[-1]
        outcomes.append((delay, line))
        assert line.endswith("equal True"), outcomes
    print(outcomes)  # how many blocks each kill left done and torn
