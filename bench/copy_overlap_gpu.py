"""What a gradient landing's copies add to a backward pass, by the way they are copied.

Leto lands each large gradient in retained memory by one device copy, beside backward
(``leto.trainer.grad_landing``). On one GPU that copy is the steady step's excess over
torch's (issue 21, item 3). This times a stand-in for backward, matrix products on the
compute stream, with a copy of each product's worth of gradient after it, the copies:

* ``none``: the products alone;
* ``same``: on the compute stream (``Tensor.copy_``);
* ``memcpy``: on a side stream, ``Tensor.copy_`` (a device-to-device ``cudaMemcpyAsync``);
* ``kernel``: on a side stream, an elementwise kernel (``torch.mul(src, 1, out=dst)``);
* ``batch``: on a side stream, one ``cuMemcpyBatchAsync`` per copy with the driver's hint to
  overlap it with compute on the SMs (``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``), where
  the installed driver and ``cuda-bindings`` have it.

Each way's time less ``none``'s is what its copies cost the pass; printed beside the copies'
time alone. Rounds alternate the ways; medians.

    python3 bench/copy_overlap_gpu.py [--gb 4.4] [--pieces 146] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics

import torch


def batch_copier(stream: torch.cuda.Stream):
    """A copy through ``cuMemcpyBatchAsync`` with the overlap hint on ``stream``, or the reason
    there is none."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        return None, f"no cuda-bindings ({e})"
    if not hasattr(cu, "cuMemcpyBatchAsync"):
        return None, "cuda-bindings has no cuMemcpyBatchAsync"
    attr = cu.CUmemcpyAttributes()
    attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attr.flags = cu.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    handle = cu.CUstream(stream.cuda_stream)

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        args = ([cu.CUdeviceptr(dst.data_ptr())], [cu.CUdeviceptr(src.data_ptr())], [dst.nbytes])
        args += (1, [attr], [0], 1)
        try:
            result = cu.cuMemcpyBatchAsync(*args, handle)
        except TypeError as e:  # CUDA 12's signature: a failure index before the stream
            if "positional" not in str(e):
                raise
            result = cu.cuMemcpyBatchAsync(*args, 0, handle)
        err = result[0] if isinstance(result, tuple) else result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuMemcpyBatchAsync: {err}")

    return copy, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=4.4, help="gradient bytes a pass, in GB")
    ap.add_argument("--pieces", type=int, default=146)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gemm", type=int, default=2816, help="each product: n x 4n by 4n x n")
    args = ap.parse_args()
    dev = torch.device("cuda")
    per = int(args.gb * 1e9 / 4 / args.pieces)
    src = [torch.randn(per, device=dev) for _ in range(args.pieces)]
    dst = [torch.empty_like(s) for s in src]
    n = args.gemm
    a = torch.randn(n, 4 * n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4 * n, n, device=dev, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    compute = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    batch, why = batch_copier(side)
    ways = {
        "memcpy": lambda d, s: d.copy_(s),
        "kernel": lambda d, s: torch.mul(s, 1, out=d),
    }
    if batch is not None:
        ways["batch"] = batch
    else:
        print(f"batch: not run: {why}")

    def run(way: str | None, on_side: bool) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        for i in range(args.pieces):
            torch.mm(a, b, out=out)
            if way is None:
                continue
            if on_side:
                side.wait_stream(compute)
                with torch.cuda.stream(side):
                    ways[way](dst[i], src[i])
            else:
                ways[way](dst[i], src[i])
        compute.wait_stream(side)
        end.record(compute)
        torch.cuda.synchronize(dev)
        return start.elapsed_time(end)

    def alone(way: str) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(side)
        with torch.cuda.stream(side):
            for d, s in zip(dst, src, strict=True):
                ways[way](d, s)
        end.record(side)
        torch.cuda.synchronize(dev)
        return start.elapsed_time(end)

    plans = {"none": (None, False), "same": ("memcpy", False)}
    plans.update({w: (w, True) for w in ways})
    for name, (way, on_side) in plans.items():  # warm-up
        run(way, on_side)
    times: dict[str, list[float]] = {k: [] for k in plans}
    copies: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds):
        order = list(plans) if r % 2 == 0 else list(reversed(plans))
        for name in order:
            times[name].append(run(*plans[name]))
        for w in ways:
            copies[w].append(alone(w))
    for d, s in zip(dst, src, strict=True):
        assert torch.equal(d, s), "a copy differs from its source"
    base = statistics.median(times["none"])
    gb = 2 * per * 4 * args.pieces / 1e9
    print(
        f"{torch.cuda.get_device_name(dev)}; {args.pieces} copies of {per * 4 / 1e6:.1f} MB "
        f"({gb / 2:.2f} GB) after {args.pieces} products of {n}x{4 * n} by {4 * n}x{n} (bf16)"
    )
    print(f"products alone: {base:.2f} ms")
    for name in plans:
        if name == "none":
            continue
        t = statistics.median(times[name])
        way = plans[name][0]
        alone_ms = statistics.median(copies[way])
        print(
            f"{name:7s}: {t:.2f} ms, the copies add {t - base:.2f} ms "
            f"(alone {alone_ms:.2f} ms, {gb / alone_ms:.2f} TB/s); "
            f"spread {max(times[name]) - min(times[name]):.2f} ms"
        )


if __name__ == "__main__":
    main()
