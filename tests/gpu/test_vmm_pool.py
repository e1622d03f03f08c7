"""Device tier on CUDA: VMM allocations retained by a state manager that has no CUDA context."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from leto.pool.process import StateManagerProcess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WRITER = textwrap.dedent("""
    import os, signal, sys, torch
    from leto.pool.client import PoolClient
    from leto.trainer.memory import RegionMemory
    mem = RegionMemory(PoolClient(sys.argv[1]), 0, torch.device("cuda", 0))
    t, existing = mem.device_region("state", 64 << 20)
    assert not existing
    t.view(torch.int32).copy_(torch.arange(t.numel() // 4, device="cuda", dtype=torch.int32) * 7)
    torch.cuda.synchronize()
    print("written", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")
_READER = textwrap.dedent("""
    import sys, torch
    from leto.pool.client import PoolClient
    from leto.trainer.memory import RegionMemory
    mem = RegionMemory(PoolClient(sys.argv[1]), 0, torch.device("cuda", 0))
    t, existing = mem.device_region("state", 64 << 20)
    expect = torch.arange(t.numel() // 4, device="cuda", dtype=torch.int32) * 7
    print("existing", existing, "equal", bool(torch.equal(t.view(torch.int32), expect)), flush=True)
""")


def _run(code: str, socket_path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run(
        [sys.executable, "-c", code, socket_path],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_device_region_survives_sigkill_of_its_writer() -> None:
    sm = StateManagerProcess.start()
    try:
        writer = _run(_WRITER, sm.socket_path)
        assert writer.returncode == -signal.SIGKILL and "written" in writer.stdout, writer.stderr[
            -2000:
        ]
        reader = _run(_READER, sm.socket_path)
        assert "existing True equal True" in reader.stdout, reader.stdout + reader.stderr[-2000:]
        # The state manager retained it without ever loading the CUDA driver (no context, no HBM).
        with open(f"/proc/{sm.proc.pid}/maps") as f:
            assert "libcuda" not in f.read()
    finally:
        sm.stop()


def test_reattach_with_another_size_is_refused() -> None:
    sm = StateManagerProcess.start()
    try:
        code = textwrap.dedent("""
            import sys, torch
            from leto.errors import PoolError
            from leto.pool.client import PoolClient
            from leto.trainer.memory import RegionMemory
            mem = RegionMemory(PoolClient(sys.argv[1]), 0, torch.device("cuda", 0))
            mem.device_region("state", 4 << 20)
            try:
                RegionMemory(PoolClient(sys.argv[1]), 0, torch.device("cuda", 0)).device_region("state", 8 << 20)
            except PoolError as e:
                print("refused:", e)
        """)
        out = _run(code, sm.socket_path)
        assert "refused: reattach of rank 0 region 'state' does not match" in out.stdout, (
            out.stderr[-2000:]
        )
    finally:
        sm.stop()


_CHUNKED_WRITER = textwrap.dedent("""
    import os, signal, sys, torch
    from leto.pool.client import PoolClient
    from leto.trainer.memory import RegionMemory
    mem = RegionMemory(PoolClient(sys.argv[1]), 0, torch.device("cuda", 0))
    t, existing = mem.device_region("state", 16 << 21, chunk_bytes=2 << 20)
    assert not existing
    t.view(torch.int32).copy_(torch.arange(t.numel() // 4, device="cuda", dtype=torch.int32) * 7)
    torch.cuda.synchronize()
    print("written", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")
_CHUNKED_SHADOW = textwrap.dedent("""
    import ctypes, sys, time, torch
    from leto.pool.client import PoolClient
    from leto.trainer.memory import RegionMemory
    pool = PoolClient(sys.argv[1])
    mem = RegionMemory(pool, 0, torch.device("cuda", 0))
    t, existing = mem.device_region("state", 16 << 21, chunk_bytes=2 << 20)  # mapped ahead
    region, _ = mem._chunked["state"]
    expect = torch.arange(t.numel() // 4, device="cuda", dtype=torch.int32) * 7
    print("existing", existing, "equal", bool(torch.equal(t.view(torch.int32), expect)))
    print("healthy", mem.backend.failed(region.ptr, region.nbytes, 2 << 20))
    print("erased", pool.erase(0, "state", 2 << 20, [3, 11]))
    t0 = time.perf_counter()
    print("lost", mem.lost_pages("state", 2 << 20), f"{(time.perf_counter() - t0) * 1e3:.2f} ms")
    page = (2 << 20) // 4
    words = t.view(torch.int32)
    zero = [int(words[p * page:(p + 1) * page].abs().sum()) == 0 for p in range(16)]
    kept = all(torch.equal(words[p * page:(p + 1) * page], expect[p * page:(p + 1) * page])
               for p in range(16) if p not in (3, 11))
    print("zeroed", [p for p in range(16) if zero[p]], "kept", kept)
    # The per-chunk mapping query: unmap one chunk of this process's view, find it, replace it.
    mem.backend.unmap(region.ptr + 5 * (2 << 20), 2 << 20)
    print("unmapped found", mem.backend.failed(region.ptr, region.nbytes, 2 << 20))
    replaced = mem.lost_pages("state", 2 << 20)
    mem.commit_replacements()  # the rebuild would run here; then the state manager holds them
    print("replaced", replaced, "pagemap", pool.pagemap(0, "state"))
    words.fill_(1); torch.cuda.synchronize()
    print("writable", int(words.sum()) == words.numel())
""")


def test_device_chunks_lost_after_mapping_are_found_replaced_and_zeroed() -> None:
    """16 chunks of 2 MiB: a shadow maps them ahead, the writer is SIGKILLed, the state
    manager drops chunks 3 and 11 (the fault injector's device-page loss); the shadow's
    page-map query finds them, remaps fresh zeroed chunks at the same addresses, keeps the
    rest; a chunk unmapped in its own view is found by cuMemGetAccess and replaced."""
    sm = StateManagerProcess.start()
    try:
        writer = _run(_CHUNKED_WRITER, sm.socket_path)
        assert writer.returncode == -signal.SIGKILL and "written" in writer.stdout, writer.stderr[
            -2000:
        ]
        out = _run(_CHUNKED_SHADOW, sm.socket_path)
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        for line in (
            "existing True equal True",
            "healthy []",
            "erased [3, 11]",
            "lost [3, 11]",
            "zeroed [3, 11] kept True",
            "unmapped found [5]",
            "replaced [5] pagemap []",
            "writable True",
        ):
            assert line in out.stdout, out.stdout
        client = sm.client()
        assert client.stats()["fds"] == 16  # one per chunk, the two replaced ones included
        client.close()
        with open(f"/proc/{sm.proc.pid}/maps") as f:
            assert "libcuda" not in f.read()
    finally:
        sm.stop()
