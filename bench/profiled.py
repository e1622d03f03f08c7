"""Run a training script under cProfile: ``python bench/profiled.py SCRIPT ARGS...``.

Profiling starts at the script's ``$LETO_BENCH_PROFILE_FROM``-th backward call (default 20:
startup and the first steps left out) and the main thread's profile goes to
``$LETO_BENCH_PROFILE/<pid>.prof`` when the script ends (``os._exit`` included; a shadow
killed at the job's end writes none), with ``<pid>.json`` saying how many backward calls it
covers. A diagnostic for the benches: where a trainer's host time goes, function by
function (autograd's hooks run on the engine's device thread on CUDA and show only as the
main thread's wait in ``backward``)."""

from __future__ import annotations

import cProfile
import json
import os
import runpy
import sys
from pathlib import Path

import torch


def main() -> None:
    out = Path(os.environ["LETO_BENCH_PROFILE"])
    start = int(os.environ.get("LETO_BENCH_PROFILE_FROM", "20"))
    script, sys.argv = sys.argv[1], sys.argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)  # as if the script were run itself
    profile = cProfile.Profile()
    calls = [0, 0]  # backward calls: all, profiled
    backward = torch.autograd.backward

    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == start:
            profile.enable()
        if calls[0] >= start:
            calls[1] += 1
        return backward(*args, **kwargs)

    torch.autograd.backward = counted
    exit_now = os._exit

    def dump() -> None:
        profile.disable()
        if calls[1]:
            out.mkdir(parents=True, exist_ok=True)
            profile.dump_stats(out / f"{os.getpid()}.prof")
            (out / f"{os.getpid()}.json").write_text(json.dumps({"steps": calls[1]}))

    def exiting(code: int) -> None:
        dump()
        exit_now(code)

    os._exit = exiting
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        dump()


if __name__ == "__main__":
    main()
