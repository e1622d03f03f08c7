"""``leto-run``: torchrun's command line, plus Leto's options and the ``sim`` subcommand.

Launch arguments are parsed by torchrun's own parser (``torch.distributed.run``), extended
with an argument group ``leto``; the result goes through torchrun's ``config_from_args``
so the ``LaunchConfig`` is exactly the one torchrun would build. click is only the outer
shell that picks between a launch and ``leto-run sim``.

Bad input (job file, flags, a missing script) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import click

from leto.config import FaultSpec, LetoConfig, SettingError
from leto.errors import ConfigError, LetoError, StoreLostError
from leto.forkserver import ForkServer
from leto_run.jobfile import JobFile, launch_actions, load_jobfile

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

logger = logging.getLogger(__name__)

SIM_COMMAND = "sim"

LETO_FLAGS: dict[str, str] = {
    "--no-dashboard": "dashboard",
    "--events": "events_file",
    "--inject-fault": "faults",
    "--consistency": "consistency",
    "--shadow-level": "shadow_level",
    "--recovery": "recovery",
    "--digest": "digest",
    "--deterministic": "deterministic",
    "--hang-timeout": "hang_timeout_s",
    "--first-step-timeout": "first_step_timeout_s",
    "--no-warm-restarts": "warm_restarts",
    "--checkpoint-dir": "checkpoint.dir",
    "--checkpoint-every": "checkpoint.interval_steps",
    "--metrics-port": "metrics_port",
}
"""Each Leto flag and the :class:`LetoConfig` setting it overrides (a dotted path below
``leto:``; the flag's argparse dest is that path with ``_`` for ``.``). The one table behind
merging the flags into the job file's settings and naming, in an error, the flag a bad
value came from rather than its YAML key."""

_DESCRIPTION = """\
Leto: a drop-in replacement for torchrun with in-place recovery of failed trainers.
Every torchrun flag is accepted with torchrun's meaning; Leto's own options are in the
"leto" group below."""

_EPILOG = f"""\
job file (--config FILE):
  A YAML file with the sections
    launch:       torchrun options by their dest name (nproc_per_node: 2, standalone: true, ...)
    script:       the training script (or module, with launch.module: true)
    script_args:  its arguments (used only when the script comes from the file)
    leto:         Leto's settings (recovery, consistency, shadow_level, faults, ...)
  Precedence: command-line flags > PET_* environment variables > job file > defaults.
  --inject-fault specs are added to the job file's leto.faults.

subcommands:
  {SIM_COMMAND}   the failure/recovery simulator; see `leto-run {SIM_COMMAND} --help`.
        `leto-run {SIM_COMMAND} ...` runs it only when `{SIM_COMMAND}` is the first argument and no
        file or directory named `{SIM_COMMAND}` exists in the current directory. Otherwise,
        as with torchrun, `{SIM_COMMAND}` is the training script: a script named
        `{SIM_COMMAND}` is never shadowed (to reach the simulator, run leto-run from another
        directory)."""


def is_sim_invocation(argv: Sequence[str], cwd: str | None = None) -> bool:
    """True when ``argv`` asks for the simulator rather than for running a script named sim."""
    if not argv or argv[0] != SIM_COMMAND:
        return False
    return not os.path.lexists(os.path.join(cwd or os.getcwd(), SIM_COMMAND))


# ---------------------------------------------------------------------------- parser


def make_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser with Leto's ``leto`` group, one-line errors, our help."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "leto-run"
    parser.description = _DESCRIPTION
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.error = _parser_error  # type: ignore[method-assign]
    # The script may come from the job file instead of the command line.
    _action(parser, "training_script").nargs = "?"
    _add_leto_group(parser)
    return parser


def _add_leto_group(parser: argparse.ArgumentParser) -> None:
    """Leto's flags. Each defaults to None so that "not given" leaves the job file's value."""
    g = parser.add_argument_group("leto", "Leto's options (override the job file's leto section).")
    g.add_argument(
        "--version",
        action="version",
        version=_version(),
        help="Print leto-run's and torch's versions and exit.",
    )
    g.add_argument("--config", metavar="FILE", help="Job YAML (see 'job file' below).")
    g.add_argument(
        "--no-dashboard",
        dest="dashboard",
        action="store_const",
        const=False,
        help="Plain log lines instead of the live dashboard.",
    )
    g.add_argument(
        "--events",
        dest="events_file",
        metavar="FILE",
        help="Write the JSON-lines event stream to FILE.",
    )
    g.add_argument(
        "--inject-fault",
        dest="faults",
        action="append",
        metavar="SPEC",
        help="Kill a trainer, e.g. rank=1,step=5,phase=update (repeatable).",
    )
    g.add_argument(
        "--consistency",
        choices=_leto_choices("consistency"),
        help="Update consistency: snapshot (full pre-update copy) or rmu.",
    )
    g.add_argument(
        "--shadow-level",
        type=int,
        choices=_leto_choices("shadow_level"),
        help="Highest shadow pre-initialisation level: 1 = imports and model, 2 = + CUDA "
        "context, 3 = + process group (lowered on an OOM, raised back after recovery).",
    )
    g.add_argument(
        "--recovery",
        choices=_leto_choices("recovery"),
        help="in_place: promote shadows on failure; restart: torchrun's group restart.",
    )
    g.add_argument(
        "--digest",
        action="store_const",
        const=True,
        help="Emit a digest of all retained state after every step (exactness tests).",
    )
    g.add_argument(
        "--hang-timeout",
        dest="hang_timeout_s",
        type=float,
        metavar="S",
        help="Kill and recover a trainer that makes no progress for S seconds.",
    )
    g.add_argument(
        "--first-step-timeout",
        dest="first_step_timeout_s",
        type=float,
        metavar="S",
        help="The same limit until a trainer's first step (default 600).",
    )
    g.add_argument(
        "--no-warm-restarts",
        dest="warm_restarts",
        action="store_const",
        const=False,
        help="Start workers cold, as torchrun does (not from the warm fork server).",
    )
    g.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="Keep a torch.distributed.checkpoint here for fatal failures.",
    )
    g.add_argument(
        "--checkpoint-every",
        dest="checkpoint_interval_steps",
        type=int,
        metavar="N",
        help="Checkpoint every N steps (default: Young's interval for the FF rate).",
    )
    g.add_argument(
        "--deterministic",
        action="store_const",
        const=True,
        help="Deterministic kernels in every trainer: a recovered run is bit for bit a "
        "fault-free one (slower on GPUs; default: PyTorch's kernels, and a promoted "
        "trainer resumes from exactly the committed state).",
    )
    g.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="Serve Prometheus metrics at http://HOST:PORT/metrics on every node (0: a free port).",
    )


def _version() -> str:
    """``leto-run 0.1.0 (torch 2.13.0)``: the installed package's version and torch's."""
    import importlib.metadata

    import torch

    try:
        ours = importlib.metadata.version("leto")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        ours = "unknown"
    return f"leto-run {ours} (torch {torch.__version__})"


def _dest(setting: str) -> str:
    """The argparse dest of the flag for a :data:`LETO_FLAGS` setting."""
    return setting.replace(".", "_")


def _leto_choices(name: str) -> list[object]:
    """The choices of a ``Literal`` field of :class:`LetoConfig`, so flags and YAML agree."""
    return list(typing.get_args(typing.get_type_hints(LetoConfig)[name]))


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest)


def _parser_error(message: str) -> NoReturn:
    """argparse's error hook: a ConfigError, which main prints as one line."""
    raise ConfigError(message)


# ---------------------------------------------------------------------------- parsing


@dataclass(frozen=True, slots=True)
class Origins:
    """Where the values of one invocation came from, so that an error names a value as the
    user wrote it: the flag as typed, the ``PET_*`` variable, or the job file and key."""

    parser: argparse.ArgumentParser
    options: list[str]
    """The arguments before the training script: the launcher's own."""
    job_path: str | None = None
    job_launch: frozenset[str] = frozenset()
    """The ``launch:`` keys the job file sets."""
    job_faults: int = 0
    """How many of ``leto.faults`` come from the job file; the ``--inject-fault`` ones follow."""
    fault_texts: tuple[str, ...] = ()
    """The ``--inject-fault`` specs as typed."""

    def typed(self, dest: str) -> str | None:
        """The spelling of the option for ``dest`` in the arguments (the last one, whose
        value argparse keeps): exact, ``--opt=value`` or an abbreviation; None if absent."""
        action = _action(self.parser, dest)
        found = None
        for token in self.options:
            if token == "--":
                break
            name = token.split("=", 1)[0]
            if not name.startswith("-") or name == "-":
                continue
            exact = self.parser._option_string_actions.get(name)
            if exact is action or (
                exact is None
                and name.startswith("--")
                and any(o.startswith(name) for o in action.option_strings)
            ):
                found = name
        return found

    def launch(self, dest: str) -> str:
        """Where torchrun option ``dest`` came from (flags > ``PET_*`` > job file > default)."""
        from torch.distributed.argparse_util import check_env, env

        if (typed := self.typed(dest)) is not None:
            return typed
        action = _action(self.parser, dest)
        if isinstance(action, (env, check_env)) and f"PET_{dest.upper()}" in os.environ:
            return f"PET_{dest.upper()}"
        if dest in self.job_launch:
            return f"{self.job_path}: launch.{dest}"
        return max(action.option_strings, key=len)

    def leto(self, key: str) -> str:
        """Where the Leto setting ``key`` (``leto.hang_timeout_s``) came from."""
        setting = key.removeprefix("leto.")
        if setting in LETO_FLAGS.values() and (typed := self.typed(_dest(setting))) is not None:
            return typed
        return f"{self.job_path}: {key}" if self.job_path is not None else key

    def fault(self, index: int) -> str:
        """Where ``leto.faults[index]`` came from."""
        if index < self.job_faults:
            return f"{self.job_path}: leto.faults[{index}]"
        return f"--inject-fault {self.fault_texts[index - self.job_faults]!r}"


def parse_launch_args(argv: Sequence[str]) -> tuple[argparse.Namespace, LetoConfig]:
    """Parse ``argv`` merged with its job file: torchrun's namespace and Leto's settings."""
    args, leto, _ = _parse(argv)
    return args, leto


def _parse(argv: Sequence[str]) -> tuple[argparse.Namespace, LetoConfig, Origins]:
    """:func:`parse_launch_args`, and where each value came from."""
    argv = list(argv)
    parser = make_parser()
    args = parser.parse_args(argv)
    job = JobFile()
    if args.config is not None:
        job = load_jobfile(args.config, parser)
        parser.set_defaults(**_unset_by_env(job.launch, parser))
        args = parser.parse_args(argv)  # flags win over the job file's defaults
    script_tail = 0 if args.training_script is None else 1 + len(args.training_script_args)
    origins = Origins(
        parser=parser,
        options=argv[: len(argv) - script_tail],
        job_path=args.config,
        job_launch=frozenset(job.launch),
        job_faults=len(job.leto.faults),
        fault_texts=tuple(args.faults or ()),
    )
    if args.training_script is None:
        if job.script is None:
            raise ConfigError(
                "no training script: give one after the options or set 'script:' in the job file"
            )
        args.training_script = job.script
        args.training_script_args = list(job.script_args)
    return args, _merge_leto(job.leto, args, origins), origins


def _unset_by_env(launch: dict[str, object], parser: argparse.ArgumentParser) -> dict[str, object]:
    """Drop job-file values whose ``PET_*`` variable is set: the environment ranks above."""
    from torch.distributed.argparse_util import check_env, env

    actions = launch_actions(parser)
    return {
        dest: value
        for dest, value in launch.items()
        if not (isinstance(actions[dest], (env, check_env)) and f"PET_{dest.upper()}" in os.environ)
    }


def _merge_leto(base: LetoConfig, args: argparse.Namespace, origins: Origins) -> LetoConfig:
    """The job file's leto section with the given flags on top; faults are concatenated.

    A value out of range is named as it was given: ``--hang-timeout``, not
    ``leto.hang_timeout_s``, when the flag set it.
    """
    given = {
        setting: getattr(args, _dest(setting))
        for setting in LETO_FLAGS.values()
        if setting != "faults" and getattr(args, _dest(setting)) is not None
    }
    faults = [FaultSpec.parse(text) for text in origins.fault_texts]
    try:
        return _with_settings(base, given, [*base.faults, *faults], origins)
    except SettingError as e:
        raise ConfigError(f"{origins.leto(e.key)}: {e.detail}") from None


def _with_settings(
    base: LetoConfig, given: dict[str, object], faults: list[FaultSpec], origins: Origins
) -> LetoConfig:
    """``base`` with the settings ``given`` by dotted path; a section the job file leaves
    unset (``checkpoint``) is made from the flags, which must then give its required keys."""
    top: dict[str, object] = {k: v for k, v in given.items() if "." not in k}
    for section in dict.fromkeys(k.split(".")[0] for k in given if "." in k):
        fields = {k.split(".", 1)[1]: v for k, v in given.items() if k.startswith(f"{section}.")}
        current = getattr(base, section)
        if current is not None:
            top[section] = dataclasses.replace(current, **fields)
            continue
        cls = _section_class(section)
        for f in dataclasses.fields(cls):
            if f.name not in fields and f.default is dataclasses.MISSING:
                flags = " and ".join(origins.leto(f"leto.{section}.{k}") for k in fields)
                need = next(flag for flag, s in LETO_FLAGS.items() if s == f"{section}.{f.name}")
                raise ConfigError(
                    f"{flags} needs {need} (or leto.{section}.{f.name} in the job file)"
                )
        top[section] = cls(**fields)
    return dataclasses.replace(base, **top, faults=faults)


def _section_class(section: str) -> type:
    """The dataclass of an optional section of :class:`LetoConfig` (``checkpoint``)."""
    hint = typing.get_type_hints(LetoConfig)[section]
    return next(a for a in typing.get_args(hint) if dataclasses.is_dataclass(a))


def apply_torchrun_run_defaults(args: argparse.Namespace) -> None:
    """Mirrors ``torch.distributed.run.run()`` (torch 2.13) up to ``config_from_args``.

    --standalone means c10d on localhost:0 with a fresh uuid run id; a static single-node
    job without an endpoint or master port does the same; master_port defaults to 29500.
    Keep in step with torch's function when torch is upgraded.
    """
    from torch.distributed.run import parse_min_max_nnodes

    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
        logger.info(
            "Rendezvous info: --rdzv-backend=%s --rdzv-endpoint=%s --rdzv-id=%s",
            args.rdzv_backend,
            args.rdzv_endpoint,
            args.rdzv_id,
        )
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _check_script_exists(args: argparse.Namespace) -> None:
    """Fail before launching when the script is a path that does not exist."""
    if args.module or args.no_python or os.path.exists(args.training_script):
        return
    raise ConfigError(
        f"training script {args.training_script!r} does not exist (cwd: {os.getcwd()})"
    )


def _check_nnodes(nnodes: str, origins: Origins) -> None:
    """torchrun raises a bare ValueError for a malformed --nnodes; name the flag instead."""
    from torch.distributed.run import parse_min_max_nnodes

    where = origins.launch("nnodes")
    try:
        lo, hi = parse_min_max_nnodes(nnodes)
    except (ValueError, RuntimeError):
        raise ConfigError(f"{where} {nnodes!r}: expected N or MIN:MAX, e.g. 2 or 1:4") from None
    if not 0 < lo <= hi:
        raise ConfigError(f"{where} {nnodes!r}: needs 1 <= MIN <= MAX")


def _check_launch_values(args: argparse.Namespace, origins: Origins) -> int:
    """torchrun asserts on these deep inside its agent (a traceback); refuse them up front.
    Returns the number of workers per node."""
    from torch.distributed.run import determine_local_world_size

    where = origins.launch("nproc_per_node")
    try:
        nproc = determine_local_world_size(args.nproc_per_node)
    except ValueError as e:
        raise ConfigError(
            f"{where}: expected a number of workers per node, or auto, cpu, gpu; got "
            f"{args.nproc_per_node!r} ({e})"
        ) from None
    if nproc < 1:
        raise ConfigError(f"{where}: must be >= 1 (workers per node), got {nproc}")
    if args.max_restarts < 0:
        raise ConfigError(
            f"{origins.launch('max_restarts')}: must be >= 0, got {args.max_restarts}"
        )
    return nproc


def _check_events_file(leto: LetoConfig, origins: Origins) -> None:
    """The agent opens the events file only after the launch; a path it cannot create is
    refused before."""
    path = leto.events_file
    if path is None:
        return
    where = origins.leto("leto.events_file")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{where}: {path!r} is a directory; give a file path")
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ConfigError(f"{where}: cannot create {path!r}: directory {parent!r} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: cannot create {path!r}: directory {parent!r} is not writable")


def _check_faults_can_fire(leto: LetoConfig, nnodes: str, nproc: int, origins: Origins) -> None:
    """A fault at a rank the job never has is refused: it would be ignored, and a test or
    demo that relies on it would pass without its failure. Checked when the node count is
    fixed (the world size is then nnodes x nproc_per_node)."""
    from torch.distributed.run import parse_min_max_nnodes

    min_nodes, max_nodes = parse_min_max_nnodes(nnodes)
    if min_nodes != max_nodes:
        return
    world = max_nodes * nproc
    for i, fault in enumerate(leto.faults):
        if fault.rank >= world:
            raise ConfigError(
                f"{origins.fault(i)}: rank {fault.rank} never exists: the job has {world} ranks "
                f"(0..{world - 1}: {max_nodes} node(s) x {nproc} per node)"
            )


def parse_launch(argv: Sequence[str]) -> tuple[argparse.Namespace, LetoConfig]:
    """``leto-run ARGV`` parsed and checked, without torch: ``-h`` and every error a user can
    cause end here, before anything starts."""
    args, leto, origins = _parse(argv)
    _check_script_exists(args)
    _check_nnodes(args.nnodes, origins)
    nproc = _check_launch_values(args, origins)
    _check_events_file(leto, origins)
    _check_faults_can_fire(leto, args.nnodes, nproc, origins)
    return args, leto


def launch_config(
    args: argparse.Namespace,
) -> tuple[LaunchConfig, Callable[..., object] | str, list[str]]:
    """torchrun's config, cmd and args for parsed arguments (``parse_launch``)."""
    from torch.distributed.run import config_from_args

    try:
        apply_torchrun_run_defaults(args)
        return config_from_args(args)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ConfigError(f"invalid launch options: {e}") from None


def build_launch(
    argv: Sequence[str],
) -> tuple[LaunchConfig, Callable[..., object] | str, list[str], LetoConfig]:
    """All of ``leto-run ARGV`` short of launching: torchrun's config, cmd, args, and Leto's.

    Every value that could only fail after the launch is checked here first.
    """
    args, leto = parse_launch(argv)
    return (*launch_config(args), leto)


# ---------------------------------------------------------------------------- entry


def _launch(argv: Sequence[str]) -> None:
    """Build the launch and hand it to Leto's agent; recorded like torchrun's main."""
    args, leto = parse_launch(argv)  # before torch: -h, errors
    # Before torch and before any thread of ours: the fork server's import of torch runs
    # while this process imports its own.
    forkserver = ForkServer() if leto.warm_restarts else None
    try:
        import torch
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

        config, cmd, cmd_args = launch_config(args)

        from leto_run.launch import launch

        torch.multiprocessing._set_thread_name("pt_elastic")  # as torch.distributed.run.run
        from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

        try:
            record(launch)(config, cmd, cmd_args, leto, forkserver)
        except ChildFailedError as e:  # torchrun's exit code, with torch's failure report
            print(e.format_msg(), file=sys.stderr)
            sys.exit(1)
        except RendezvousConnectionError as e:  # torch's rendezvous met the same loss first
            _die(str(StoreLostError(config.rdzv_endpoint, e.__cause__ or e)), code=1)
    finally:
        if forkserver is not None:
            forkserver.close()


def _run_sim(argv: Sequence[str]) -> None:
    """``leto-run sim ...``: hand the rest of the arguments to the simulator's click command."""
    try:
        from leto_run.sim_cmd import main as sim_main
    except ImportError as e:
        _die(f"the '{SIM_COMMAND}' subcommand is not available: {e}", code=2)
    sim_main(argv, prog_name=f"leto-run {SIM_COMMAND}")


def _die(message: str, *, code: int) -> NoReturn:
    """One line on stderr, then exit: how every error a user can cause ends."""
    print(f"leto-run: error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(code)


class _RawArgsCommand(click.Command):
    """A click command that keeps its arguments untouched (``--`` included) for argparse."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.args = list(args)
        return ctx.args


@click.command(
    cls=_RawArgsCommand,
    name="leto-run",
    add_help_option=False,
    context_settings={
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "help_option_names": [],
    },
)
@click.pass_context
def _leto_run(ctx: click.Context) -> None:
    """Dispatch: ``sim`` subcommand, or a torchrun-style launch (help: ``leto-run --help``)."""
    argv: list[str] = ctx.args
    try:
        if is_sim_invocation(argv):
            _run_sim(argv[1:])
        else:
            _launch(argv)
    except ConfigError as e:
        _die(str(e), code=2)
    except LetoError as e:
        _die(str(e), code=1)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``leto-run`` (``argv`` defaults to ``sys.argv[1:]``)."""
    _leto_run.main(args=list(argv) if argv is not None else None, prog_name="leto-run")
