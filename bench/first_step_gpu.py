"""What a fresh process's first training step pays, and what a shadow's forward replay saves.

Each case is a fresh process that starts as a level-3 shadow would (``import torch``,
``leto.trainer.context.warm_up``: CUDA context, cuBLAS, autocast), then optionally runs the
forward replay of ``leto.preinit.replay`` on a scratch copy of its meta model (``replay``:
the caching allocator's blocks returned afterwards, as the shadow does; ``replay-keep``:
kept), then builds the real model (the GPT of ``bench/recovery_gpu.py``) and times steps
1-4 by phase (forward, backward, clip, torch's fused AdamW; synchronised). The first
step's excess over the fourth is what a promoted trainer pays on top of a steady step.

    python bench/first_step_gpu.py [--small] [--cases none,replay,replay-keep]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = {"vocab": 32000, "dim": 2048, "layers": 20, "heads": 16, "seq": 512, "batch": 4}
SMALL = {"vocab": 256, "dim": 32, "layers": 2, "heads": 2, "seq": 16, "batch": 4}


def child(case: str, model_args: dict[str, int]) -> dict[str, object]:
    import torch

    sys.path.insert(0, str(REPO / "examples"))
    from train_gpt import GPT

    from leto.preinit.replay import ForwardSpec, replay
    from leto.trainer.context import warm_up

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    a = model_args
    warm_up(device)
    with torch.device("meta"):
        meta = GPT(a["vocab"], a["dim"], a["layers"], a["heads"], a["seq"], dropout=0.0)
    x = torch.zeros(a["batch"], a["seq"], dtype=torch.long, device=device)
    out: dict[str, object] = {"case": case}
    if case.startswith("replay"):
        spec = ForwardSpec.of((x, x), {})
        spec = ForwardSpec(
            args=spec.args, kwargs=spec.kwargs, autocast="bfloat16" if cuda else None
        )
        t0 = time.perf_counter()
        replay(meta, spec, device)
        sync()
        out["replay_s"] = time.perf_counter() - t0
        if case == "replay" and cuda:
            torch.cuda.empty_cache()
    model = GPT(a["vocab"], a["dim"], a["layers"], a["heads"], a["seq"], dropout=0.0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    steps = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        data = torch.randint(0, a["vocab"], (a["batch"], a["seq"] + 1), generator=g).to(device)
        sync()
        marks = [time.perf_counter()]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(data[:, :-1], data[:, 1:])
        sync()
        marks.append(time.perf_counter())
        loss.backward()
        sync()
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        sync()
        marks.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync()
        marks.append(time.perf_counter())
        names = ("forward", "backward", "clip", "update")
        steps.append({n: round(1e3 * (marks[i + 1] - marks[i]), 2) for i, n in enumerate(names)})
        steps[-1]["total"] = round(1e3 * (marks[-1] - marks[0]), 2)
    out["steps_ms"] = steps
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="a tiny model: checks the script on CPU")
    p.add_argument("--cases", default="none,replay,replay-keep")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--json", default=str(REPO / "bench/results/first_step_gpu.json"))
    args = p.parse_args()
    model_args = SMALL if args.small else MODEL
    if args.child:
        print(json.dumps(child(args.child, model_args)), flush=True)
        return
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for k, v in (
        ("NCCL_NVLS_ENABLE", "0"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ):
        env.setdefault(k, v)
    results = []
    for case in args.cases.split(","):
        cmd = [sys.executable, __file__, "--child", case, *(["--small"] if args.small else [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"first_step_gpu: case {case} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"model {model_args}")
    print(f"{'case':<12} {'replay s':>8} | first step ms (fwd/bwd/clip/upd) | steady ms | excess")
    for r in results:
        first, steady = r["steps_ms"][0], r["steps_ms"][-1]
        parts = "/".join(f"{first[k]:.0f}" for k in ("forward", "backward", "clip", "update"))
        print(
            f"{r['case']:<12} {r.get('replay_s', 0.0):>8.2f} | {first['total']:>7.1f} ({parts}) "
            f"| {steady['total']:>7.1f} | {first['total'] / steady['total']:.2f}x"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"model": model_args, "results": results}, indent=1))


if __name__ == "__main__":
    main()
