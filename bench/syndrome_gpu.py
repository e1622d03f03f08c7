"""The RMU's per-chunk parity fold: generic GF(2^16) kernel vs the Horner syndrome kernel.

One protection group of D = 1024 two-MiB pages (2 GiB) with H1 = 16, on one GPU. For chunk
lengths k it times the fold of every chunk of the group (CUDA events, eager calls as the
updater makes them) through the public ``ProtectionGroup.update_pages``:

* ``generic``: the parity-form group (``gf16_mac``: a 16x16 GF(2) product per page and
  parity page), in place: the baseline;
* ``syndrome``: the syndrome-form group (``gf16_syndrome``: Horner in fixed constants),
  in place and out of place (reads Q[sel], writes Q[1-sel]: the updater's default fold).

"vs copy" is the rate for the bytes a fold must move (``2 k`` data pages + ``2 H1`` parity
ranges) over the read+write rate of a device copy of the group measured in the same run.
Also: the load / flush conversions (``syndromes_of`` / ``parity_of``) per group, and checks
that the syndrome kernel equals the generic kernel on the same matrix (on the GPU, 2 GiB)
and the PyTorch reference (small). Exits non-zero if a check fails.

    python3 bench/syndrome_gpu.py --json $OUT/syndrome_gpu.json
    python3 bench/syndrome_gpu.py --tiny          # CPU dry run (Triton interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


KEYS = ("block", "num_warps", "acc")
DEFAULT = (64, 2, 8)
"""``gf16_syndrome.TUNING``: halves, one column per thread, two warps."""
SWEEP = (DEFAULT, (32, 1, 8), (32, 1, 4), (64, 2, 4), (128, 4, 8), (256, 8, 8))
"""Launch shapes of the kernel as it is. The kernel's earlier forms and options were swept
before (BENCHMARKS.md, 2026-12-01); what won is now the kernel, see the docstring of
``triton_kernels/gf16_syndrome.py``."""
DIAG = (DEFAULT,)
"""Variants also timed with ``--diag`` (loads and one XOR, no multiply)."""
SWEEP_KS = (4, 32, 128, 1024)


def fmt(v: tuple) -> str:
    return "x".join(str(x) for x in v)


def fold_run(
    gf16_syndrome,
    sc,
    d: int,
    kk: int,
    pb: int,
    h: int,
    new,
    old,
    q_in,
    q_out,
    v: tuple,
    math: bool = True,
    rows_from: int | None = None,
) -> None:
    """Fold the group's chunks of ``kk`` pages out of place (``q_out = q_in ^ fold``) with
    launch shape ``v``, on the code's rows (``rows_from``: a code whose syndrome 0 is that
    row; ``sc`` must be its scale table)."""
    from leto.erasure.bitslice import TILE_BYTES
    from leto.erasure.rs import first_row

    for j0 in range(0, d - kk + 1, kk):
        gf16_syndrome.syndrome_update(
            sc,
            first_row(h) if rows_from is None else rows_from,
            j0,
            kk,
            new.view(torch.int32)[j0 * pb // 4 :],
            pb // 4,
            old.view(torch.int32)[j0 * pb // 4 :],
            pb // 4,
            q_in.view(torch.int32),
            q_out.view(torch.int32),
            0,
            pb // 4,
            h,
            pb // TILE_BYTES,
            **dict(zip(KEYS, v)),
            math=math,
        )


def warm(variant: str, diag: bool) -> None:
    """Compile one launch shape at the benchmark's sizes (a 2-page fold), to fill Triton's
    cache from a parallel process before the timed run (``--warm 32x1x8``)."""
    from leto.erasure.engine import scale_table
    from leto.erasure.rs import first_row
    from triton_kernels import gf16_syndrome

    v = tuple(int(x) for x in variant.split("x"))
    pb, d, h, dev = 2 << 20, 1024, 16, torch.device("cuda")
    bufs = [
        torch.zeros(n // 4, dtype=torch.int32, device=dev) for n in (2 * pb, 2 * pb, h * pb, h * pb)
    ]
    sc = scale_table(d, first_row(h), dev)
    for math in (True, False) if diag else (True,):
        fold_run(gf16_syndrome, sc, 2, 2, pb, h, bufs[0], bufs[1], bufs[2], bufs[3], v, math)
    torch.cuda.synchronize()


def rows_ab(gf16_syndrome, ks, d, pb, h, new, old, q, dev, reps, copy_rate) -> list[dict]:
    """The fold on the rows 0 .. H-1 (``first_row`` 0) against the code's centred rows, same
    launches otherwise; each pair's order alternates from rep to rep."""
    from bench.erasure_gpu import timeit
    from leto.erasure.engine import scale_table
    from leto.erasure.rs import first_row

    out = []
    for kk in ks:
        times: dict[int, list[float]] = {0: [], first_row(h): []}
        for rep in range(max(reps, 3)):
            for b in sorted(times, reverse=bool(rep % 2)):
                sc = scale_table(d, b, dev)
                run = lambda sc=sc, b=b, kk=kk: fold_run(
                    gf16_syndrome, sc, d, kk, pb, h, new, old, q[0], q[1], DEFAULT, True, b
                )
                times[b].append(timeit(run, dev, 1, warmup=1) / (d // kk))
        moved = 2 * kk * pb + 2 * h * pb
        for b, ts in times.items():
            t = sorted(ts)[len(ts) // 2]
            row = {
                "k": kk,
                "first_row": b,
                "us_per_page": 1e6 * t / kk,
                "vs_copy": moved / t / copy_rate,
            }
            out.append(row)
            print(
                f"rows from {b:3d}, k={kk:5d}: {row['us_per_page']:7.3f} us/page "
                f"{row['vs_copy']:5.2f}x copy",
                flush=True,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU dry run in Triton's interpreter")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time the launch shapes of SWEEP at the --sweep-ks run lengths",
    )
    ap.add_argument(
        "--diag",
        action="store_true",
        help="also time the kernel without its multiplications (loads alone) per launch shape",
    )
    ap.add_argument(
        "--ks", default=None, help="comma-separated chunk lengths (default 1,8,32,64,1024)"
    )
    ap.add_argument(
        "--sweep-ks",
        default=None,
        help="comma-separated chunk lengths of the sweep (default 4,32,128,1024)",
    )
    ap.add_argument(
        "--syndrome-min-pages",
        type=int,
        default=None,
        help="fold runs of at least this many pages with the Horner kernel (default: leto.erasure.engine's)",
    )
    ap.add_argument(
        "--rows-ab",
        action="store_true",
        help="also time, per --ks length, the kernel on the rows 0 .. H-1 against the code's "
        "centred rows (direct launches, default shape, interleaved)",
    )
    ap.add_argument(
        "--ncu", action="store_true", help="one k=128 syndrome fold and exit (run under ncu)"
    )
    ap.add_argument(
        "--warm", default=None, help="compile one launch shape (BLOCKxWARPSxACC) and exit"
    )
    args = ap.parse_args()
    if args.warm:
        return warm(args.warm, args.diag)
    if args.syndrome_min_pages is not None:
        import leto.erasure.engine as erasure_engine

        erasure_engine.SYNDROME_MIN_PAGES = args.syndrome_min_pages
    sweep_ks = tuple(int(x) for x in args.sweep_ks.split(",")) if args.sweep_ks else SWEEP_KS
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from bench.erasure_gpu import timeit
    from leto.erasure import ErasureConfig, ProtectionGroup
    from leto.erasure.bitslice import TILE_BYTES, mac_pages, plane_masks
    from leto.erasure.engine import scale_table
    from leto.erasure.rs import first_row
    from triton_kernels import gf16_syndrome

    cuda = torch.cuda.is_available() and not args.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    pb, d, h = (2 << 20, 1024, 16) if not args.tiny else (TILE_BYTES, 16, 16)
    ks = (1, 8, 32, 64, 1024) if not args.tiny else (1, 4)
    if args.ks:
        ks = tuple(int(x) for x in args.ks.split(","))
    reps = args.reps if not args.tiny else 1
    cfg = ErasureConfig(page_bytes=pb, data_pages=d, tier1_parity=h, tier2_parity=0)
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(n: int) -> torch.Tensor:
        return torch.randint(
            -(2**31), 2**31 - 1, (n // 4,), dtype=torch.int32, device=dev, generator=gen
        ).view(torch.uint8)

    data, new = rnd(d * pb), rnd(d * pb)
    empty = torch.empty(0, dtype=torch.uint8, device=dev)
    q = [rnd(h * pb) for _ in range(2)]
    parity_form = ProtectionGroup(cfg, data, q[0], empty, backend="triton")
    syn = ProtectionGroup(cfg, data, q[0], empty, backend="triton", syndromes=True)
    out: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "page_bytes": pb,
        "data_pages": d,
        "tier1": h,
        "date": time.strftime("%Y-%m-%d"),
    }

    if args.ncu:
        kk = min(128, d)
        syn.update_pages(
            q[1], 0, kk, 0, data.view(d, pb)[:kk], new.view(d, pb)[:kk], parity_in=q[0]
        )
        if cuda:
            torch.cuda.synchronize()
        return
    # checks: kernel == generic kernel on the syndrome matrix (big), == PyTorch reference (small)
    start = q[0].clone()
    syn.update_pages(q[0], 0, d, 0, data.view(d, pb), new.view(d, pb))
    got = q[0].clone()
    q[0].copy_(start)
    masks = plane_masks(syn.code1.coef()).to(dev)
    from triton_kernels.gf16_mac import gf16_mac_strided

    gf16_mac_strided(
        masks,
        0,
        d,
        new.view(torch.int32),
        pb // 4,
        q[0].view(torch.int32),
        0,
        pb // 4,
        pb // TILE_BYTES,
        accumulate=True,
        src2=data.view(torch.int32),
        src2_stride=pb // 4,
    )
    checks = {"syndrome_equals_generic_kernel": bool(torch.equal(got, q[0]))}
    sd, sh, sk = 40, 16, 5
    small_cfg = ErasureConfig(
        page_bytes=2 * TILE_BYTES, data_pages=sd, tier1_parity=sh, tier2_parity=0
    )
    sdata, snew, sq = rnd(sk * 2 * TILE_BYTES), rnd(sk * 2 * TILE_BYTES), rnd(sh * 2 * TILE_BYTES)
    sg = ProtectionGroup(
        small_cfg,
        torch.zeros(sd * 2 * TILE_BYTES, dtype=torch.uint8, device=dev),
        sq.clone(),
        empty,
        backend="triton",
        syndromes=True,
    )
    ref = sq.cpu().clone()
    n = 2 * TILE_BYTES
    mac_pages(
        [row[7 : 7 + sk] for row in sg.code1.coef()],
        [snew.cpu()[i * n : (i + 1) * n] for i in range(sk)],
        [ref[p * n : (p + 1) * n] for p in range(sh)],
        accumulate=True,
        srcs_xor=[sdata.cpu()[i * n : (i + 1) * n] for i in range(sk)],
    )
    sout = torch.empty_like(sq)
    sg.update_pages(sout, 7, sk, 0, sdata, snew, parity_in=sq)
    checks["syndrome_equals_reference"] = bool(torch.equal(sout.cpu(), ref))
    p_of = torch.empty_like(q[0])
    syn.parity_of(q[0], p_of)
    back = torch.empty_like(q[0])
    syn.syndromes_of(p_of, back)
    checks["conversions_round_trip"] = bool(torch.equal(back, q[0]))
    out["checks"] = checks
    print("checks:", checks, flush=True)
    if not all(checks.values()):
        raise SystemExit("syndrome_gpu: a check failed; the timings would be meaningless")

    dst = torch.empty_like(data)
    t_copy = timeit(lambda: dst.copy_(data), dev, reps, warmup=1)
    copy_rate = 2 * d * pb / t_copy
    out["copy"] = {"ms": 1e3 * t_copy, "traffic_GBps": copy_rate / 1e9}
    print(
        f"copy {d * pb / 2**30:.2f} GiB: {1e3 * t_copy:.3f} ms ({copy_rate / 1e9:.0f} GB/s read+write)",
        flush=True,
    )
    pages_old, pages_new = data.view(d, pb), new.view(d, pb)
    rows = []
    for kk in ks:
        chunks = list(range(0, d - kk + 1, kk))

        def fold(
            group: ProtectionGroup, out_of_place: bool, kk: int = kk, chunks: list = chunks
        ) -> None:
            for j0 in chunks:
                if out_of_place:
                    group.update_pages(
                        q[1],
                        j0,
                        kk,
                        0,
                        pages_old[j0 : j0 + kk],
                        pages_new[j0 : j0 + kk],
                        parity_in=q[0],
                    )
                else:
                    group.update_pages(
                        q[0], j0, kk, 0, pages_old[j0 : j0 + kk], pages_new[j0 : j0 + kk]
                    )

        moved = 2 * kk * pb + 2 * h * pb
        for name, group, oop in (
            ("generic", parity_form, False),
            ("syndrome", syn, False),
            ("syndrome, out of place", syn, True),
        ):
            t = timeit(lambda g=group, o=oop: fold(g, o), dev, reps, warmup=1) / len(chunks)
            row = {
                "k": kk,
                "kernel": name,
                "us_per_chunk": 1e6 * t,
                "group_ms": 1e3 * t * len(chunks),
                "vs_copy": moved / t / copy_rate,
            }
            rows.append(row)
            print(
                f"k={kk:5d} {name:24s} {1e6 * t:10.1f} us/chunk  group {1e3 * t * len(chunks):8.2f} ms  "
                f"{row['vs_copy']:5.2f}x copy",
                flush=True,
            )
    out["folds"] = rows
    if args.rows_ab:
        out["rows_ab"] = rows_ab(gf16_syndrome, ks, d, pb, h, new, data, q, dev, reps, copy_rate)
    if args.sweep or args.diag:
        sc = scale_table(d, first_row(h), dev)
        sweep, want = [], {}
        variants = [
            (v, m)
            for v in (SWEEP if args.sweep else (DEFAULT,))
            for m in ((True, False) if args.diag and v in DIAG else (True,))
        ]
        for v, math in variants:
            for kk in sweep_ks if d >= max(sweep_ks) else (min(4, d),):

                def run(v: tuple = v, math: bool = math, kk: int = kk) -> None:
                    fold_run(gf16_syndrome, sc, d, kk, pb, h, new, data, q[0], q[1], v, math)

                try:
                    run()
                    ok = not math or kk not in want or torch.equal(q[1], want[kk])
                    if math and kk not in want:
                        want[kk] = q[1].clone()
                    t = timeit(run, dev, min(reps, 3), warmup=1) / (d // kk)
                except Exception as e:  # noqa: BLE001 - a shape that does not compile is reported
                    print(f"sweep {fmt(v)}: failed {type(e).__name__}: {str(e)[:160]}", flush=True)
                    break
                moved = 2 * kk * pb + 2 * h * pb
                row = {
                    "variant": dict(zip(KEYS, v)),
                    "math": math,
                    "k": kk,
                    "us_per_chunk": 1e6 * t,
                    "us_per_page": 1e6 * t / kk,
                    "vs_copy": moved / t / copy_rate,
                    "ok": ok,
                }
                sweep.append(row)
                print(
                    f"sweep {fmt(v)} {'full' if math else 'loads only'} k={kk:5d}: {1e6 * t / kk:7.2f} us/page "
                    f"{row['vs_copy']:5.2f}x copy{'' if ok else '  WRONG'}",
                    flush=True,
                )
        out["sweep"] = sweep
        if not all(r["ok"] for r in sweep):
            print("sweep: a variant's syndromes differ from the first variant's", flush=True)
    t_to = timeit(lambda: syn.syndromes_of(p_of, back), dev, reps, warmup=1)
    t_from = timeit(lambda: syn.parity_of(q[0], p_of), dev, reps, warmup=1)
    out["conversions_ms"] = {"syndromes_of": 1e3 * t_to, "parity_of": 1e3 * t_from}
    print(
        f"conversions per group: syndromes_of {1e3 * t_to:.3f} ms, parity_of {1e3 * t_from:.3f} ms",
        flush=True,
    )
    if cuda:
        ck = gf16_syndrome._syndrome_kernel
        try:
            compiled = next(iter(ck.device_caches[torch.cuda.current_device()][0].values()))
            ptx = compiled.asm.get("ptx", "")
            out["syndrome_kernel"] = {
                "n_regs": compiled.n_regs,
                "n_spills": compiled.n_spills,
                **{
                    f"ptx_{op}": ptx.count(op)
                    for op in ("xor.b32", "shfl", "bar.sync", "ld.local", "st.local", "ld.global")
                },
            }
            print("syndrome kernel:", out["syndrome_kernel"], flush=True)
        except Exception as e:  # noqa: BLE001 - the registers are a note, not a result
            print(f"syndrome kernel registers unavailable: {e}", flush=True)
    if args.tiny and args.json is None:  # a dry run leaves the recorded result alone
        return
    path = args.json or (
        Path(os.environ["OUT"]) / "syndrome_gpu.json"
        if os.environ.get("OUT")
        else REPO / "bench" / "results" / "syndrome_gpu.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"json {path}")


if __name__ == "__main__":
    main()
