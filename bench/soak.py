"""Cascading-failure soak: SIGKILLs from outside, many inside recovery windows, on CPU.

One leto-run job (the demo GPT, 2 gloo ranks, default flags, ``--max-restarts 0``) and an
outside killer that, after waits drawn from an exponential distribution (seeded), SIGKILLs
the active trainer of a random rank (one kill in ten: both ranks at once). The mean wait
is shorter than a shadow's start-up, so many kills strike a generation that was promoted
moments ago: during its attach, its page rebuild, its first step, or while its
replacement shadows are still starting. Between kills it samples the agent's and the
state manager's open fds and RSS and the bytes under ``/dev/shm``.

The job must finish (exit 0: no group restart, there is none to spare) and every rank's
per-step digest must equal a fault-free run's of the same length. The last line is the
verdict; ``--json`` writes the numbers.

    python bench/soak.py --kills 100 --mean-s 3 [--json bench/results/soak_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from leto.events import read_events

MODEL = ["--dim", "32", "--layers", "2", "--seq", "16", "--batch", "4"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _command(events: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "leto_run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--no-dashboard",
        "--digest",
        "--events",
        str(events),
        str(REPO / "examples/train_gpt.py"),
        "--steps",
        str(steps),
        *MODEL,
    ]


def _digests(events: list[dict]) -> dict[tuple[int, int], set[str]]:
    out: dict[tuple[int, int], set[str]] = defaultdict(set)
    for e in events:
        if e["kind"] == "digest":
            out[(e["rank"], e["step"])].add(e["digest"])
    return out


def _tail(path: Path, offset: int) -> tuple[list[dict], int]:
    """Events appended since ``offset`` (whole lines only)."""
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    lines = data[:end].decode().splitlines()
    return [json.loads(line) for line in lines if line.strip()], offset + end


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _fds_rss(pid: int) -> tuple[int, int]:
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return fds, rss << 10
    except (OSError, StopIteration):
        return -1, -1


def _shm_bytes() -> int:
    total = 0
    for root, _, files in os.walk("/dev/shm"):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def soak(tmp: Path, steps: int, kills: int, mean_s: float, seed: int, both_every: int) -> dict:
    events_path = tmp / "soak.jsonl"
    proc = subprocess.Popen(
        _command(events_path, steps),
        env=_env(),
        cwd=tmp,
        stdout=subprocess.DEVNULL,
        stderr=(tmp / "soak.err").open("w"),
    )
    rng = random.Random(seed)
    pids: dict[tuple[int, int], int] = {}  # (gen, rank) -> pid
    gen, offset, fired, samples = 0, 0, 0, []
    sm_pid = None
    next_kill = time.monotonic() + 15 + rng.expovariate(1 / mean_s)  # once the first shadows exist
    while proc.poll() is None:
        new, offset = _tail(events_path, offset)
        for e in new:
            if e["kind"] == "trainer_started":
                pids[(e["gen"], e["rank"])] = e["pid"]
            elif e["kind"] == "shadows_promoted":
                gen = e["gen"]
        if sm_pid is None or not os.path.exists(f"/proc/{sm_pid}"):
            sm_pid = next(
                (c for c in _children(proc.pid) if "leto.pool.server" in _cmdline(c)), None
            )
        if fired < kills and time.monotonic() >= next_kill:
            ranks = [0, 1] if rng.randrange(both_every) == 0 else [rng.randrange(2)]
            targets = [pids[(gen, r)] for r in ranks if (gen, r) in pids]
            for pid in targets:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if targets:
                fired += 1
                agent = _fds_rss(proc.pid)
                sm = _fds_rss(sm_pid) if sm_pid else (-1, -1)
                samples.append(
                    {
                        "kill": fired,
                        "gen": gen,
                        "ranks": ranks,
                        "agent_fds": agent[0],
                        "agent_rss": agent[1],
                        "sm_fds": sm[0],
                        "sm_rss": sm[1],
                        "shm_bytes": _shm_bytes(),
                    }
                )
            next_kill = time.monotonic() + rng.expovariate(1 / mean_s)
        time.sleep(0.01)
    events = read_events(events_path)
    return {"returncode": proc.returncode, "kills": fired, "events": events, "samples": samples}


def _calibrated_steps(tmp: Path, kill_s: float, probe_steps: int = 200) -> int:
    """Steps that keep the job running through the kills: the step rate of a short
    fault-free probe (start-up excluded), times the kills' expected duration, half again for
    the recoveries."""
    (tmp / "probe").mkdir()
    subprocess.run(
        _command(tmp / "probe" / "p.jsonl", probe_steps),
        env=_env(),
        cwd=tmp / "probe",
        capture_output=True,
        check=True,
    )
    done = [
        e["t"]
        for e in read_events(tmp / "probe" / "p.jsonl")
        if e["kind"] == "step_done" and e["rank"] == 0
    ]
    rate = (len(done) - 1) / max(1e-3, done[-1] - done[0])
    return int(rate * kill_s * 1.5) + 100


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--kills", type=int, default=100)
    p.add_argument(
        "--mean-s", type=float, default=3.0, help="mean wait between kills (exponential)"
    )
    p.add_argument(
        "--steps", type=int, default=0, help="training steps (default: enough for the kills)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--both-every", type=int, default=10, help="1 kill in N takes both ranks")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="leto-soak-") as d:
        tmp = Path(d)
        (tmp / "ref").mkdir()
        steps = args.steps or _calibrated_steps(tmp, args.kills * args.mean_s)
        t0 = time.monotonic()
        ref = subprocess.run(
            _command(tmp / "ref" / "ref.jsonl", steps),
            env=_env(),
            cwd=tmp / "ref",
            capture_output=True,
            text=True,
            check=False,
        )
        ref_s = time.monotonic() - t0
        if ref.returncode != 0:
            sys.exit(f"the fault-free run failed: {ref.stderr[-2000:]}")
        reference = _digests(read_events(tmp / "ref" / "ref.jsonl"))
        t0 = time.monotonic()
        run = soak(tmp, steps, args.kills, args.mean_s, args.seed, args.both_every)
        soak_s = time.monotonic() - t0
        err = (tmp / "soak.err").read_text()[-3000:]
    events = run["events"]
    got = _digests(events)
    missing = sorted(set(reference) - set(got))
    mismatched = sorted(k for k, v in got.items() if v != reference.get(k))
    kinds = defaultdict(int)
    for e in events:
        kinds[e["kind"]] += 1
    promoted = [e for e in events if e["kind"] == "shadows_promoted"]
    failures = [e for e in events if e["kind"] == "failure_detected"]
    in_window = sum(1 for e in failures if e.get("in_a_row", 1) > 1)
    samples = run["samples"]
    half = samples[len(samples) // 2 :] or samples

    def spread(key: str) -> str:
        values = [s[key] for s in samples if s[key] >= 0]
        late = [s[key] for s in half if s[key] >= 0]
        return (
            f"{min(values)}..{max(values)} (second half {min(late)}..{max(late)})"
            if values
            else "n/a"
        )

    print(
        f"steps {steps}, fault-free run {ref_s:.0f} s, soak {soak_s:.0f} s, seed {args.seed}, mean wait "
        f"{args.mean_s} s"
    )
    print(
        f"kills fired {run['kills']}, failures detected {len(failures)}, in-place recoveries {len(promoted)} "
        f"(cold {sum(e.get('cold', False) for e in promoted)}), group restarts {kinds['group_restart']}"
    )
    print(f"failures that struck a generation before its first step: {in_window}")
    for key in ("agent_fds", "sm_fds", "agent_rss", "sm_rss", "shm_bytes"):
        print(f"  {key:10s} {spread(key)}")
    print(f"digests: {len(got)} compared, {len(missing)} missing, {len(mismatched)} mismatched")
    ok = run["returncode"] == 0 and not missing and not mismatched and kinds["group_restart"] == 0
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "steps": steps,
                    "kills": run["kills"],
                    "mean_s": args.mean_s,
                    "seed": args.seed,
                    "returncode": run["returncode"],
                    "failures": len(failures),
                    "recoveries": len(promoted),
                    "before_first_step": in_window,
                    "group_restarts": kinds["group_restart"],
                    "missing": len(missing),
                    "mismatched": len(mismatched),
                    "samples": samples,
                    "ref_s": ref_s,
                    "soak_s": soak_s,
                },
                indent=1,
            )
        )
    if not ok:
        print(err, file=sys.stderr)
    print(
        f"{'OK' if ok else 'FAILED'}: {run['kills']} kills, job exit {run['returncode']}, "
        f"{len(mismatched) + len(missing)} digest mismatches"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
