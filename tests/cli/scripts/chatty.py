"""A plain torchrun script that prints a lot: numbered lines on stdout, stderr and a raw fd.

Rank 1 SIGKILLs itself halfway through the first attempt (``--kill-at-line``), so the
launcher's own failure lines and a group restart land among the script's."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lines", type=int, default=30)
    p.add_argument("--kill-at-line", type=int, default=-1)
    args = p.parse_args()
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    for i in range(args.lines):
        tag = f"chatty attempt={attempt} rank={rank} line={i}"
        # One write per line: under ``python -u`` print() writes the text and its newline
        # separately, and two ranks' lines would then interleave on any terminal.
        if i % 3 == 0:
            sys.stdout.write(tag + "\n")
            sys.stdout.flush()
        elif i % 3 == 1:
            sys.stderr.write(tag + "\n")
            sys.stderr.flush()
        else:
            os.write(1, (tag + "\n").encode())  # below Python's streams, as C++ code writes
        if rank == 1 and attempt == 0 and i == args.kill_at_line:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.02)


if __name__ == "__main__":
    main()
