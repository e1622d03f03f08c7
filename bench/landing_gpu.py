"""What landing the gradients in retained memory costs a backward, on one GPU.

The 1.1 B GPT of ``bench/recovery_gpu.py`` (bf16 autocast, fp32 weights), one process, no
optimizer: forward and backward only, each step starting with every ``.grad`` unset (torch's
``zero_grad()``). Variants, interleaved step by step so the host's drift hits all alike:

* ``plain``: nothing else (a torchrun loop's backward);
* ``noop hooks``: a post-accumulate hook on every parameter that returns at once (the
  Python calls alone);
* ``copy, allocator``: each hook copies its gradient into a view of one region from torch's
  caching allocator;
* ``copy, vmm``: the same into a ``cuMemCreate`` region mapped as Leto maps its regions
  (``leto.pool.cuda_vmm``);
* ``landing, vmm``: Leto's own ``GradLanding`` into the vmm region (small gradients wait and
  land together when backward ends).

Prints each variant's median step (host wall to the end of ``backward()``, the device
synchronised between steps: on this model the launch queue fills, so the wall counts the
device's work as well as the host's) and its excess over ``plain``, then the host time of
single ``copy_`` calls of a 16 MiB gradient into each kind of memory (host time alone).

    python3 bench/landing_gpu.py [--steps 60]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]

from train_gpt import GPT

from leto.pool import cuda_vmm
from leto.trainer.grad_landing import GradLanding, GradWrites


def vmm_region(nbytes: int, device: int) -> torch.Tensor:
    """A uint8 region of ``nbytes`` (rounded up) mapped as ``RegionMemory.device_region`` does."""
    chunks = cuda_vmm.CudaChunks(device)
    nbytes = cuda_vmm.round_up(nbytes, device)
    fd = chunks.create(nbytes)
    addr = chunks.reserve(nbytes)
    chunks.map(addr, fd, nbytes)
    chunks.enable(addr, nbytes)
    return torch.as_tensor(cuda_vmm.array_interface(addr, nbytes), device=f"cuda:{device}")


def views(params: list[torch.nn.Parameter], region: torch.Tensor) -> list[torch.Tensor]:
    out, at = [], 0
    for p in params:
        n = p.numel() * p.element_size()
        out.append(region[at : at + n].view(p.dtype).view(p.shape))
        at += -(-n // 256) * 256
    return out


def region_bytes(params: list[torch.nn.Parameter]) -> int:
    return sum(-(-p.numel() * p.element_size() // 256) * 256 for p in params)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = GPT(32000, 2048, 20, 16, 512, 0.1).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    x = torch.randint(0, 32000, (4, 512), device="cuda")
    y = torch.randint(0, 32000, (4, 512), device="cuda")
    nbytes = region_bytes(params)
    alloc = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    vmm = vmm_region(nbytes, 0)
    vmm.zero_()

    handles: list[torch.utils.hooks.RemovableHandle] = []

    def unhook() -> None:
        for h in handles:
            h.remove()
        handles.clear()

    def hooked(make: Callable[[int], Callable[[torch.Tensor], None]]) -> None:
        unhook()
        handles.extend(p.register_post_accumulate_grad_hook(make(i)) for i, p in enumerate(params))

    def copying(targets: list[torch.Tensor]) -> Callable[[int], Callable[[torch.Tensor], None]]:
        def make(i: int) -> Callable[[torch.Tensor], None]:
            view = targets[i]

            def hook(p: torch.Tensor) -> None:
                view.copy_(p.grad)  # type: ignore[arg-type]
                p.grad = view

            return hook

        return make

    # GradLanding hooks its parameters for good: a copy of the model of its own
    landed_model = copy.deepcopy(model)
    landed = [p for p in landed_model.parameters() if p.requires_grad]
    landing = GradLanding(landed, views(landed, vmm), GradWrites(vmm))

    def setups() -> dict[str, Callable[[], None]]:
        return {
            "plain": unhook,
            "noop hooks": lambda: hooked(lambda i: lambda p: None),
            "copy, allocator": lambda: hooked(copying(views(params, alloc))),
            "copy, vmm": lambda: hooked(copying(views(params, vmm))),
        }

    def step(net: torch.nn.Module, begin: Callable[[], None]) -> float:
        begin()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = net(x, y)
        loss.backward()
        return time.perf_counter() - t0

    def unset() -> None:
        for p in params:
            p.grad = None

    times: dict[str, list[float]] = {name: [] for name in [*setups(), "landing, vmm"]}
    for k in range(args.steps + 5):
        for name, setup in setups().items():
            setup()
            t = step(model, unset)
            torch.cuda.synchronize()
            if k >= 5:
                times[name].append(t)
        unhook()
        t = step(landed_model, landing.begin)
        torch.cuda.synchronize()
        if k >= 5:
            times["landing, vmm"].append(t)
    unhook()
    base = statistics.median(times["plain"])
    print(f"forward + backward, host wall, median of {args.steps} interleaved steps:")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:16s} {m * 1e3:7.2f} ms  ({(m - base) * 1e3:+.2f} ms)")
    src = torch.randn(4 << 20, device="cuda")
    for name, region in (("allocator", alloc), ("vmm", vmm)):
        dst = region[: src.numel() * 4].view(torch.float32)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            dst.copy_(src)
        t = (time.perf_counter() - t0) / 200
        torch.cuda.synchronize()
        print(f"  copy_ of 16 MiB into {name}: {t * 1e6:.1f} us of host time per call")


if __name__ == "__main__":
    main()
