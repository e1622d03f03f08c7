"""Launch one node's agent: torch's ``launch_agent`` with a LetoAgent in it.

Mirrors ``torch.distributed.launcher.api.launch_agent`` (rendezvous parameters, worker
spec, error propagation through ``ChildFailedError``) so exit codes and error files are
torchrun's; the differences are the agent class, Leto's event log and the dashboard.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from typing import Any

from torch.distributed.elastic import events as elastic_events
from torch.distributed.elastic import rendezvous as _rendezvous  # noqa: F401  (registers backends)
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port, _get_entrypoint_name

from leto.config import LetoConfig
from leto.errors import ConfigError
from leto.events import EventLog, Kind
from leto.forkserver import ForkServer
from leto.lifetime import ENV_AGENT_PID, sweep_leftovers
from leto_run.agent import GenerationLogsSpecs, LetoAgent
from leto_run.metrics import MetricsServer

logger = logging.getLogger(__name__)


def _logs_specs(config: LaunchConfig) -> GenerationLogsSpecs:
    given = config.logs_specs
    if given is not None and not isinstance(given, DefaultLogsSpecs):
        raise ConfigError(
            f"leto-run supports torchrun's default logs specs, not {type(given).__name__}"
        )
    root = given.root_log_dir if given is not None else None
    return GenerationLogsSpecs(
        log_dir=root,
        redirects=given._redirects if given is not None else None,
        tee=given._tee if given is not None else None,
        local_ranks_filter=given._local_ranks_filter if given is not None else None,
    )


def launch(
    config: LaunchConfig,
    entrypoint: str,
    args: list[str],
    leto: LetoConfig,
    forkserver: ForkServer | None = None,
) -> dict[int, Any]:
    """Run this node's share of the job; raises ``ChildFailedError`` as torchrun does.
    ``forkserver``: the caller's, started before anything else (the caller closes it);
    workers start from it (None: cold, as torchrun's)."""
    if os.getenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        raise ConfigError(
            "leto-run needs the agent's shared store; unset TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
        )
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    # Every child inherits it and dies with this process (leto.lifetime), also under a
    # subreaper; what an earlier job's killed agent left behind is removed.
    os.environ[ENV_AGENT_PID] = str(os.getpid())
    sweep_leftovers()
    logs_specs = _logs_specs(config)
    events_path = leto.events_file or os.path.join(
        logs_specs.root_log_dir if logs_specs.root_log_dir != os.devnull else tempfile.gettempdir(),
        f"leto-events-{config.run_id}.jsonl",
    )
    # A reused events file: this job's summary starts at its current end.
    events_offset = os.path.getsize(events_path) if os.path.exists(events_path) else 0
    events = EventLog(events_path, source="agent")
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(rdzv_parameters)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
        max_restarts=config.max_restarts,
        # Leto polls at least every poll_interval_s: a dead trainer is seen within it.
        monitor_interval=min(config.monitor_interval, leto.poll_interval_s),
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
    )
    agent = LetoAgent(
        spec,
        logs_specs,
        leto,
        events,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
    )
    agent.forkserver = forkserver
    events.emit(
        Kind.AGENT_STARTED,
        entrypoint=_get_entrypoint_name(entrypoint, args),
        nproc=config.nproc_per_node,
    )
    from leto_run.dashboard import Dashboard

    dashboard = Dashboard(events_path, enabled=leto.dashboard, offset=events_offset)
    shutdown_rdzv = True
    dashboard.start()
    metrics = MetricsServer(
        events,
        leto.metrics_port,
        node_rank=lambda: agent.get_worker_group().group_rank,
        offset=events_offset,
    )
    try:
        metrics.start()  # a port in use ends the job here, as any launch error does
        result = agent.run()
        elastic_events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed() and agent.config_error is not None:
            raise ConfigError(agent.config_error)  # one line (leto-run's exit 2), no report
        if result.is_failed():
            raise ChildFailedError(
                name=_get_entrypoint_name(entrypoint, args), failures=result.failures
            )
        events.emit(
            Kind.JOB_FINISHED, ok=True, recoveries=agent.recoveries, restarts=agent.restarts
        )
        return result.return_values
    except ChildFailedError:
        events.emit(
            Kind.JOB_FINISHED, ok=False, recoveries=agent.recoveries, restarts=agent.restarts
        )
        raise
    except Exception as e:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if isinstance(e, SignalException):
            shutdown_rdzv = False
        events.emit(
            Kind.JOB_FINISHED,
            ok=False,
            recoveries=agent.recoveries,
            restarts=agent.restarts,
            error=type(e).__name__,
        )
        elastic_events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        dashboard.stop()
        metrics.stop()
        events.close()
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
