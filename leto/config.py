"""Leto's own job settings, read from the ``leto:`` section of a job YAML and from flags.

YAML holds data only: it is read into these dataclasses, which reject unknown keys and
validate ranges, so a typo is a one-line :class:`~leto.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field
from typing import Any, Literal, get_args, get_origin

from leto.erasure.config import ErasureConfig
from leto.errors import ConfigError
from leto.preinit.config import PreinitConfig

StepPhase = Literal["forward", "backward", "sync", "update"]
PHASES: tuple[str, ...] = get_args(StepPhase)
FaultPhase = Literal["forward", "backward", "sync", "update", "recovery"]
UpdatePoint = Literal["boundary", "optimizer", "parity", "flush", "gather"]
UPDATE_POINTS: tuple[str, ...] = get_args(UpdatePoint)
RECOVERY_POINTS = ("attach", "rebuild")
"""Kill points inside a promoted trainer's recovery (``phase: recovery``): attach (regions
mapped, nothing read yet), rebuild (lost chunks replaced by fresh zeroed ones, not yet
rebuilt)."""
FaultPoint = Literal["boundary", "optimizer", "parity", "flush", "gather", "attach", "rebuild"]
DEVICE_REGIONS = ("state", "grads", "rmu.undo", "rmu.parity")
"""Device regions a fault may erase pages of (besides a Megatron DDP buffer, ``ddp.grads.<dtype>``, or
the distributed optimizer's full parameter buffer, ``ddp.params.<dtype>``)."""
FaultKind = Literal["kill", "fatal", "hang", "device", "oom", "kill_shadow", "shadow_crash"]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)


class SettingError(ConfigError):
    """A setting out of range or in conflict with another: ``key``, its dotted path in the
    job file (``leto.hang_timeout_s``), and ``detail``, what is wrong. The CLI names the
    flag instead of the key when the value came from one."""

    def __init__(self, key: str, detail: str) -> None:
        super().__init__(f"{key}: {detail}")
        self.key = key
        self.detail = detail


@dataclass(kw_only=True, slots=True)
class FaultSpec:
    """One injected failure: SIGKILL of the active trainer of ``rank`` at ``step`` in ``phase``."""

    rank: int
    """Global rank whose active trainer is killed."""
    step: int
    """Training step (0-based, as counted by ``leto``) at which the kill happens."""
    phase: FaultPhase = "forward"
    """Phase of that step: forward, backward, sync (gradient all-reduce) or update (optimizer);
    or recovery: inside a promoted trainer's attach, before it resumes at ``step`` (the
    marker's step), at ``point`` attach or rebuild."""
    erase_device_pages: int = 0
    """At the recovery that follows, lose this many pages of the rank's model state per group."""
    erase_host_pages: int = 0
    """... and this many of its tier-1 parity pages (host memory) per group."""
    erase_group: int | None = None
    """Only in this protection group (default: in every group)."""
    erase_device_region: str = "state"
    """Where the device pages are lost: the model state or the gradients ("grads", or a
    Megatron DDP buffer "ddp.grads.<dtype>"; protected by parity), or the updater's
    unprotected undo copy or working parity (a loss there in the middle of an update leaves
    nothing consistent to resume from: the job takes the checkpoint path)."""
    point: FaultPoint | None = None
    """With ``phase: update`` under ``consistency: rmu``, where inside the update:
    boundary (a chunk boundary, before its undo copy), optimizer (mid-chunk: after the
    in-place update, before its parity update), parity (inside the chunk's parity update),
    flush (inside the copy of the parity to host), gather (with Megatron's distributed
    optimizer: inside the all-gather of the updated parameter shards, after the first
    bucket group; the parameter buffer is scribbled). None: after the last chunk (rmu) or
    after the optimizer step (snapshot)."""
    chunk: int | None = None
    """With ``point`` boundary/optimizer/parity: the chunk to kill in (default: the first)."""
    kind: FaultKind = "kill"
    """kill: SIGKILL, a hardware-operable failure (HOF), recovered in place; fatal: a fatal
    failure (FF), the trainer reports its hardware unusable and the job takes the checkpoint
    path; hang: SIGSTOP, the trainer stops making progress (found by the heartbeat);
    device: SIGKILL, and the rank's device is left broken: the promoted shadow's device
    check computes a wrong result (one flipped bit, as a bad memory cell would), so the
    failure turns fatal after promotion and the job takes the checkpoint path; oom: a real
    ``torch.OutOfMemoryError`` at the forward/backward point, raised only while the node's
    shadows hold device memory (L2, L3: as if their footprint made it fail): the
    pre-initialisation controller reclaims them and the trainer retries the step;
    kill_shadow: at (step, phase) the active waits until its rank's shadow is ready,
    SIGKILLs that shadow and waits until the agent has retracted its readiness (the agent
    relaunches it); shadow_crash: every shadow of the rank SIGKILLs itself during its
    pre-initialisation, at every launch, never claimed (``step`` and ``phase`` unused)."""
    oom_bytes: int = 0
    """kind oom, CPU runs with ``leto.preinit.emulated_device_bytes``: the step's emulated
    activation demand beyond the trainer's usual memory (it decides the relaunch level)."""
    shadow_ready_steps_before: int = 0
    """With n > 0: at the forward point of step ``step - n`` the trainer waits (beating its
    heartbeat) until its shadow is pre-initialised, so the shadow maps the retained regions
    ahead and the marker moves on for n steps before the kill, as in a long job. Default 0:
    fire at once, ready shadow or not."""
    drop_region: str | None = None
    """With kind kill: just before the kill the state manager drops this retained region of
    the rank (e.g. "state", "marker"; freed, its memory gone once no process maps it): a
    region lost behind the marker's back, which the successor must refuse to resume on."""

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0:
            raise ConfigError(
                f"fault rank and step must be >= 0, got rank={self.rank} step={self.step}"
            )
        if self.phase not in (*PHASES, "recovery"):
            raise ConfigError(
                f"fault phase {self.phase!r} is not one of {', '.join(PHASES)}, recovery"
            )
        if (self.phase == "recovery") != (self.point in RECOVERY_POINTS):
            raise ConfigError(
                f"fault phase recovery needs point {' or '.join(RECOVERY_POINTS)} (and those "
                f"points need phase recovery), got point {self.point!r}"
            )
        if (
            self.erase_device_region not in DEVICE_REGIONS
            and not self.erase_device_region.startswith(("ddp.grads.", "ddp.params."))
        ):
            raise ConfigError(
                f"fault erase_device_region {self.erase_device_region!r} is not one of "
                f"{', '.join(DEVICE_REGIONS)}, ddp.grads.<dtype> or ddp.params.<dtype>"
            )
        if min(self.erase_device_pages, self.erase_host_pages) < 0:
            raise ConfigError("fault erase_device_pages / erase_host_pages must be >= 0")
        if (
            self.point is not None
            and self.phase != "recovery"
            and (self.phase != "update" or self.point not in UPDATE_POINTS)
        ):
            raise ConfigError(
                f"fault point {self.point!r} needs phase: update and one of {', '.join(UPDATE_POINTS)}"
            )
        if self.chunk is not None and (self.point in (None, "flush", "gather") or self.chunk < 0):
            raise ConfigError(
                "fault chunk needs point: boundary, optimizer or parity, and must be >= 0"
            )
        if not 0 <= self.shadow_ready_steps_before <= self.step:
            raise ConfigError(f"fault shadow_ready_steps_before must be in [0, step={self.step}]")
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"fault kind {self.kind!r} is not one of {', '.join(FAULT_KINDS)}")
        if self.kind == "oom" and (self.phase not in ("forward", "backward") or self.erases):
            raise ConfigError(
                "fault kind oom needs phase forward or backward (the compute phase) and erases no pages"
            )
        if self.kind in ("kill_shadow", "shadow_crash") and (self.erases or self.point is not None):
            raise ConfigError(f"fault kind {self.kind} erases no pages and takes no update point")
        if self.oom_bytes < 0 or (self.oom_bytes and self.kind != "oom"):
            raise ConfigError(
                f"fault oom_bytes needs kind: oom and must be >= 0, got {self.oom_bytes}"
            )
        if self.drop_region is not None and (self.kind != "kill" or not self.drop_region):
            raise ConfigError(
                f"fault drop_region needs kind: kill and a region name, got {self.drop_region!r}"
            )

    @property
    def erases(self) -> bool:
        return bool(self.erase_device_pages or self.erase_host_pages)

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parse ``rank=1,step=5,phase=backward`` (the ``--inject-fault`` flag)."""
        where = f"--inject-fault {text!r}"
        fields: dict[str, Any] = {}
        for part in text.split(","):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or not key:
                raise ConfigError(
                    f"{where}: expected key=value pairs like rank=1,step=5,phase=update"
                )
            if key in fields:
                raise ConfigError(f"{where}: {key} is given twice")
            fields[key] = value
        return from_dict(cls, fields, where=where)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """The checkpoint kept for fatal failures (FFs): torch.distributed.checkpoint, async."""

    dir: str
    """Directory of the checkpoints (one sub-directory per saved step)."""
    interval_steps: int | None = None
    """Save every N committed steps; None: Young's interval for the FF rate (below)."""
    mttf_s: float = 86400.0
    """Mean time to failure of the job, all failures counted (HOFs and FFs)."""
    hof_ratio: float = 0.9
    """Fraction h of failures recovered in place; a checkpoint serves only the others, so
    Young's interval uses the FF MTTF, ``mttf_s / (1 - h)``."""
    keep: int = 2
    """Complete checkpoints kept on disk; older ones are deleted."""

    def __post_init__(self) -> None:
        if self.interval_steps is not None and self.interval_steps < 1:
            raise SettingError(
                "leto.checkpoint.interval_steps", f"must be >= 1, got {self.interval_steps}"
            )
        if not self.mttf_s > 0:
            raise SettingError("leto.checkpoint.mttf_s", f"must be > 0, got {self.mttf_s}")
        if not 0.0 <= self.hof_ratio < 1.0:
            raise SettingError(
                "leto.checkpoint.hof_ratio", f"must be in [0, 1), got {self.hof_ratio}"
            )
        if self.keep < 1:
            raise SettingError("leto.checkpoint.keep", f"must be >= 1, got {self.keep}")

    @property
    def ff_mttf_s(self) -> float:
        """Mean time between fatal failures: the failures a checkpoint must cover."""
        return self.mttf_s / (1.0 - self.hof_ratio)


@dataclass(kw_only=True, slots=True)
class LetoConfig:
    """Leto's settings for one job (the ``leto:`` section of a job YAML)."""

    recovery: Literal["in_place", "restart"] = "in_place"
    """in_place: promote shadows on a trainer failure; restart: torchrun's group restart only."""
    consistency: Literal["snapshot", "rmu"] = "rmu"
    """How an interrupted optimizer update is made consistent. rmu: chunk-level transactions
    (undo buffer + incremental parity, paper §5.2); snapshot: a full pre-update host copy
    (the §5.1 strawman, kept as the baseline)."""
    rmu_chunk_bytes: int | None = None
    """rmu: bytes of parameters per chunk transaction (the undo buffer holds ~3x this:
    parameters, exp_avg, exp_avg_sq, rounded out to 2 KiB tiles). None: 256 MiB on a GPU,
    4 MiB on CPU (``default_rmu_chunk_bytes``). Small chunks on a GPU make the update
    launch-bound (a kernel launch per chunk) and cut the parity fold into short runs per
    group, where the Horner kernel gains least; BENCHMARKS.md has the measurements."""
    rmu_fused: bool | None = None
    """rmu: save and update each chunk with one fused Triton kernel (undo copy + AdamW in one
    pass, ``triton_kernels/adamw_rmu.py``) instead of a copy and torch's foreach ops. None:
    on when the state lives on a CUDA device and the parameters are float32, off otherwise
    (on CPU the kernel only runs in Triton's slow interpreter). Fused and unfused results
    agree to float rounding, not bit for bit; recovery is exact either way, since a job
    keeps one path before and after a failure."""
    lend_activation_memory: bool | None = None
    """rmu on a GPU: the compute phase's activations borrow the undo buffer (it is needed
    only after backward), so the update adds no peak device memory (``leto.pool.lend``;
    needs a C compiler once, to build its allocator). None: on with rmu on a CUDA device
    (on CPU there is nothing to lend, and the setting has no effect; without a C compiler
    or ``torch.cuda.MemPool``, None warns and does not lend, True fails the job). A
    tensor made in the compute phase and kept past it, if it sits in the lent memory, stops
    the step with an error rather than being overwritten."""
    shadow_level: Literal[1, 2, 3] = 3
    """Highest pre-initialisation level of shadows: 1 = imports and model (no device
    memory), 2 = + CUDA context and cuBLAS, 3 = + process group built. The controller
    (``preinit``) lowers it when the actives need the memory and raises it back."""
    preinit: PreinitConfig = field(default_factory=PreinitConfig)
    """The pre-initialisation controller: shadows give their memory back on an OOM."""
    poll_interval_s: float = 0.02
    """How often the agent polls its trainers; a dead active is seen within this time."""
    dashboard: bool = True
    """Show the live rich dashboard (plain log lines when stdout is not a terminal)."""
    events_file: str | None = None
    """Where to write the JSON-lines event stream (default: in the run's log directory)."""
    digest: bool = False
    """Emit a digest of all retained model state at every committed step (exactness tests)."""
    faults: list[FaultSpec] = field(default_factory=list)
    """Failures to inject (demos and tests)."""
    erasure: ErasureConfig | None = None
    """Two-tier Reed-Solomon protection of retained state (page_bytes, data_pages,
    tier1_parity, tier2_parity). Off unless given: on CPU parity costs ~15 ms per MB of
    model state per step; on GPU it runs in Triton kernels."""
    hang_timeout_s: float = 60.0
    """A trainer whose heartbeat makes no progress for this long is killed and recovered."""
    first_step_timeout_s: float = 600.0
    """The same limit until a trainer's first step (compilation and data loading are slow)."""
    peer_failure_grace_s: float = 2.0
    """Multi-node: how long a node whose trainers raised (a peer's death breaks their
    collectives) waits for another node's recovery epoch before restarting the group."""
    checkpoint: CheckpointConfig | None = None
    """The checkpoint kept for fatal failures; None: none (an FF restarts from step 0)."""
    warm_restarts: bool = True
    """Start the workers of a group restart, and every shadow, from a fork server that has
    imported torch."""
    failure_loop_limit: int = 32
    """Trainer failures in a row without any committed step after which the job stops
    recovering in place and takes a group restart (a failure loop, not bad luck)."""
    deterministic: bool = False
    """Deterministic kernels in every trainer (``leto.kernels``): a recovered run is then bit
    for bit a fault-free one. Off, the state a promoted trainer resumes from is still bit
    for bit the state committed before the failure; only re-run steps may differ in the
    last bits, as two fault-free runs with PyTorch's default GPU kernels do."""
    metrics_port: int | None = None
    """Serve Prometheus metrics (text format) on this TCP port of every node's agent, at
    ``/metrics``; None: no endpoint. 0 picks a free port (printed, and in the events)."""

    def __post_init__(self) -> None:
        if self.lend_activation_memory and self.consistency != "rmu":
            raise SettingError(
                "leto.lend_activation_memory",
                "true needs consistency: rmu (it lends the undo buffer)",
            )
        if self.rmu_chunk_bytes is not None and self.rmu_chunk_bytes < 4096:
            raise SettingError(
                "leto.rmu_chunk_bytes", f"must be >= 4096, got {self.rmu_chunk_bytes}"
            )
        if not 0.001 <= self.poll_interval_s <= 0.05:
            raise SettingError(
                "leto.poll_interval_s", f"must be in [0.001, 0.05] s, got {self.poll_interval_s}"
            )
        if self.erasure is None and any(f.erases for f in self.faults):
            raise SettingError(
                "leto.faults", "a fault erases pages, but leto.erasure is not configured"
            )
        if not self.hang_timeout_s > 0:
            raise SettingError("leto.hang_timeout_s", f"must be > 0, got {self.hang_timeout_s}")
        if not self.first_step_timeout_s >= self.hang_timeout_s:
            raise SettingError(
                "leto.first_step_timeout_s",
                f"must be >= hang_timeout_s "
                f"({self.hang_timeout_s}), got {self.first_step_timeout_s}",
            )
        if self.failure_loop_limit < 1:
            raise SettingError(
                "leto.failure_loop_limit", f"must be >= 1, got {self.failure_loop_limit}"
            )
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise SettingError(
                "leto.metrics_port", f"must be in [0, 65535], got {self.metrics_port}"
            )
        if not self.peer_failure_grace_s >= 0:
            raise SettingError(
                "leto.peer_failure_grace_s", f"must be >= 0, got {self.peer_failure_grace_s}"
            )


def closest(key: object, known: Iterable[str]) -> str | None:
    """The known key a mistyped ``key`` most likely meant (``nproc-per-node`` for
    ``nproc_per_node``, ``consistancy`` for ``consistency``), or None."""
    known = list(known)
    text = str(key).replace("-", "_")
    if text in known:
        return text
    matches = difflib.get_close_matches(text, known, n=1)
    return matches[0] if matches else None


def unknown_key(key: object, known: Iterable[str]) -> str:
    """``unknown key 'x'``, with the closest known key, or the known keys when none is close."""
    known = list(known)
    guess = closest(key, known)
    if guess is not None:
        return f"unknown key {key!r}; did you mean {guess!r}?"
    return f"unknown key {key!r} (known: {', '.join(sorted(known))})"


def from_dict(cls: type, data: Any, *, where: str, key: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, rejecting unknown, missing and mistyped keys.

    ``where`` is the file or flag the mapping came from, ``key`` its dotted path there
    (``leto``, ``leto.checkpoint``); errors read ``WHERE: KEY: what is wrong``.
    """
    at = f"{where}: {key}" if key else where
    if not isinstance(data, dict):
        raise ConfigError(f"{at}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    for name in data:
        if name not in names:
            raise ConfigError(f"{at}: {unknown_key(name, names)}")
    for f in fields:
        if f.name not in data and f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"{at}: {f.name} is missing")
    kwargs = {
        k: _coerce(hints[k], v, where=where, key=f"{key}.{k}" if key else k)
        for k, v in data.items()
    }
    try:
        return cls(**kwargs)
    except SettingError as e:  # it names its own key, from the job file's top
        raise ConfigError(f"{where}: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{at}: {e}") from None


def _coerce(tp: Any, value: Any, *, where: str, key: str) -> Any:
    at = f"{where}: {key}"
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise ConfigError(f"{at}: {value!r} is not one of {', '.join(map(str, args))}")
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        return _coerce(next(a for a in args if a is not type(None)), value, where=where, key=key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{at}: expected a list, got {type(value).__name__}")
        return [_coerce(args[0], v, where=where, key=f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return value if isinstance(value, tp) else from_dict(tp, value, where=where, key=key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ConfigError(f"{at}: expected true or false, got {value!r}")
    if tp in (int, float, str):
        if (
            isinstance(value, bool)
            or (tp is str and not isinstance(value, str))
            or (tp is int and isinstance(value, float) and not value.is_integer())
        ):
            raise ConfigError(f"{at}: expected {tp.__name__}, got {value!r}")
        try:
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{at}: expected {tp.__name__}, got {value!r}") from None
    return value


def read_yaml(path: Any, what: str = "file") -> Any:
    """Parse a YAML file; a missing or unreadable file, one that is not UTF-8 text, or a
    syntax error is one ConfigError line."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{what} {str(path)!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what} {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} {str(path)!r} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
            f"{e.start}); save it as UTF-8"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        loc = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        detail = " ".join(filter(None, [e.context, e.problem]))
        raise ConfigError(f"{loc}: malformed YAML: {detail}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: malformed YAML: {' '.join(str(e).split())}") from None


def default_rmu_chunk_bytes(device_type: str) -> int:
    """``leto.rmu_chunk_bytes`` when the job leaves it unset: 256 MiB of parameters per
    chunk on a GPU (17 chunks for 1.1 B fp32 parameters, a 768 MiB undo region: 0.5 % of an
    H200), 4 MiB on CPU (the demo and tests: several chunks even for tiny models)."""
    return 256 << 20 if device_type == "cuda" else 4 << 20
