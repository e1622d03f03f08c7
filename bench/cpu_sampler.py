"""Diagnostic: every process's CPU use every ``--period`` seconds, wall-clock stamped.

    python3 bench/cpu_sampler.py OUT.csv [--period 0.05] [--match python]

Rows: t, pid, ppid, nice, cpu (cores busy over the period), threads, cmdline head; one row
``t,0,...`` per period with the cgroup's ``throttled_usec`` where ``cpu.stat`` has it.
Runs until killed. For lining up the CPU with a job's event log (``--events-out``).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: str) -> tuple[int, int, int, int] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    # after the name: state ppid ... utime(11) stime(12) ... nice(16) num_threads(17)
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[16]), int(fields[17])


def _cmd(pid: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")[:120].replace(",", ";")


def _throttled() -> int:
    try:
        for line in Path("/sys/fs/cgroup/cpu.stat").read_text().splitlines():
            if line.startswith("throttled_usec"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--period", type=float, default=0.05)
    p.add_argument("--match", default="python")
    args = p.parse_args()
    last: dict[str, int] = {}
    cmds: dict[str, str] = {}
    with args.out.open("w", buffering=1) as f:
        f.write("t,pid,ppid,nice,cpu,threads,cmd\n")
        while True:
            t = time.time()
            f.write(f"{t:.3f},0,0,0,{_throttled()},0,cgroup throttled_usec\n")
            for pid in os.listdir("/proc"):
                if not pid.isdigit():
                    continue
                if pid not in cmds:
                    cmds[pid] = _cmd(pid)
                if args.match not in cmds[pid]:
                    continue
                st = _stat(pid)
                if st is None:
                    continue
                ppid, ticks, nice, threads = st
                busy = (ticks - last.get(pid, ticks)) / TICK / args.period
                last[pid] = ticks
                f.write(f"{t:.3f},{pid},{ppid},{nice},{busy:.2f},{threads},{cmds[pid]}\n")
            time.sleep(max(0.0, args.period - (time.time() - t)))


if __name__ == "__main__":
    main()
