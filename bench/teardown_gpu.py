"""How long the kernel takes to tear down a SIGKILLed CUDA process, by what it holds.

The agent may promote a shadow only after the dead trainer's CUDA context is destroyed
(its queued kernels could still write retained memory), so this teardown is the floor of
"detect" in the recovery breakdown. For each case a child process initialises CUDA, takes
the memory named, and is SIGKILLed; printed: when the agent can see it dying
(``dying_signal``: PF_EXITING + exit code) and when it is a zombie (``waitid``).

    python bench/teardown_gpu.py [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from leto.health import dying_signal

CHILD = r"""
import os, sys, torch
from leto.pool import cuda_vmm
kind, gib = sys.argv[1], int(sys.argv[2])
torch.cuda.init(); torch.empty(1, device="cuda")
keep = []
if kind == "torch" and gib:
    keep.append(torch.empty(gib << 30, dtype=torch.uint8, device="cuda").fill_(1))
elif kind in ("vmm", "chunks") and gib:  # one allocation, or one per 2 MiB page
    chunks = cuda_vmm.CudaChunks(0)
    nbytes = gib << 30
    size = nbytes if kind == "vmm" else 2 << 20
    addr = chunks.reserve(nbytes)
    fds = []
    for off in range(0, nbytes, size):
        fd = chunks.create(size)
        chunks.map(addr + off, fd, size)
        fds.append(fd)
    chunks.enable(addr, nbytes)
    t = torch.as_tensor(cuda_vmm.array_interface(addr, nbytes), device="cuda"); t.fill_(1); keep.append(t)
elif kind == "busy":  # a kernel queue still running when the kill lands
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(200):
        a = a @ a
    keep.append(a)
torch.cuda.synchronize() if kind != "busy" else None
print("ready", flush=True)
import time; time.sleep(120)
"""


def one(kind: str, gib: int) -> tuple[float | None, float]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, kind, str(gib)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
    time.sleep(0.2)
    t0 = time.perf_counter()
    os.kill(child.pid, signal.SIGKILL)
    dying = None
    while not os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
        if dying is None and dying_signal(child.pid):
            dying = time.perf_counter() - t0
        time.sleep(0.0005)
    zombie = time.perf_counter() - t0
    child.wait()
    return dying, zombie


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=str(REPO / "bench/results/teardown_gpu.json"))
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    cases = [
        ("torch", 0),
        ("torch", 8),
        ("torch", 32),
        ("torch", 96),
        ("vmm", 16),
        ("vmm", 64),
        ("chunks", 16),
        ("busy", 0),
    ]
    out = []
    for kind, gib in cases:
        runs = [one(kind, gib) for _ in range(args.repeats)]
        row = {
            "case": f"{kind} {gib} GiB",
            "dying_s": [r[0] for r in runs],
            "zombie_s": [r[1] for r in runs],
            "zombie_median_s": statistics.median(r[1] for r in runs),
        }
        print(
            f"{row['case']:>14}: seen dying {[round(d or -1, 4) for d in row['dying_s']]} s, "
            f"zombie {[round(z, 3) for z in row['zombie_s']]} s",
            flush=True,
        )
        out.append(row)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
