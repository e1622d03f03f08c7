"""First rebuild and first resumed update in a promoted trainer, with and without the
shadow's kernel warm-up (``leto.preinit.warmup``; issues 3 and 5).

Two leto-run jobs of the GPU erasure test's model (~13M parameters, D=32 two-MiB pages,
H1=16, H2=1, fused RMU update), each with its own empty Triton cache (``TRITON_CACHE_DIR``,
so nothing is compiled before the job): a kill in backward at step ``--kill1`` losing 16
device pages per group and a host parity page, then a kill inside the update at step
``--kill2`` losing 16 device pages per group (rebuilt from the working parity, then the
update resumes). Both runs must equal a fault-free run bit for bit. Printed per promoted
trainer: whether its shadow had warmed (and was ready) before the failure, rebuild seconds,
the resume decision + resumed update seconds, the first step after promotion. The last line
is the headline: the first rebuild without / with the warm-up.

    python bench/kernel_warmup_gpu.py [--steps 300 --kill1 100 --kill2 200] [--only warm|cold]

Numbers go to ``$OUT/kernel_warmup_gpu.json`` when ``OUT`` is set, else bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from leto.config import FaultSpec
from tests.launcher.harness import assert_exact, fault_free_digests, run_leto

MODEL = ["--dim", "512", "--layers", "4", "--heads", "8", "--seq", "128", "--batch", "8", "--bf16"]
ERASURE = {"page_bytes": 2 << 20, "data_pages": 32, "tier1_parity": 16, "tier2_parity": 1}


def _job(tmp: Path, warm: bool, args: argparse.Namespace, faults: list[FaultSpec]) -> list[dict]:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(
        prefix="triton-", dir=tmp
    )  # nothing compiled before
    leto = {"erasure": ERASURE, "preinit": {"warm_kernels": warm}}
    proc, events = run_leto(
        tmp, steps=args.steps, model_args=MODEL, faults=faults, leto=leto, timeout_s=600
    )
    if proc.returncode:
        sys.exit(f"leto-run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return events


def _rows(events: list[dict]) -> list[dict]:
    """One row per promoted trainer (rank, generation)."""
    failures = [e["t"] for e in events if e["kind"] == "failure_detected"]
    rows = []
    for p in (e for e in events if e["kind"] == "promoted"):
        rank, gen = p["rank"], p["gen"]

        def one(kind: str, rank: int = rank, gen: int = gen) -> dict | None:
            return next(
                (
                    e
                    for e in events
                    if e["kind"] == kind and e.get("rank") == rank and e.get("gen") == gen
                ),
                None,
            )

        warmed, ready, rebuilt, resumed = (
            one("kernels_warmed"),
            one("shadow_ready"),
            one("pages_rebuilt"),
            one("resumed"),
        )
        fail_t = max((t for t in failures if t <= p["t"]), default=None)
        first = next(
            (
                e
                for e in events
                if e["kind"] == "step_done"
                and e["rank"] == rank
                and e["t"] > p["t"]
                and not e.get("finished_in_recovery")
            ),
            None,
        )
        rows.append(
            {
                "rank": rank,
                "gen": gen,
                "warm_up_s": warmed.get("seconds") if warmed and warmed["ran"] else None,
                "warmed_before_failure": bool(
                    warmed and warmed["ran"] and fail_t and warmed["t"] < fail_t
                ),
                "ready_before_failure": bool(ready and fail_t and ready["t"] < fail_t),
                "rebuild_s": rebuilt["rebuild_s"] if rebuilt else None,
                "resume_s": resumed["decide_s"] if resumed else None,
                "action": resumed["action"] if resumed else None,
                "first_step_s": first["iter_s"] if first else None,
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kill1", type=int, default=100, help="step of the kill in backward")
    ap.add_argument("--kill2", type=int, default=200, help="step of the kill inside the update")
    ap.add_argument("--only", choices=["warm", "cold"], help="run one variant (default: both)")
    args = ap.parse_args()
    faults = [
        FaultSpec(
            rank=1, step=args.kill1, phase="backward", erase_device_pages=16, erase_host_pages=1
        ),
        FaultSpec(rank=1, step=args.kill2, phase="update", erase_device_pages=16),
    ]
    out = Path(os.environ.get("OUT") or REPO / "bench" / "results")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "ref").mkdir()
        ref = fault_free_digests(
            tmp / "ref",
            steps=args.steps,
            model_args=MODEL,
            leto={"erasure": ERASURE, "preinit": {"warm_kernels": False}},
            timeout_s=600,
        )
        result: dict[str, list[dict]] = {}
        for name in ("cold", "warm") if args.only is None else (args.only,):
            (tmp / name).mkdir()
            events = _job(tmp / name, name == "warm", args, faults)
            assert_exact(ref, events)
            result[name] = _rows(events)
    print(
        f"{'variant':8} {'rank':>4} {'gen':>3} {'warm-up s':>9} {'warmed<fail':>11} {'rebuild s':>9} "
        f"{'resume s':>8} {'action':>15} {'1st step s':>10}"
    )
    for name, rows in result.items():
        for r in rows:
            print(
                f"{name:8} {r['rank']:>4} {r['gen']:>3} {r['warm_up_s'] or 0:>9.3f} {r['warmed_before_failure']!s:>11} "
                f"{r['rebuild_s'] or 0:>9.3f} {r['resume_s'] or 0:>8.3f} {r['action']!s:>15} {r['first_step_s'] or 0:>10.3f}"
            )
    (out / "kernel_warmup_gpu.json").write_text(
        json.dumps({"args": vars(args), "runs": result}, indent=1)
    )
    print("both runs bit-identical to the fault-free run")
    if len(result) == 2:
        first = {
            n: next(r["rebuild_s"] for r in rows if (r["rank"], r["gen"]) == (1, 1))
            for n, rows in result.items()
        }
        print(
            f"first rebuild (rank 1, gen 1): {first['cold']:.3f} s cold vs {first['warm']:.3f} s warmed "
            f"= {first['cold'] / first['warm']:.1f}x"
        )


if __name__ == "__main__":
    main()
