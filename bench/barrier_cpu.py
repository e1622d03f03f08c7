"""The commit barrier's cost on CPU: gloo's ``dist.barrier()`` against a one-word
``all_reduce`` (what ``RetainedState._commit_barrier`` runs on CPU), per call, on ranks
started by torchrun on this host. Each is timed twice, alternating, after a warm-up.

    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/barrier_cpu.py
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

WARM, CALLS = 200, 2000


def main() -> None:
    dist.init_process_group("gloo")
    word = torch.zeros(1, dtype=torch.int32)
    calls = {
        "dist.barrier()": dist.barrier,
        "all_reduce(1 x int32, MAX)": lambda: dist.all_reduce(word, op=dist.ReduceOp.MAX),
    }
    for _ in range(2):
        for name, call in calls.items():
            for _ in range(WARM):
                call()
            t0 = time.perf_counter()
            for _ in range(CALLS):
                call()
            if dist.get_rank() == 0:
                print(f"{name}: {(time.perf_counter() - t0) / CALLS * 1e6:.0f} us per call")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
