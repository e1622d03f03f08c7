"""What each of Leto's placements costs a step of N micro-batches, on one GPU, in one process.

A cost per micro-batch would grow with gradient accumulation, where the once-a-step costs
(the landing copy, the undo) shrink relative to the step: this bench takes the trainer's
placements apart to find one. The 1.1 B GPT of ``bench/recovery_gpu.py`` (bf16 autocast,
fp32 weights), no optimizer: each step unsets every ``.grad`` and runs ``--grad-accum``
forward/backward passes. Variants, interleaved step by step so the host's drift hits all
alike:

* ``plain``: a torchrun loop's passes;
* ``landing``: Leto's ``GradLanding`` into a gradient region of 2 MiB ``cuMemCreate``
  chunks mapped back to back, as Leto's device regions are (``leto.pool.pagemap``);
* ``landing, side stream``: the same, each large gradient copied on a side stream
  (``GradLanding(copy_stream=...)``), overlapping the rest of backward;
* ``landing + lending``: the same, every allocation of the passes going to the lending
  pool over a 768 MiB chunked region (the GPT's undo buffer; ``leto.pool.lend``), its
  ``check_returned`` after them, as ``leto.trainer.compute`` runs a compute phase;
* ``params in vmm``: the parameters' storage moved into a chunked region (Leto's retained
  state), plain gradients;
* ``leto-like``: parameters in a chunked region, landing and lending together;
* ``leto-like, side stream``: the same, landing on a side stream;
* ``plain, second context``: ``plain`` again while another process holds a CUDA context
  and 1 GiB on the same GPU and sleeps (an idle shadow), after the others.

Prints each variant's median step (wall time of its passes, the device synchronised at
both ends) and its excess over ``plain`` per micro-batch.

    python3 bench/accum_gpu.py [--grad-accum 16] [--steps 6]
    python3 bench/accum_gpu.py --cpu-check     # the logic on a tiny CPU model, no CUDA
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "examples")]

from train_gpt import GPT

from bench.landing_gpu import region_bytes, views
from leto.trainer.grad_landing import GradLanding, GradWrites

CHUNK_BYTES = 2 << 20
"""Leto's device regions: one ``cuMemCreate`` per 2 MiB chunk (``leto.pool.pagemap``)."""
UNDO_BYTES = 768 << 20
"""The undo buffer of the GPT's 256 MiB chunks (``leto.config.default_rmu_chunk_bytes``)."""


def chunked_region(nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 region of at least ``nbytes``: 2 MiB ``cuMemCreate`` chunks mapped back to
    back in one reservation, as Leto maps its device regions (a plain tensor on CPU)."""
    if device.type != "cuda":
        return torch.zeros(nbytes, dtype=torch.uint8)
    from leto.pool import cuda_vmm

    index = device.index or 0
    chunks = cuda_vmm.CudaChunks(index)
    chunk = cuda_vmm.round_up(CHUNK_BYTES, index)
    nbytes = -(-nbytes // chunk) * chunk
    addr = chunks.reserve(nbytes)
    for at in range(0, nbytes, chunk):
        fd = chunks.create(chunk)
        chunks.map(addr + at, fd, chunk)
        os.close(fd)  # the mapping holds the allocation now (thousands of chunks: no fd each)
    chunks.enable(addr, nbytes)
    region = torch.as_tensor(cuda_vmm.array_interface(addr, nbytes), device=device)
    region.zero_()
    return region


class Variant:
    """One way of running a step's passes: a model of its own (hooks are for good)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        *,
        landing: bool = False,
        lending: bool = False,
        params_in_vmm: bool = False,
        side_stream: bool = False,
    ) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        if params_in_vmm:
            state = chunked_region(region_bytes(self.params), device)
            for p, view in zip(self.params, views(self.params, state), strict=True):
                view.copy_(p.data)
                p.data = view
            self._state = state  # the parameters' storage lives as long as the variant
        self.landing = None
        if landing:
            grads = chunked_region(region_bytes(self.params), device)
            stream = torch.cuda.Stream(device) if side_stream and device.type == "cuda" else None
            self.landing = GradLanding(
                self.params, views(self.params, grads), GradWrites(grads), copy_stream=stream
            )
        self.lender = None
        if lending and device.type == "cuda":
            from leto.pool.lend import ActivationLender

            self._undo = chunked_region(UNDO_BYTES, device)
            self.lender = ActivationLender(device, {"rmu.undo": self._undo})

    def begin(self) -> None:
        if self.landing is not None:
            self.landing.begin()
        else:
            for p in self.params:
                p.grad = None

    def passes(self) -> AbstractContextManager[None]:
        return self.lender.lending() if self.lender is not None else nullcontext()

    def end(self) -> None:
        if self.landing is not None:
            self.landing.settle()
        if self.lender is not None:
            self.lender.check_returned()


@contextmanager
def second_context(device: torch.device) -> Iterator[None]:
    """Another process holding a CUDA context and 1 GiB on ``device``, asleep."""
    code = (
        "import sys, time, torch\n"
        f"x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda:{device.index or 0}')\n"
        "torch.cuda.synchronize()\n"
        "print('up', flush=True)\n"
        "time.sleep(3600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "up":
            raise SystemExit("accum_gpu: the second CUDA process did not start")
        yield
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grad-accum", type=int, default=16, metavar="N")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cpu-check", action="store_true", help="a tiny model on the CPU")
    args = ap.parse_args()
    if args.grad_accum < 1 or args.steps < 1:
        ap.exit(2, f"{ap.prog}: error: --grad-accum and --steps must be >= 1\n")
    cuda = not args.cpu_check
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    shape = (32000, 2048, 20, 16, 512) if cuda else (256, 32, 2, 4, 16)
    batch = 4
    with device:
        base = GPT(*shape, 0.0)  # no dropout: every variant computes the same gradients
    micro = [
        (
            torch.randint(0, shape[0], (batch, shape[4]), device=device),
            torch.randint(0, shape[0], (batch, shape[4]), device=device),
        )
        for _ in range(args.grad_accum)
    ]
    variants: dict[str, Variant] = {"plain": Variant(base, device)}
    for name, kw in (
        ("landing", {"landing": True}),
        ("landing, side stream", {"landing": True, "side_stream": True}),
        ("landing + lending", {"landing": True, "lending": True}),
        ("params in vmm", {"params_in_vmm": True}),
        ("leto-like", {"landing": True, "lending": True, "params_in_vmm": True}),
        (
            "leto-like, side stream",
            {"landing": True, "lending": True, "params_in_vmm": True, "side_stream": True},
        ),
    ):
        variants[name] = Variant(copy.deepcopy(base), device, **kw)

    def step(v: Variant) -> float:
        v.begin()
        t0 = time.perf_counter()
        with v.passes():
            for x, y in micro:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    loss = v.model(x, y) / args.grad_accum
                loss.backward()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        v.end()
        if cuda:
            torch.cuda.synchronize()
        return elapsed

    times: dict[str, list[float]] = {name: [] for name in variants}
    for k in range(args.steps + 2):  # two warm-up steps
        for name, v in variants.items():
            t = step(v)
            if k >= 2:
                times[name].append(t)
    if cuda:
        plain = variants["plain"]
        times["plain, second context"] = []
        with second_context(device):
            for k in range(args.steps + 1):
                t = step(plain)
                if k >= 1:
                    times["plain, second context"].append(t)
    same = all(  # to the rounding of unordered reductions (the embedding's backward)
        torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-6)
        for v in list(variants.values())[1:]
        for p, q in zip(variants["plain"].params, v.params, strict=True)
    )
    ref = statistics.median(times["plain"])
    print(
        f"{args.grad_accum} micro-batches per step, median of {args.steps} interleaved steps "
        f"(every variant's gradients close to plain's: {same}):"
    )
    for name, ts in times.items():
        m = statistics.median(ts)
        per = (m - ref) / args.grad_accum
        print(f"  {name:24s} {m * 1e3:9.1f} ms  ({per * 1e3:+.2f} ms per micro-batch)")


if __name__ == "__main__":
    main()
