"""What a fresh process's first training step pays, and what a shadow's forward replay saves.

Each case is a fresh process that starts as a level-3 shadow would (``import torch``,
``leto.trainer.context.warm_up``: CUDA context, cuBLAS, autocast), then optionally runs the
forward replay of ``leto.preinit.replay`` on a scratch copy of its meta model (``replay``:
the caching allocator's blocks returned afterwards, as the shadow does; ``replay-keep``:
kept), then builds the real model (the GPT of ``bench/recovery_gpu.py``, or with
``--model hf-llama`` its transformers ``LlamaForCausalLM``) and times steps
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
LLAMA = {**MODEL, "layers": 14, "kv_heads": 8, "ffn": 5632}
"""``--model hf-llama``: the 0.8 B ``LlamaForCausalLM`` of ``bench/recovery_gpu.py --model hf-llama``."""


def make_model(name: str, a: dict[str, int]) -> tuple[object, object]:
    """(build() -> module on the current default device, loss(module, tokens) -> loss)."""
    sys.path.insert(0, str(REPO / "examples"))
    if name == "gpt":
        from train_gpt import GPT

        def build() -> object:
            return GPT(a["vocab"], a["dim"], a["layers"], a["heads"], a["seq"], dropout=0.0)

        return build, lambda m, data: m(data[:, :-1], data[:, 1:])
    from train_hf_llama import build as build_llama

    ns = argparse.Namespace(**{"kv_heads": 0, "ffn": 0, **a, "dropout": 0.0, "seed": 0})
    return (
        lambda: build_llama(ns)
    ), lambda m, data: m(input_ids=data[:, 1:], labels=data[:, 1:]).loss


def child(case: str, model_args: dict[str, int], model_name: str) -> dict[str, object]:
    import torch

    from leto.preinit.replay import ForwardSpec, replay
    from leto.trainer.context import warm_up

    build, loss_of = make_model(model_name, model_args)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    a = model_args
    warm_up(device)
    with torch.device("meta"):
        meta = build()
    x = torch.zeros(a["batch"], a["seq"], dtype=torch.long, device=device)
    out: dict[str, object] = {"case": case}
    if case.startswith("replay"):
        spec = (
            ForwardSpec.of((x, x), {})
            if model_name == "gpt"
            else ForwardSpec.of((), {"input_ids": x, "labels": x})
        )
        spec = ForwardSpec(
            args=spec.args, kwargs=spec.kwargs, autocast="bfloat16" if cuda else None
        )
        t0 = time.perf_counter()
        replay(meta, spec, device)
        sync()
        out["replay_s"] = time.perf_counter() - t0
        if case == "replay" and cuda:
            torch.cuda.empty_cache()
    with device:
        model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    steps = []
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        data = torch.randint(0, a["vocab"], (a["batch"], a["seq"] + 1), generator=g).to(device)
        sync()
        marks = [time.perf_counter()]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = loss_of(model, data)
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
    p.add_argument("--model", choices=("gpt", "hf-llama"), default="gpt")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--json", default=str(REPO / "bench/results/first_step_gpu.json"))
    args = p.parse_args()
    model_args = SMALL if args.small else (LLAMA if args.model == "hf-llama" else MODEL)
    if args.child:
        print(json.dumps(child(args.child, model_args, args.model)), flush=True)
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
        cmd = [sys.executable, __file__, "--child", case, "--model", args.model]
        cmd += ["--small"] if args.small else []
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"first_step_gpu: case {case} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"model {args.model} {model_args}")
    print(f"{'case':<12} {'replay s':>8} | first step ms (fwd/bwd/clip/upd) | steady ms | excess")
    for r in results:
        first, steady = r["steps_ms"][0], r["steps_ms"][-1]
        parts = "/".join(f"{first[k]:.0f}" for k in ("forward", "backward", "clip", "update"))
        print(
            f"{r['case']:<12} {r.get('replay_s', 0.0):>8.2f} | {first['total']:>7.1f} ({parts}) "
            f"| {steady['total']:>7.1f} | {first['total'] / steady['total']:.2f}x"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    result = {"model": args.model, "sizes": model_args, "results": results}
    Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
