"""Group-restart time of a plain torchrun script: leto-run (warm restarts) vs torchrun.

The same DDP script without the leto API (its process group on a per-attempt prefix of the
launcher's store, which torchrun needs to restart a gloo job reliably), 2 ranks on gloo, in
this one invocation; rank 1
SIGKILLs itself at step 3 of the first attempt and the launcher restarts the group
(``--max-restarts 1``). Restart time: from the kill until the restarted group has
finished its first step (rank 0). Three launchers, each run ``--repeats`` times (median):

* torchrun                            — the baseline;
* leto-run --no-warm-restarts         — leto's agent, workers started cold as torchrun does;
* leto-run                            — workers forked from the pre-warmed fork server.

    python bench/restart_cpu.py [--repeats 3] [--json bench/results/restart_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LETO_RUN = str(Path(sys.executable).with_name("leto-run"))

SCRIPT = """
import json, os, signal, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from datetime import timedelta

out, kill_at = sys.argv[1], 3
torch.set_num_threads(1)
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
# torchrun reuses its store across restarts: a plain init_process_group("gloo") may hang
# on the previous attempt's keys, so (as torchrun users do) each attempt has a prefix.
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                      timeout=timedelta(seconds=120))
dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                        world_size=int(os.environ["WORLD_SIZE"]))
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(8):
    g = torch.Generator().manual_seed(step * 2 + rank)
    loss = model(torch.randn(16, 64, generator=g)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0 and attempt == 1 and step == 0:
        with open(out + ".first_step", "w") as f:
            f.write(repr(time.time()))
    if rank == 1 and attempt == 0 and step == kill_at:
        with open(out + ".kill", "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
dist.destroy_process_group()
"""

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "leto-run cold": [LETO_RUN, "--no-dashboard", "--no-warm-restarts"],
    "leto-run warm": [LETO_RUN, "--no-dashboard"],
}


def restart_s(launcher: list[str], tmp: Path, tag: str) -> float:
    script = tmp / "plain_restart.py"
    script.write_text(SCRIPT)
    out = tmp / tag
    cmd = [
        *launcher,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(script),
        str(out),
    ]
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, check=True, cwd=tmp, env=env, capture_output=True, timeout=300)
    kill = float(Path(str(out) + ".kill").read_text())
    return float(Path(str(out) + ".first_step").read_text()) - kill


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=str(REPO / "bench/results/restart_cpu.json"))
    args = p.parse_args()
    times: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.repeats):  # interleaved, so load drifts hit every launcher alike
            for name, launcher in LAUNCHERS.items():
                times[name].append(restart_s(launcher, Path(d), f"{name.replace(' ', '_')}_{i}"))
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"{'launcher':<16} {'restart (s), median':>20}   runs")
    for name, v in times.items():
        print(f"{name:<16} {med[name]:>20.3f}   {', '.join(f'{x:.3f}' for x in v)}")
    speedup = med["torchrun"] / med["leto-run warm"]
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"restart_s": times, "median_s": med, "speedup": speedup}, indent=2)
    )
    print(f"speedup: {speedup:.1f}x")


if __name__ == "__main__":
    main()
