"""``leto.init()``: join the job as an active trainer, or wait pre-initialised as a shadow.

Under ``leto-run`` every local rank has an active trainer and a shadow trainer running the
same script. Both call ``leto.init()``. The active builds its process group and returns.
The shadow pre-initialises to its level (L1: imports done and libraries warmed; L3: + the
process group among the shadows of all ranks) and also returns, so that it goes on to
build the model (on the meta device: no memory, no init cost) and the optimizer before
the failure. It blocks in ``ctx.retain()`` until the agent promotes its whole generation,
then attaches the retained state and trains on exactly as an active would.

Each generation gets its own ``PrefixStore`` on the agent's store, so a rebuilt process
group never meets the stale keys of the one it replaces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from leto import compiled, contract, kernels
from leto.config import default_rmu_chunk_bytes
from leto.contract import ENV_CHECKPOINT, ROLE_ACTIVE, ROLE_SHADOW
from leto.device_health import DeviceUnhealthyError, check_device
from leto.errors import ConfigError, ProtocolError, ScriptError, UnrecoverableStateError
from leto.events import EventLog, Kind
from leto.faults import FaultInjector
from leto.health import Heartbeat
from leto.pool.client import PoolClient
from leto.preinit.guard import OomGuard
from leto.preinit.probe import probe_for
from leto.preinit.site import ShadowSite
from leto.priority import ShadowPriority
from leto.trainer.env import TrainerEnv
from leto.trainer.grad_sync import GradSync
from leto.trainer.services import TrainerServices

if TYPE_CHECKING:
    from leto.checkpoint import Checkpointer
    from leto.config import CheckpointConfig
    from leto.retained.layout import GradPlacement
    from leto.trainer.state import RetainedState

logger = logging.getLogger(__name__)

_WAIT_SLICE = timedelta(seconds=60)


class Context:
    """A trainer's handle on the job: rank, store, pool, events, fault injector."""

    def __init__(self, env: TrainerEnv, store: dist.Store, raw_store: dist.Store) -> None:
        self.priority = ShadowPriority()
        """A shadow's CPU priority: lowest until promoted (``leto.priority``)."""
        if env.role == ROLE_SHADOW:
            self.priority.lower()
        self.env = env
        self.store = store
        self.events = EventLog.from_env(f"trainer{env.rank}")
        self.pool = PoolClient(env.pool_socket)
        self.injector = FaultInjector.from_env(
            env.rank, self.events, claim=lambda i: raw_store.add(contract.fault_claim(i), 1) == 1
        )
        # An injected fatal failure tells the agent before dying: it is classified as an FF.
        self.injector.report_fatal = lambda: store.set(contract.fatal(env.rank), "injected")
        self._device_fault_key = contract.device_fault(env.rank)
        self.injector.break_device = lambda: raw_store.set(self._device_fault_key, "injected")
        self._raw_store = raw_store
        self.heartbeat = Heartbeat.from_env(env.local_rank)
        self.device = _local_device(env)
        """Where this rank computes: its own GPU (LOCAL_RANK modulo the GPUs) or the CPU."""
        if not env.rmu_chunk_bytes:  # the job left it unset: the default for this device
            self.env = env = dataclasses.replace(
                env, rmu_chunk_bytes=default_rmu_chunk_bytes(self.device.type)
            )
        self.preinit = OomGuard(
            self.heartbeat,
            probe_for(self.device, env.local_rank, env.preinit),
            env.preinit,
            self.events,
            env.rank,
        )
        """This trainer's side of the pre-initialisation controller (reports, reclaims)."""
        self.injector.shadow_present = self.preinit.shadows_hold_memory
        self.injector.on_oom = self.preinit.demand
        self.injector.wait_for_shadow = self._wait_for_own_shadow
        self.injector.kill_shadow = self._kill_own_shadow
        self.checkpointer: Checkpointer | None = None
        self._retained: bool = False
        """``retain()`` was called: this process's regions hold that model's state."""
        self.promoted_at: float | None = None
        self.exits_cleanly = False
        """Whether the process leaves by ``os._exit(0)`` once training finished
        (``_CleanExit``): a trainer process that ``leto.init()`` started, never a process
        that only hosts a ``Context`` (a test runner's exit status is its own)."""
        self._started = time.time()
        self._build_group: Callable[[], None] = lambda: None
        self.collective_device = torch.device("cpu")
        """Where collective inputs must live (the GPU under NCCL)."""
        self.grad_sync = GradSync()
        """Gradient all-reduce group and clipping rule: the world, torch's clipping. A
        model-parallel integration sets its data-parallel group here before ``retain``."""

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_shadow(self) -> bool:
        return self.env.role == ROLE_SHADOW and self.promoted_at is None

    def shadow_site(self) -> ShadowSite:
        """This trainer's facts for the shadow warm-ups (``leto.preinit``), as they are now."""
        return ShadowSite(
            rank=self.rank,
            env=self.env,
            store=self.store,
            events=self.events,
            heartbeat=self.heartbeat,
            is_shadow=self.is_shadow,
            device=self.device,
            forward_collectives=self.grad_sync.from_integration,
        )

    def services(self) -> TrainerServices:
        """What this trainer's retained state uses of it (``leto.trainer.services``)."""
        return TrainerServices(
            rank=self.rank,
            world_size=self.world_size,
            env=self.env,
            device=self.device,
            collective_device=self.collective_device,
            store=self.store,
            events=self.events,
            pool=self.pool,
            injector=self.injector,
            preinit=self.preinit,
            grad_sync=lambda: self.grad_sync,
            shadow_site=self.shadow_site,
            ready_to_map_ahead=self.ready_to_map_ahead,
            committed=self.committed,
            finished=self.finished,
        )

    @property
    def resuming(self) -> bool:
        """True when this trainer will reattach to retained state (shadows always do)."""

        if self.env.role == ROLE_SHADOW:
            return True
        return self.state_retained()

    def state_retained(self) -> bool:
        """True when this rank's retained state exists and was fully initialised."""
        from leto.retained.marker import Marker

        region = self.pool.lookup(self.rank, "marker")
        if region is None:
            return False
        try:
            return Marker(torch.frombuffer(region.buffer, dtype=torch.uint8)).is_valid()
        finally:
            del region

    @contextlib.contextmanager
    def init_device(self, device: str | torch.device = "cpu") -> Iterator[torch.device]:
        """Build the model inside this: on ``meta`` (no init cost) when reattaching."""
        target = torch.device("meta") if self.resuming else torch.device(device)
        with target:
            yield target

    def retain(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        checkpoint: CheckpointConfig | None = None,
        grads: GradPlacement | None = None,
        mirror: tuple[tuple[str, int], ...] = (),
        stateful: Mapping[str, Any] | None = None,
        stateful_bytes: int | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> RetainedState:
        """Back parameters, gradients and optimizer state by retained pool memory.

        In a shadow this is where it waits, fully pre-initialised, until promotion.
        ``checkpoint`` (default: the job's ``leto.checkpoint``) keeps an asynchronous
        torch.distributed.checkpoint for fatal failures; a fresh start (no retained state,
        e.g. after a group restart) loads the newest one. ``grads``: gradients placed in an
        integration's own buffers (``RetainedState``); ``mirror``: its full parameter buffers
        when ``optimizer`` updates shards of them (``Layout.mirror_regions``).

        The optimizer's hyperparameters, module buffers and the LR schedulers built on
        ``optimizer`` before the training loop are retained too; ``stateful`` names other
        objects with ``state_dict()`` / ``load_state_dict()`` (a stateful data loader, a
        counter), retained with each step (``leto.trainer.extras``); ``stateful_bytes``: the
        size of each of their two record slots (default 1 MiB). ``scaler``: fp16 training's
        ``GradScaler``, retained and driven by ``state.step()`` (``leto.trainer.loss_scale``).
        """
        from leto.trainer import placement
        from leto.trainer.loss_scale import LossScale
        from leto.trainer.state import RetainedState

        if self._retained:  # a second model would be bound to the first one's regions
            raise ScriptError(
                "ctx.retain() was called a second time: leto retains one model and its "
                "optimizer per trainer; retain them together (several optimizers: "
                "leto.ChainedOptimizer([...]); other objects: ctx.retain(..., stateful=...))"
            )
        self._retained = True
        loss_scale = None if scaler is None else LossScale(scaler, optimizer)
        if loss_scale is not None:
            named = dict(stateful or {})
            if named.get(LossScale.NAME, scaler) is not scaler:
                raise ConfigError(
                    f"ctx.retain(stateful=...): the name {LossScale.NAME!r} is the scaler's"
                )
            stateful = {**named, LossScale.NAME: scaler}

        wait = self._wait_for_promotion if self.is_shadow else None
        if wait is not None and not self.env.holds_device:  # L1: before anything touches the device
            wait()
            wait = None
        plan = placement.plan(
            model,
            optimizer,
            env=self.env,
            device=self.device,
            world_size=self.world_size,
            grad_sync=self.grad_sync,
            grads=grads,
            mirror=mirror,
        )
        if plan.shards is not None:  # FSDP2 reduces its gradients in backward
            self.grad_sync = plan.shards.grad_sync()
        state = RetainedState(
            self.services(),
            plan,
            wait_for_promotion=wait,
            stateful=stateful,
            stateful_bytes=stateful_bytes,
            loss_scale=loss_scale,
        )
        self._install_heartbeat(model, optimizer)
        config = checkpoint or _checkpoint_from_env()
        if config is not None:
            from leto.trainer.checkpointing import checkpointer_for

            self.checkpointer = checkpointer_for(config, state)
            if not state.reattached:
                self.checkpointer.restore()
        # From now a killed trainer of this rank has state to recover in place from; not
        # before a checkpoint has loaded: one killed mid-load starts afresh (leto_run.policy).
        self.store.set(contract.retained(self.rank), "1")
        return state

    def committed(self, state: RetainedState) -> None:
        """Called by ``RetainedState`` after each committed step: heartbeat, checkpoint."""
        if self.heartbeat is not None:
            self.heartbeat.stepped()
        if self.checkpointer is not None:
            self.checkpointer.committed(state.marker.step)
            if self.heartbeat is not None:
                self.heartbeat.beat()

    def report_errors_to_agent(self) -> None:
        """An uncaught ``UnrecoverableStateError`` or ``DeviceUnhealthyError`` tells the agent
        before the trainer dies, so it is classified as a fatal failure (group restart from
        the checkpoint). A ``ConfigError`` (settings this job cannot run with) is handed to
        the agent, which ends the job with it as one line, without a traceback or restarts;
        a shadow (whose death the agent handles as a shadow's), or a trainer whose store
        cannot take it, prints that line itself."""
        previous = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            if issubclass(tp, ConfigError):
                # a shadow's is its own (the agent sees it die), not the job's to end
                if self.is_shadow or not self._tell_agent(
                    contract.config_error(self.rank), str(value)
                ):
                    print(f"leto-run: error: {' '.join(str(value).split())}", file=sys.stderr)
                return
            if issubclass(tp, (UnrecoverableStateError, DeviceUnhealthyError)):
                self._tell_agent(contract.fatal(self.rank), f"{tp.__name__}: {value}"[:500])
            previous(tp, value, tb)

        sys.excepthook = hook

    def _tell_agent(self, key: str, text: str) -> bool:
        """Set ``key`` in the job's store; False when the store cannot take it."""
        try:
            self.store.set(key, text[:2000])
        except Exception:  # noqa: BLE001 - the store is gone with the agent
            return False
        return True

    def finished(self) -> None:
        """Called by ``RetainedState.steps()`` after the last step (exit may take a while)."""
        if self.heartbeat is not None:
            self.heartbeat.finished()
        if self.checkpointer is not None:  # the job's last checkpoint completes before the exit
            self.checkpointer.close()
        if self.exits_cleanly:
            _CleanExit.arm()

    def _install_heartbeat(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Progress beats inside long phases: at ``BEATS_PER_PASS`` leaf modules spread over
        the forward, at as many gradients spread over the backward, around the update. Not
        at every module and gradient: each hook is a Python call on the step's host path
        (and a hooked module takes ``Module.__call__``'s slow path), which a host-bound step
        pays in full. The forward's beats go on ``leto.compiled.hook_sites``: none inside a
        compiled module."""
        hb = self.heartbeat
        if hb is None:
            return
        beat = compiled.opaque_hook(hb.beat)
        for module in spread(compiled.hook_sites(model), BEATS_PER_PASS):
            module.register_forward_pre_hook(beat)
        for p in spread([p for p in model.parameters() if p.requires_grad], BEATS_PER_PASS):
            p.register_post_accumulate_grad_hook(beat)
        optimizer.register_step_pre_hook(hb.beat)
        optimizer.register_step_post_hook(hb.beat)

    def wait_for_promotion(self) -> None:
        """Block a shadow until its generation is promoted; its process group exists afterwards.

        ``retain()`` does this for every shadow. An integration whose model construction
        needs the process group (Megatron's ``parallel_state``) calls it before building
        when the shadow has no group yet (levels 1 and 2): everything after it then runs at
        promotion. A no-op in an active or a promoted trainer."""
        if self.is_shadow:
            self._wait_for_promotion()

    def ready_to_map_ahead(self, timeout_s: float = 60.0) -> bool:
        """Whether a shadow may map the retained regions before its promotion: once they
        exist (the first actives initialised them; a shadow forked warm can get here
        first) and its predecessor has committed a step (a promoted predecessor may
        still be rebuilding lost pages, and a mapping made before could hold a chunk it is
        about to replace). False when this shadow is promoted first (its predecessor is
        gone: it maps at promotion) or on timeout."""
        return _after_predecessor_stepped(self.store, self.env, timeout_s, self.state_retained)

    def _wait_for_own_shadow(self, timeout_s: float = 300.0) -> None:
        """Until this rank's shadow waits for promotion (a fault that needs it ready); the
        heartbeat beats meanwhile: waiting on purpose is not a hang."""
        deadline = time.monotonic() + timeout_s
        while not self.preinit.shadow_ready():
            if self.preinit.shadows_given_up():
                logger.warning(
                    "[rank %d] the agent stopped relaunching shadows: none will be ready", self.rank
                )
                return
            if time.monotonic() > deadline:
                raise ProtocolError(
                    f"rank {self.rank}: no shadow became ready within {timeout_s:.0f} s"
                )
            if self.heartbeat is not None:
                self.heartbeat.beat()
            time.sleep(0.02)

    def _kill_own_shadow(self, timeout_s: float = 300.0) -> None:
        """SIGKILL this rank's ready shadow (``kind: kill_shadow``); return once the agent has
        retracted its readiness, so the next step cannot trust the dead one."""
        self._wait_for_own_shadow(timeout_s)
        pid = self.preinit.shadow_pid()
        if not pid:
            raise ProtocolError(f"rank {self.rank}: no ready shadow to kill")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while self.preinit.shadow_pid() == pid:
            if time.monotonic() > deadline:
                raise ProtocolError(
                    f"rank {self.rank}: the agent did not notice its shadow's death in {timeout_s:.0f} s"
                )
            if self.heartbeat is not None:
                self.heartbeat.beat()
            time.sleep(0.02)

    def _wait_for_promotion(self, on_ready: Callable[[], None] | None = None) -> None:
        """Say this shadow is ready, run ``on_ready`` (work that must not delay readiness
        nor wait for promotion), then wait for the agent's promotion."""
        env = self.env
        self.events.emit(
            Kind.SHADOW_READY,
            rank=env.rank,
            gen=env.generation,
            level=env.shadow_level,
            init_s=time.time() - self._started,
        )
        self.preinit.announce_ready(env.generation)
        if on_ready is not None:
            on_ready()
        key = contract.promote(
            env.generation, env.rank
        )  # set by this node's agent, after it stopped the actives
        while True:
            try:
                self.store.wait([key], _WAIT_SLICE)
                break
            except dist.DistStoreError as e:
                if "timeout" not in str(e).lower():
                    raise ProtocolError(
                        f"lost the agent's store while waiting as a shadow: {e}"
                    ) from None
        self.promoted_at = time.time()
        self.priority.restore()  # first: the rest of the promotion runs at the trainer's priority
        if self.device.type == "cuda" and not env.holds_device:
            torch.cuda.set_device(self.device)  # an L1 shadow's CUDA context starts now
        # The predecessor may have died of its device: never resume on one that computes
        # wrong (DeviceUnhealthyError is reported as fatal: a group restart, not a retry).
        check_s = check_device(
            self.device,
            pattern_bytes=(64 << 20) if self.device.type == "cuda" else (1 << 20),
            flip_bit=self._raw_store.check([self._device_fault_key]),
        )
        group_built = not dist.is_initialized()
        if group_built:
            self._build_group()
        self.events.emit(
            Kind.PROMOTED,
            rank=env.rank,
            gen=env.generation,
            level=env.shadow_level,
            device_check_s=round(check_s, 4),
            group_built=group_built,
        )


T = TypeVar("T")

BEATS_PER_PASS = 8
"""Heartbeats per forward and per backward pass (``Context._install_heartbeat``)."""


def spread(items: list[T], k: int) -> list[T]:
    """At most ``k`` of ``items``, evenly spaced from the first."""
    n = len(items)
    return [items[i * n // k] for i in range(k)] if n > k else items


def _after_predecessor_stepped(
    store: dist.Store,
    env: TrainerEnv,
    timeout_s: float,
    also: Callable[[], bool] = lambda: True,
) -> bool:
    """Wait until a shadow's predecessor, this rank's promoted trainer of the generation
    before (the first shadows have none), has committed a step and ``also()`` holds: True;
    False when this shadow is promoted first (its predecessor is gone) or on timeout."""
    stepped = contract.stepped(env.generation - 1, env.rank) if env.generation >= 2 else None
    promoted = contract.promote(env.generation, env.rank)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if also() and (stepped is None or store.check([stepped])):
            return True
        if store.check([promoted]):
            return False
        time.sleep(0.02)
    return False


REPLACEMENT_DEVICE_WAIT_S = 2.0
"""How long a replacement shadow waits for its promoted predecessor's first step before it
starts its device anyway (``init``): a longer first step is slowed the less by it."""


def _local_device(env: TrainerEnv) -> torch.device:
    if not torch.cuda.is_available():  # asks the driver for a count: no context is created
        return torch.device("cpu")
    device = torch.device("cuda", env.local_rank % torch.cuda.device_count())
    if env.holds_device:
        torch.cuda.set_device(device)
    return device


def _pick_backend(backend: str, ctx: Context) -> str:
    """auto: NCCL when every local rank has a GPU of its own, gloo otherwise (CPU, or
    several ranks sharing one GPU, where NCCL refuses duplicate devices)."""
    if backend != "auto":
        return backend
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ctx.device.type == "cuda" and local <= torch.cuda.device_count():
        return "nccl"
    return "gloo"


def init(backend: str = "auto", timeout_s: float = 300.0) -> Context:
    """Join the job; a shadow pre-initialises and returns (it waits in ``retain``).

    ``backend="auto"`` picks NCCL (one GPU per rank) or gloo (CPU, or shared GPUs).
    """
    t_entry = time.time()
    env = TrainerEnv.from_environ()
    _die_with_agent()
    if env.deterministic:  # before the script builds anything (leto.kernels)
        kernels.use_deterministic()
    raw = dist.TCPStore(
        env.master_addr, env.master_port, is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    base = dist.PrefixStore(contract.store_prefix(env.restart_count, env.job_token), raw)
    t_store = time.time()
    waited: dict[str, float] = {}
    if env.role == ROLE_SHADOW and env.holds_device and env.generation >= 2:
        # A replacement, spawned at a promotion, would start its device context and warm-ups
        # on the GPU where its predecessor re-runs the interrupted step: it starts after it.
        _after_predecessor_stepped(base, env, REPLACEMENT_DEVICE_WAIT_S)
        waited["device_wait_s"] = round(time.time() - t_store, 3)
    t_wait = time.time()
    ctx = Context(env, base, raw)
    ctx.exits_cleanly = True
    ctx.report_errors_to_agent()
    now = time.time()
    ctx.events.emit(
        Kind.TRAINER_STARTED,
        rank=env.rank,
        gen=env.generation,
        role=env.role,
        pid=os.getpid(),
        # where a start-up goes: the process until leto.init (interpreter, imports, the
        # script's top), the store, a replacement's wait, the context (the device's CUDA
        # context among it)
        before_init_s=round(t_entry - _process_start_t(), 3),
        store_s=round(t_store - t_entry, 3),
        context_s=round(now - t_wait, 3),
        **waited,
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    pg_store = dist.PrefixStore(contract.pg_prefix(env.generation, env.shadow_launch), base)
    backend = _pick_backend(backend, ctx)
    if backend == "nccl":
        ctx.collective_device = ctx.device

    def build_group() -> None:
        dist.init_process_group(
            backend,
            store=pg_store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=ctx.device if backend == "nccl" else None,  # eager communicator
        )

    ctx._build_group = build_group
    if env.role == ROLE_ACTIVE:
        build_group()
        base.set(contract.registered(env.generation, env.rank), str(os.getpid()))
        return ctx
    if env.role != ROLE_SHADOW:
        raise ProtocolError(f"unknown LETO_ROLE {env.role!r}")
    ctx.injector.shadow_launched()  # a test hook: a shadow that dies in its pre-initialisation
    # L1 warms PyTorch on the CPU only: no CUDA context, no device memory (leto.preinit).
    warm_up(ctx.device if env.holds_device else torch.device("cpu"))
    if env.shadow_level >= 3:
        build_group()
        dist.barrier()  # the communicator's connections are made now, not at recovery
    else:
        mesh_waits_for_promotion(ctx.wait_for_promotion)
    return ctx


def mesh_waits_for_promotion(wait_for_promotion: Callable[[], None]) -> None:
    """Below L3 a shadow has no process group, and torch's ``DeviceMesh`` (``init_device_mesh``,
    which an FSDP2 script calls before ``fully_shard``) would create one itself from torch's
    environment, over the agent's store: instead it waits for promotion there
    (``wait_for_promotion``, which builds the generation's group), and goes on from that
    point as a promoted trainer. Undone at its first use."""
    from torch.distributed import device_mesh

    torch_init = device_mesh.init_process_group

    def init_at_promotion(*args: Any, **kwargs: Any) -> None:
        if args or kwargs or dist.is_initialized():  # an explicit call: torch's own
            torch_init(*args, **kwargs)
            return
        device_mesh.init_process_group = torch_init
        wait_for_promotion()

    device_mesh.init_process_group = init_at_promotion


def _process_start_t() -> float:
    """When this process began (its fork), in ``time.time()`` seconds."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _checkpoint_from_env() -> CheckpointConfig | None:
    from leto.config import CheckpointConfig

    text = os.environ.get(ENV_CHECKPOINT)
    return CheckpointConfig(**json.loads(text)) if text else None


def _die_with_agent() -> None:
    """SIGKILL this trainer when its agent dies (``leto.lifetime``), as the agent's state
    manager does; exit now if it is already gone (re-parented to init or a subreaper).

    Otherwise a killed agent leaves trainers behind, blocked in collectives with the other
    nodes; dying with it breaks those collectives at once and the job fails cleanly.
    """
    from leto.lifetime import die_with_agent

    die_with_agent()


def warm_up(device: torch.device | None = None) -> None:
    """Pay PyTorch's lazy first-call costs (meta kernels, autograd, foreach AdamW) now.

    Measured on CPU: the first meta-device model build costs ~1 s and the first
    forward/backward/optimizer step ~0.3 s in a fresh process; a shadow pays them before
    any failure instead of during recovery. On a GPU this is also level 2: the CUDA
    context exists and cuBLAS (plain and bf16 autocast) has been called.
    """
    device = device or torch.device("cpu")
    with torch.device("meta"):
        torch.nn.Linear(8, 8)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU()).to(
        device
    )
    attn = torch.nn.MultiheadAttention(8, 2, batch_first=True).to(device)
    params = list(net.parameters()) + list(attn.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    x = torch.randn(2, 4, 8, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        h = net(x)
        out = attn(h, h, h, need_weights=False)[0].reshape(-1, 8)
    loss = torch.nn.functional.cross_entropy(
        out.float(), torch.zeros(8, dtype=torch.long, device=device)
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
    opt.step()
    check_device(device, pattern_bytes=1 << 20)  # its first call pays ~0.1 s of lazy init
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _CleanExit:
    """Leave a finished trainer without C++ static teardown.

    Seen here with torch 2.13 (and under plain torchrun too, about 1 run in 8 on a loaded
    2-core machine): a gloo worker that finished cleanly aborts during interpreter teardown
    with "terminate called without an active exception" (SIGABRT, no Python frame). The agent
    would take that for a failure. So once the training loop has finished, an atexit handler
    flushes and ``os._exit(0)``s — unless an exception escaped the script (then the exit
    stays the interpreter's, non-zero). A ``sys.exit(n)`` after the loop exits 0: the one
    behaviour this changes.
    """

    armed = False
    failed = False

    @classmethod
    def arm(cls) -> None:
        if cls.armed:
            return
        import atexit

        cls.armed = True
        previous = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
            cls.failed = True
            previous(tp, value, tb)

        sys.excepthook = hook
        atexit.register(cls._exit)

    @classmethod
    def _exit(cls) -> None:
        if cls.failed:
            return
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)
