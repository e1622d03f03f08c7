"""GPU benchmark of the GF(2^16) Reed-Solomon kernels against a device-to-device copy.

One run: (1) checks the Triton kernel against the PyTorch reference on the GPU (encode,
sub-page update, update_pages, decode through ProtectionGroup); (2) sweeps the kernel's
launch parameters (out_block, block_n, num_warps, prefetch) per case: encode (1024
sources) and the per-chunk update at k = 1, 8, 32 pages, D=1024, H1=16, 2 MiB pages (a
2 GiB group), each variant checked against the default kernel; (3) times encode, the
per-chunk update at each k both as CUDA-graph replays of the group's chunk launches
(kernel time) and through the public ``update_pages`` call (eager Python, host
included), and a copy of the same 2 GiB measured in the same run; (4) times the rebuild
of 16 lost data pages of the group (tier 1 in pinned host memory) through the public
``rebuild`` (on the device: syndromes of the survivors, then ``M^-1 R``) and through the
one-pass plan it replaced, and the CPU reference's rate; (5) times the updater's own
path, the syndrome-form fold of ``gf16_syndrome`` through ``update_pages`` (out of place,
eager), for chunks of 32, 128 and 1024 pages, checked against a fresh encode. Prints a
table whose last line is the headline ratio and writes JSON. ``--profile`` runs one encode and one k=32 update only (for ncu).

    python bench/erasure_gpu.py --json $OUT/erasure_gpu.json
    TRITON_INTERPRET=1 python bench/erasure_gpu.py --tiny   # dry run of the script on CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable

import torch

from leto.erasure import ErasureConfig, ProtectionGroup, engine
from leto.erasure.bitslice import mac_pages, plane_masks
from leto.erasure.rs import CauchyCode
from triton_kernels import gf16_mac as k

logger = logging.getLogger(__name__)


def timeit(fn: Callable[[], None], dev: torch.device, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` (CUDA events on the GPU, wall clock on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def rand_bytes(n: int, dev: torch.device) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (n // 4,), dtype=torch.int32, device=dev).view(
        torch.uint8
    )


def check(dev: torch.device, pb: int, d: int, h: int) -> dict[str, bool]:
    """Kernel == reference on random data, and decode/update round trips on the device."""
    cfg = ErasureConfig(page_bytes=pb, data_pages=d, tier1_parity=h, tier2_parity=1)
    data = rand_bytes(d * pb, dev)
    t1 = torch.empty(h * pb, dtype=torch.uint8)
    t2 = torch.empty(pb, dtype=torch.uint8)
    g = ProtectionGroup(cfg, data, t1, t2, backend="triton")
    g.encode_all()
    ref1, ref2 = torch.empty_like(t1), torch.empty_like(t2)
    gc = ProtectionGroup(cfg, data.cpu(), ref1, ref2, backend="torch")
    gc.encode_all()
    res = {"encode": torch.equal(t1, ref1) and torch.equal(t2, ref2)}
    # sub-page update of page 1, bytes [2048, 2048 + 4096)
    lo, n = pb + 2048, min(4096, pb - 2048)
    old = data[lo : lo + n].clone()
    data[lo : lo + n] = rand_bytes(n, dev)
    g.update(1, 2048, old, data[lo : lo + n])
    gc.data[lo : lo + n] = data[lo : lo + n].cpu()
    gc.encode_all()
    res["update"] = torch.equal(t1, ref1) and torch.equal(t2, ref2)
    # update_into on a device copy of tier 1
    par = t1.to(dev)
    old = data[:pb].clone()
    data[:pb] = rand_bytes(pb, dev)
    g.update_into(par, 0, 0, old, data[:pb])
    g.commit_tier1(par)
    gc.data[:pb] = data[:pb].cpu()
    gc.encode_all()
    res["update_into"] = torch.equal(t1, ref1) and torch.equal(t2, ref2)
    # update_pages: 3 whole pages, then a sub-page range of 2 pages as [k, n] views
    par = t1.to(dev)
    old = data[2 * pb : 5 * pb].clone()
    data[2 * pb : 5 * pb] = rand_bytes(3 * pb, dev)
    g.update_pages(par, 2, 3, 0, old, data[2 * pb : 5 * pb])
    pages, hi = data.view(d, pb), min(pb, 6144)
    old = pages[3:5, 2048:hi].clone()
    pages[3:5, 2048:hi] = rand_bytes(2 * (hi - 2048), dev).view(2, -1)
    g.update_pages(par, 3, 2, 2048, old, pages[3:5, 2048:hi])
    g.commit_tier1(par)
    gc.data.copy_(data.cpu())
    gc.encode_all()
    res["update_pages"] = torch.equal(t1, ref1) and torch.equal(t2, ref2)
    # decode h lost data pages, then h-1 data + 1 tier-1 + 1 tier-2
    want = data.clone()
    lost = list(range(0, d, max(1, d // h)))[:h]
    for j in lost:
        data[j * pb : (j + 1) * pb] = 0
    g.rebuild(lost, [], [])
    res["decode"] = torch.equal(data, want)
    want1, want2 = t1.clone(), t2.clone()
    data[:pb] = 0
    t1[:pb] = 0
    t2.zero_()
    g.rebuild([0], [0], [0])
    res["decode_tiers"] = (
        torch.equal(data, want) and torch.equal(t1, want1) and torch.equal(t2, want2)
    )
    return res


def graph_of(fn: Callable[[], None], dev: torch.device) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph (replay), or ``fn`` itself off the GPU."""
    if dev.type != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up / compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        fn()
    return gr.replay


def variants(tiny: bool) -> list[dict[str, int]]:
    shapes = [(1, 256, 2), (1, 512, 4), (2, 512, 4), (2, 256, 2), (2, 128, 1), (4, 256, 4)]
    out = [
        {"out_block": ob, "block_n": bn, "num_warps": nw, "prefetch": pf}
        for ob, bn, nw in shapes
        for pf in (0, 1)
    ]
    return out[:2] if tiny else out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench/results/erasure_gpu.json")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run of the script (interpreter)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="one encode + one k=32 update only")
    ap.add_argument("--tuning", default=None, help="JSON with a 'tuning' table to use")
    ap.add_argument(
        "--no-sweep",
        action="store_true",
        help="time gf16_mac's current TUNING only (no launch sweep)",
    )
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    pb, d, h = (2 << 20, 1024, 16) if not args.tiny else (4096, 8, 4)
    reps = args.reps if not args.tiny else 1
    ks = [kk for kk in (1, 8, 32) if kk <= d] if not args.tiny else [1, 4]
    import triton

    out: dict = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "page_bytes": pb,
        "data_pages": d,
        "tier1": h,
    }
    nbytes = d * pb
    code = CauchyCode(d, h)
    masks = plane_masks(code.coef()).to(dev)
    data, new = rand_bytes(nbytes, dev), rand_bytes(nbytes, dev)
    src, new_w = data.view(torch.int32), new.view(torch.int32)
    src_off = torch.arange(d, dtype=torch.int64, device=dev) * (pb // 4)
    dst_off = torch.arange(h, dtype=torch.int64, device=dev) * (pb // 4)
    n_tiles = pb // 2048
    n_par = 4  # rotate parity scratch buffers so the parity RMW is not served from L2
    pars = [rand_bytes(h * pb, dev) for _ in range(n_par)]

    def enc(par: torch.Tensor, **kw) -> object:
        return k.gf16_mac(
            masks, src, src_off, par.view(torch.int32), dst_off, n_tiles, accumulate=False, **kw
        )

    def upd_chunks(kk: int, **kw) -> Callable[[], object]:
        def run() -> object:
            ck = None
            for c, j0 in enumerate(range(0, d - kk + 1, kk)):
                ck = k.gf16_mac_strided(
                    masks,
                    j0,
                    kk,
                    new_w[j0 * pb // 4 :],
                    pb // 4,
                    pars[c % n_par].view(torch.int32),
                    0,
                    pb // 4,
                    n_tiles,
                    accumulate=True,
                    src2=src[j0 * pb // 4 :],
                    src2_stride=pb // 4,
                    **kw,
                )
            return ck

        return run

    if args.profile:
        if args.tuning:
            with open(args.tuning) as f:
                k.TUNING.update(json.load(f)["tuning"])
        enc(pars[0])
        k.gf16_mac_strided(
            masks,
            0,
            32,
            new_w,
            pb // 4,
            pars[0].view(torch.int32),
            0,
            pb // 4,
            n_tiles,
            accumulate=True,
            src2=src,
            src2_stride=pb // 4,
        )
        torch.cuda.synchronize()
        return

    out["check"] = check(dev, 65536 if not args.tiny else 4096, 16 if not args.tiny else 6, 4)
    print("check kernel == reference:", out["check"], flush=True)
    if not all(out["check"].values()):
        raise SystemExit("kernel disagrees with the reference; numbers would be meaningless")

    dst = torch.empty_like(data)
    t_copy = timeit(lambda: dst.copy_(data), dev, reps)
    copy_rate = 2 * nbytes / t_copy  # bytes read + written per second
    out["copy"] = {
        "seconds": t_copy,
        "GBps": nbytes / t_copy / 1e9,
        "traffic_GBps": copy_rate / 1e9,
    }
    print(
        f"copy {nbytes / 2**30:.2f} GiB: {t_copy * 1e3:.3f} ms = {nbytes / t_copy / 1e9:.0f} "
        f"GB/s ({copy_rate / 1e9:.0f} GB/s read+write)",
        flush=True,
    )

    # reference outputs of the default kernel: every variant must reproduce them
    enc(pars[0])
    want_enc = pars[0].clone()
    base_par = [p.clone() for p in pars]
    want_upd = {}
    for kk in ks:
        for p, b in zip(pars, base_par, strict=True):
            p.copy_(b)
        upd_chunks(kk)()
        want_upd[kk] = [p.clone() for p in pars]

    def moved(kk: int) -> int:
        return 2 * kk * pb + 2 * h * pb

    cases = {"many": ("encode", None)} | {k.bucket(kk): (f"update k={kk}", kk) for kk in ks}
    sweep: dict[str, list] = {b: [] for b in cases}
    for var in [] if args.no_sweep else variants(args.tiny):
        tag = "/".join(str(var[x]) for x in ("out_block", "block_n", "num_warps", "prefetch"))
        for b, (name, kk) in cases.items():
            try:
                if kk is None:
                    fn = lambda var=var: enc(pars[0], **var)
                    ck = fn()
                    regs = [getattr(ck, "n_regs", None), getattr(ck, "n_spills", None)]
                    ok = torch.equal(pars[0], want_enc)
                    t = timeit(fn, dev, max(3, reps // 3))
                    rate = nbytes / t
                else:
                    for p, bp in zip(pars, base_par, strict=True):
                        p.copy_(bp)
                    fn = upd_chunks(kk, **var)
                    ck = fn()
                    regs = [getattr(ck, "n_regs", None), getattr(ck, "n_spills", None)]
                    ok = all(torch.equal(p, w) for p, w in zip(pars, want_upd[kk], strict=True))
                    g = graph_of(fn, dev)
                    t = timeit(g, dev, max(3, reps // 3)) / (d // kk)
                    rate = moved(kk) / t
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is skipped
                print(f"  {name:13s} {tag}: failed {type(e).__name__}: {e}"[:200], flush=True)
                continue
            sweep[b].append(dict(var, seconds=t, ok=ok, vs_copy=rate / copy_rate, regs_spills=regs))
            print(
                f"  {name:13s} {tag:12s} {t * 1e6:10.1f} us  {rate / copy_rate:5.2f}x copy"
                f"  regs/spills {regs}{'' if ok else '  WRONG'}",
                flush=True,
            )
    best = {}
    for b, rows in sweep.items():
        good = [r for r in rows if r["ok"]]
        if good:
            r = min(good, key=lambda r: r["seconds"])
            best[b] = {x: r[x] for x in ("out_block", "block_n", "num_warps", "prefetch")}
    for b in ("1", "few", "mid", "many"):
        if b not in best:  # fill an unswept bucket from its neighbour
            best[b] = best.get("mid") or best.get("many") or dict(k.TUNING[b])
    k.TUNING.update(best)
    out["sweep"], out["tuning"] = sweep, {b: dict(v) for b, v in k.TUNING.items()}
    out["all_variants_exact"] = all(r["ok"] for rows in sweep.values() for r in rows)
    print("tuning:", out["tuning"], flush=True)

    # final numbers with the chosen tuning
    t_enc = timeit(lambda: enc(pars[0]), dev, reps)
    res: dict = {}
    rows = [
        ("copy (baseline)", t_copy, nbytes, 2 * nbytes),
        ("encode (1024 -> 16 pages)", t_enc, nbytes, nbytes + h * pb),
    ]
    cfg = ErasureConfig(page_bytes=pb, data_pages=d, tier1_parity=h, tier2_parity=1)
    pin = dev.type == "cuda"
    t1 = torch.empty(h * pb, dtype=torch.uint8, pin_memory=pin)
    t2 = torch.empty(pb, dtype=torch.uint8, pin_memory=pin)
    grp = ProtectionGroup(cfg, data, t1, t2, backend="triton")
    pages_new, pages_old = new.view(d, pb), data.view(d, pb)
    for kk in ks:
        t_graph = timeit(graph_of(upd_chunks(kk), dev), dev, reps) / (d // kk)
        n_calls = d // kk

        def api(kk: int = kk, n_calls: int = n_calls) -> None:
            for c in range(n_calls):
                grp.update_pages(
                    pars[c % n_par],
                    c * kk,
                    kk,
                    0,
                    pages_old[c * kk : (c + 1) * kk],
                    pages_new[c * kk : (c + 1) * kk],
                )

        api()  # warm-up
        if dev.type == "cuda":
            torch.cuda.synchronize()
        walls, hosts = [], []
        for _ in range(max(3, reps // 3)):
            t0 = time.perf_counter()
            api()
            t_host = time.perf_counter() - t0
            if dev.type == "cuda":
                torch.cuda.synchronize()
            walls.append((time.perf_counter() - t0) / n_calls)
            hosts.append(t_host / n_calls)
        t_api, t_host = statistics.median(walls), statistics.median(hosts)
        res[f"update_k{kk}"] = {
            "kernel_seconds_per_chunk": t_graph,
            "api_seconds_per_chunk": t_api,
            "api_host_seconds_per_call": t_host,
            "moved_bytes_per_chunk": moved(kk),
            "kernel_vs_copy": moved(kk) / t_graph / copy_rate,
            "api_vs_copy": moved(kk) / t_api / copy_rate,
        }
        rows.append((f"update k={kk}, graph replay", t_graph, kk * pb, moved(kk)))
        rows.append((f"update k={kk}, update_pages", t_api, kk * pb, moved(kk)))

    # the updater's path: the syndrome-form working parity on the device, folded out of place
    # per chunk (Q_out = Q_in ^ fold) by the Horner kernel (triton_kernels/gf16_syndrome.py)
    empty = torch.empty(0, dtype=torch.uint8, device=dev)
    syn_cfg = ErasureConfig(page_bytes=pb, data_pages=d, tier1_parity=h, tier2_parity=0)
    q_in, q_out = (torch.empty(h * pb, dtype=torch.uint8, device=dev) for _ in range(2))
    syn = ProtectionGroup(syn_cfg, data, q_in, empty, backend="triton", syndromes=True)
    syn.encode_tier1()
    syn.update_pages(q_out, 0, d, 0, pages_old, pages_new, parity_in=q_in)
    fresh = ProtectionGroup(
        syn_cfg, new, torch.empty_like(q_in), empty, backend="triton", syndromes=True
    )
    out["check"]["syndrome_update_exact"] = torch.equal(q_out, fresh.encode_tier1())
    del fresh
    syn_ks = [kk for kk in (32, 128, 1024) if kk <= d] if not args.tiny else [4]
    for kk in syn_ks:

        def fold(kk: int = kk) -> None:
            for j0 in range(0, d - kk + 1, kk):
                syn.update_pages(
                    q_out,
                    j0,
                    kk,
                    0,
                    pages_old[j0 : j0 + kk],
                    pages_new[j0 : j0 + kk],
                    parity_in=q_in,
                )

        t = timeit(fold, dev, reps) / (d // kk)
        res[f"syndrome_update_k{kk}"] = {
            "seconds_per_chunk": t,
            "moved_bytes_per_chunk": moved(kk),
            "vs_copy": moved(kk) / t / copy_rate,
        }
        rows.append((f"update k={kk}, syndrome form", t, kk * pb, moved(kk)))

    # rebuild 16 lost data pages of the group, tier-1 parity in pinned host memory: the
    # public path (on the device: syndromes of the survivors, then M^-1 R) and, for
    # comparison, the one-pass plan it replaced (a 16 x 1008 composition, then one product)
    grp.encode_all()
    lost = list(range(3, d, max(1, d // h)))[:h]
    want = torch.cat([grp.data_page(j).clone() for j in lost])

    def timed(rebuild: Callable[[], float]) -> tuple[float, float, bool]:
        walls, plans = [], []
        for _ in range(max(4, reps // 2)):
            for j in lost:
                grp.data_page(j).fill_(0xA5)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            plans.append(rebuild())
            if dev.type == "cuda":
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        exact = torch.equal(torch.cat([grp.data_page(j) for j in lost]), want)
        return statistics.median(walls[1:]), statistics.median(plans[1:]), exact

    def one_pass() -> float:
        t0 = time.perf_counter()
        plan = grp.code1.decode_plan(lost, [], present_data=d)
        t_plan = time.perf_counter() - t0
        grp._run_plan_t1(plan)
        return t_plan

    t_reb, t_plan, out["check"]["rebuild_exact"] = timed(
        lambda: grp.rebuild(lost, [], []).plan_seconds
    )
    t_old, t_plan_old, out["check"]["rebuild_one_pass_exact"] = timed(one_pass)
    out["rebuild"] = {
        "wall_seconds": t_reb,
        "plan_seconds": t_plan,
        "one_pass_wall_seconds": t_old,
        "one_pass_plan_seconds": t_plan_old,
    }
    rows.append(("rebuild 16 pages, wall", t_reb, nbytes, nbytes + 2 * h * pb))
    rows.append(("rebuild 16 pages, one-pass plan", t_old, nbytes, nbytes + 2 * h * pb))

    # CPU reference rate (the production path on CPU), 32 pages x 2 MiB -> 16 parity
    cp = min(32, d)
    torch.set_num_threads(max(1, min(16, torch.get_num_threads())))
    cpu_src = [torch.randint(0, 256, (pb,), dtype=torch.uint8) for _ in range(cp)]
    cpu_out = [torch.empty(pb, dtype=torch.uint8) for _ in range(h)]
    t0 = time.perf_counter()
    mac_pages(code.coef(range(cp)), cpu_src, cpu_out, accumulate=False)
    out["cpu_reference_MBps"] = cp * pb / (time.perf_counter() - t0) / 1e6
    out["cpu_threads"] = torch.get_num_threads()

    out["results"] = res
    print(f"\n{'operation':34s} {'ms':>9s} {'data GB/s':>10s} {'moved GB/s':>11s} {'vs copy':>8s}")
    for name, t, data_b, mv in rows:
        ratio = mv / t / copy_rate
        res[name] = {
            "seconds": t,
            "data_GBps": data_b / t / 1e9,
            "moved_GBps": mv / t / 1e9,
            "moved_vs_copy": ratio,
        }
        print(
            f"{name:34s} {t * 1e3:9.4f} {data_b / t / 1e9:10.1f} {mv / t / 1e9:11.1f} {ratio:8.2f}"
        )
    print(
        f"rebuild of 16 pages: {t_reb * 1e3:.2f} ms wall (plan {t_plan * 1e3:.2f}); the one-pass plan "
        f"{t_old * 1e3:.2f} ms (plan {t_plan_old * 1e3:.2f})"
    )
    for kk in ks:
        r = res[f"update_k{kk}"]
        print(
            f"update k={kk}: host per update_pages call {r['api_host_seconds_per_call'] * 1e6:.1f}"
            f" us, kernel {r['kernel_seconds_per_chunk'] * 1e6:.1f} us"
        )
    print(f"CPU reference {out['cpu_reference_MBps']:.1f} MB/s ({out['cpu_threads']} threads)")
    print("checks:", out["check"], "all variants exact:", out["all_variants_exact"])
    head = {kk: res[f"update_k{kk}"]["kernel_vs_copy"] for kk in ks}
    out["headline_update_vs_copy"] = {str(kk): v for kk, v in head.items()}
    syn_head = {kk: res[f"syndrome_update_k{kk}"]["vs_copy"] for kk in syn_ks}
    out["headline_syndrome_update_vs_copy"] = {str(kk): v for kk, v in syn_head.items()}
    out["rebuild_16_pages_seconds"] = t_reb
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    print(
        "headline: update vs copy-bound rate (graph replay) "
        + ", ".join(f"k={kk} {v:.2f}x" for kk, v in head.items())
        + "; the updater's syndrome form (update_pages) "
        + ", ".join(f"k={kk} {v:.2f}x" for kk, v in syn_head.items())
        + f" (goal >= 0.50); rebuild of 16 pages {t_reb * 1e3:.1f} ms wall (goal <= 20)"
    )


if __name__ == "__main__":
    engine.logger.setLevel(logging.WARNING)
    main()
