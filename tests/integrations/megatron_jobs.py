"""examples/megatron_gpt.py jobs under leto-run, as the Megatron integration tests run them."""

from __future__ import annotations

from dataclasses import dataclass, field

from leto.events import Kind
from tests.launcher.harness import REPO, run_leto

SCRIPT = str(REPO / "examples" / "megatron_gpt.py")
TINY_GPT = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--micro-batch-size", "2", "--vocab-size", "128",
    "--lr", "1e-3", "--seed", "7",
]  # fmt: skip
"""The model every Megatron integration test trains (examples/megatron_gpt.py's flags); a
test adds its parallelism and features after it."""


@dataclass(frozen=True)
class MegatronJobs:
    """One test file's model arguments and leto settings; ``run`` launches a job and
    requires it to succeed, ``job`` gives ``run_leto``'s arguments (the harness's fault-free
    reference runs take them too)."""

    leto: dict
    model: list[str] = field(default_factory=list)

    def job(self, *, script_args=(), leto=None, timeout_s: float = 200) -> dict:
        return {
            "leto": leto or self.leto,
            "script": SCRIPT,
            "steps_flag": "--train-iters",
            "model_args": self.model,
            "script_args": list(script_args),
            "timeout_s": timeout_s,
        }

    def run(
        self,
        tmp_path,
        *,
        nproc: int,
        steps: int,
        faults=(),
        script_args=(),
        leto=None,
        timeout_s: float = 200,
    ):
        proc, events = run_leto(
            tmp_path,
            steps=steps,
            nproc=nproc,
            faults=list(faults),
            **self.job(script_args=script_args, leto=leto, timeout_s=timeout_s),
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc, events

    @staticmethod
    def losses(events: list[dict], rank: int) -> list[float | None]:
        return [e["loss"] for e in events if e["kind"] == Kind.STEP_DONE and e["rank"] == rank]
