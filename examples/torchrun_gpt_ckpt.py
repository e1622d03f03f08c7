"""The baseline: the demo GPT as a plain torchrun script with torch.distributed.checkpoint
(``--arch hf-llama``: transformers' Llama of examples/train_hf_llama.py instead).

Saves a DCP checkpoint every ``--ckpt-every`` steps; after a group restart it loads the
newest complete one and recomputes the steps since. ``--ckpt-async``: ``dcp.async_save``
instead (the state staged by DCP's ``DefaultStager`` into reused pinned host buffers on a
GPU, plain host buffers on CPU, then written by a background thread over a gloo group of
its own), so the step blocks only for the staging copy (and for the previous save, if it
is still running); aim ``--ckpt-dir`` at ``/dev/shm`` for an in-memory checkpoint. Each attempt builds its process group on a
``PrefixStore`` of its own (plain ``init_process_group`` fails after a torchrun restart).
Used by bench/recovery_cpu.py, bench/recovery_gpu.py and bench/goodput.py; writes the same
step events as leto trainers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
from train_gpt import GPT, batch, data_steps, lr_at, step_loss

from leto import kernels
from leto.events import EventLog, Kind
from leto.trainer.timing import PhaseTimes, StepProfiler, profile_after, profile_dir


def complete_checkpoints(root: Path, world: int) -> list[Path]:
    """Complete checkpoints, oldest first: ``.done`` (dcp.save, after a barrier) or every
    rank's ``.done.<rank>`` (async: each rank's save future finished; rank 0's finishes
    after DCP wrote the metadata)."""

    def complete(d: Path) -> bool:
        return (d / ".done").exists() or all((d / f".done.{r}").exists() for r in range(world))

    return sorted((d for d in root.glob("step_*") if complete(d)), key=lambda d: int(d.name[5:]))


def prune(root: Path, world: int, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (``keep`` 0: none deleted)."""
    if keep > 0:
        for old in complete_checkpoints(root, world)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


class AsyncSaver:
    """``dcp.async_save`` with one save in flight: the state is staged by DCP's
    ``DefaultStager`` (its buffers reused from save to save; pinned on a GPU), written by
    DCP's background thread over a gloo group of its own (the training loop's collectives
    stay on the default group), and marked complete per rank when written."""

    def __init__(self, rank: int, world: int, device: torch.device, args: argparse.Namespace):
        cuda = device.type == "cuda"
        self.rank, self.world, self.args = rank, world, args
        self.group = dist.new_group(backend="gloo")
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=False,  # the copy completes before the next update
                use_non_blocking_copy=cuda,
            )
        )
        self.pending = None

    def save(self, state: dict, target: Path) -> float:
        """Stage ``state`` and start writing it; returns the seconds spent waiting for the
        previous save to finish first (0 when it had)."""
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        response = dcp.async_save(
            state,
            checkpoint_id=str(target),
            process_group=self.group,
            async_stager=self.stager,
        )
        future = getattr(response, "upload_completion", response)
        marker = target / f".done.{self.rank}"

        def done(f, marker: Path = marker) -> None:
            if f.exception() is None:
                marker.touch()
                if self.rank == 0:
                    prune(Path(self.args.ckpt_dir), self.world, self.args.ckpt_keep)

        future.add_done_callback(done)
        self.pending = future
        return waited

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()
            self.pending = None


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The model of ``--arch`` on the current default device."""
    if args.arch == "gpt":
        return GPT(args.vocab, args.dim, args.layers, args.heads, args.seq, args.dropout)
    from train_hf_llama import build as build_llama

    return build_llama(args)


def logged(step: int, args: argparse.Namespace) -> bool:
    """Whether step ``step`` reads and reports its loss (``--log-every``)."""
    return args.log_every > 0 and step % args.log_every == 0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument(
        "--arch",
        choices=("gpt", "hf-llama"),
        default="gpt",
        help="the demo GPT, or transformers' LlamaForCausalLM of examples/train_hf_llama.py",
    )
    p.add_argument("--kill-at-step", type=int, default=-1)
    p.add_argument(
        "--log-every",
        type=int,
        default=10,
        metavar="N",
        help="read the loss (a wait for the device) and report it every N steps, as "
        "torchtitan's log_freq does (0: never)",
    )
    p.add_argument(
        "--allreduce",
        choices=("ddp", "flat", "per-param"),
        default="ddp",
        help="over several ranks: DistributedDataParallel (bucketed all-reduces overlapping "
        "backward, gradients as bucket views: what a careful user runs), one flattened "
        "all-reduce after backward, or one call per parameter",
    )
    p.add_argument(
        "--ckpt-async",
        action="store_true",
        help="dcp.async_save (staged, written in the background) instead of dcp.save",
    )
    p.add_argument(
        "--ckpt-keep",
        type=int,
        default=0,
        help="keep only the newest N complete checkpoints (0: all)",
    )
    for name, default in (
        ("vocab", 256),
        ("dim", 64),
        ("layers", 4),
        ("heads", 4),
        ("seq", 32),
        ("batch", 8),
        ("grad-accum", 1),
        ("warmup", 5),
        ("seed", 1234),
    ):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--kv-heads", type=int, default=0, help="--arch hf-llama: 0 is half the heads")
    p.add_argument("--ffn", type=int, default=0, help="--arch hf-llama: MLP width (0: 4 x dim)")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="GPU: the deterministic kernels leto-run --deterministic uses",
    )
    p.add_argument(
        "--adamw",
        choices=("fused", "foreach"),
        default="fused",
        help="torch's AdamW implementation (fused: the fastest, the baseline a careful user runs)",
    )
    p.add_argument(
        "--zero-grad",
        choices=("none", "zeros"),
        default="none",
        help="optimizer.zero_grad(set_to_none=...): none (torch's default: backward writes "
        "fresh gradients, no fill and no accumulation) or zeros (gradients accumulate in place)",
    )
    args = p.parse_args()
    for flag, value, least in (
        ("--steps", args.steps, 1),
        ("--ckpt-every", args.ckpt_every, 1),
        ("--log-every", args.log_every, 0),
        ("--grad-accum", args.grad_accum, 1),
    ):
        if value < least:  # one line, as leto-run's errors (argparse's error adds the usage)
            p.exit(2, f"{p.prog}: error: {flag} must be >= {least}, got {value}\n")
    torch.set_num_threads(1)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=120),
    )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        if args.deterministic:  # what leto-run --deterministic applies (before cuBLAS first runs)
            kernels.use_deterministic()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = "nccl" if device.type == "cuda" and local <= torch.cuda.device_count() else "gloo"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"attempt{attempt}", store),
        rank=rank,
        world_size=world,
        device_id=device if backend == "nccl" else None,
    )
    events = EventLog.from_env(f"trainer{rank}")
    torch.manual_seed(args.seed)
    with device:
        model = build(args)
    if world > 1 and args.allreduce == "ddp":
        model = DDP(
            model,
            device_ids=[device] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
        )
    make_batch = batch
    if args.arch == "hf-llama":
        from train_hf_llama import batch as make_batch
    # The strongest plain-torch update: one fused kernel (or foreach, to compare with it)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=args.lr,
        weight_decay=0.1,
        **({"fused": True} if args.adamw == "fused" else {"foreach": True}),
    )
    start = 0
    ckpts = complete_checkpoints(Path(args.ckpt_dir), world)
    if ckpts:
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "rng": torch.get_rng_state()}
        dcp.load(state, checkpoint_id=str(ckpts[-1]))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        torch.set_rng_state(state["rng"])
        start = int(ckpts[-1].name[5:])
        events.emit(
            Kind.RESUMED,
            rank=rank,
            step=start,
            action="checkpoint",
            load_s=time.perf_counter() - t0,
        )
    saver = AsyncSaver(rank, world, device, args) if args.ckpt_async else None
    # LETO_PROFILE_DIR: the same profiled steps as a leto-run trainer's, to compare tables
    profiler = (
        StepProfiler(where, rank, device, profile_after()) if (where := profile_dir()) else None
    )
    for step in range(start, args.steps):
        if profiler is not None:
            profiler.begin(step)
        began = time.perf_counter()
        phases = PhaseTimes(device, began)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        opt.zero_grad(set_to_none=args.zero_grad == "none")
        losses, micro_steps = [], data_steps(step, args)
        for micro_step in micro_steps:
            x, y = make_batch(micro_step, rank, args, device)
            last = micro_step == micro_steps[-1]
            # DDP all-reduces with the last micro-batch's backward only, as a careful user runs it
            sync = model.no_sync() if isinstance(model, DDP) and not last else nullcontext()
            with sync:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
                    loss = model(x, y) if args.arch == "gpt" else model(input_ids=x, labels=x).loss
                if args.grad_accum > 1:
                    loss = loss / args.grad_accum
                loss.backward()
            losses.append(loss.detach())
        loss = step_loss(losses)
        if attempt == 0 and rank == world - 1 and step == args.kill_at_step:
            events.emit(Kind.FAULT_INJECTED, rank=rank, step=step, phase="backward")
            os.kill(os.getpid(), signal.SIGKILL)
        phases.mark("compute")
        if world > 1 and args.allreduce == "flat":  # one call, as DDP's bucket would
            grads = [prm.grad for prm in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(world)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        elif world > 1:
            for prm in model.parameters():
                dist.all_reduce(prm.grad)
                prm.grad.div_(world)
        phases.mark("allreduce")
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        phases.mark("clip")
        opt.step()  # no wait for the device: the host queues the next step meanwhile
        phases.mark("update")
        if profiler is not None:
            profiler.end(step)
        events.emit(
            Kind.STEP_DONE,
            rank=rank,
            step=step,
            iter_s=time.perf_counter() - began,
            attempt=attempt,
            **phases.fields(),
            **({"loss": float(loss.detach())} if logged(step, args) else {}),
        )
        if (step + 1) % args.ckpt_every == 0:
            t0 = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            target = Path(args.ckpt_dir) / f"step_{step + 1}"
            state = {"model": msd, "optim": osd, "rng": torch.get_rng_state()}
            waited = 0.0
            if saver is not None:
                waited = saver.save(state, target)  # blocks for the staging copy
            else:
                dcp.save(state, checkpoint_id=str(target))
                dist.barrier()
                if rank == 0:
                    (target / ".done").touch()
                    prune(Path(args.ckpt_dir), world, args.ckpt_keep)
            events.emit(
                Kind.DIGEST,
                rank=rank,
                step=step + 1,
                digest="ckpt",
                save_s=time.perf_counter() - t0,
                wait_s=waited,  # of save_s: waiting for the previous async save's write
            )
    if saver is not None:
        saver.wait()
    dist.barrier()
    if rank == 0 and os.environ.get("KEEP_CKPT") != "1":
        shutil.rmtree(args.ckpt_dir, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13's gloo can abort in C++ static teardown after a clean run: skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
