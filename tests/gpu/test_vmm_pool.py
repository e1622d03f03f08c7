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
    return subprocess.run([sys.executable, "-c", code, socket_path], check=False, capture_output=True, text=True, env=env, timeout=120)


def test_device_region_survives_sigkill_of_its_writer() -> None:
    sm = StateManagerProcess.start()
    try:
        writer = _run(_WRITER, sm.socket_path)
        assert writer.returncode == -signal.SIGKILL and "written" in writer.stdout, writer.stderr[-2000:]
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
        assert "refused: reattach of rank 0 region 'state' does not match" in out.stdout, out.stderr[-2000:]
    finally:
        sm.stop()
