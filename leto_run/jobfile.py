"""The job YAML behind ``leto-run --config FILE``.

A job file holds data only: torchrun's options under ``launch`` (by their argparse
``dest`` names, e.g. ``nproc_per_node: 2``), the training script and its arguments, and
Leto's own settings under ``leto``. Every key is checked, so a typo is a one-line
:class:`~leto.errors.ConfigError` naming the key and the file, never a stack trace::

    launch:
      nproc_per_node: 2
      max_restarts: 0
      standalone: true
    script: examples/train_gpt.py
    script_args: [--steps, "50"]
    leto:
      consistency: rmu
      faults: [{rank: 1, step: 5, phase: update}]

The ``launch`` values become the launch parser's defaults, so command-line flags win.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from leto.config import LetoConfig, closest, from_dict, read_yaml
from leto.errors import ConfigError

# Parser destinations that are not torchrun launch options: the job file spells the
# script and its arguments as top-level ``script``/``script_args``, Leto's options go
# under ``leto``.
_NOT_LAUNCH_KEYS = frozenset({"help", "training_script", "training_script_args"})

_TOP_LEVEL_KEYS = ("launch", "script", "script_args", "leto")


@dataclass(kw_only=True, slots=True)
class JobFile:
    """One job YAML, validated: torchrun options, the script and Leto's settings."""

    launch: dict[str, Any] = field(default_factory=dict)
    """torchrun options by argparse dest (``nproc_per_node``, ``rdzv_backend``, ``module``, ...)."""
    script: str | None = None
    """Training script (or module with ``module: true``); a script on the command line wins."""
    script_args: list[str] = field(default_factory=list)
    """Arguments of the script; used only when the script itself comes from this file."""
    leto: LetoConfig = field(default_factory=LetoConfig)
    """Leto's settings; ``leto-run`` flags such as ``--consistency`` override them."""


def launch_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The torchrun options a job file may set, by dest name (Leto's group excluded)."""
    leto_dests = {
        a.dest for g in parser._action_groups if g.title == "leto" for a in g._group_actions
    }
    return {
        a.dest: a
        for a in parser._actions
        if a.dest not in _NOT_LAUNCH_KEYS and a.dest not in leto_dests
    }


def load_jobfile(path: str | Path, parser: argparse.ArgumentParser) -> JobFile:
    """Read and validate the job YAML at ``path``; ``parser`` defines the legal launch keys."""
    data = _read_yaml(Path(path))
    where = str(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at top level, got {type(data).__name__}")
    unknown = [k for k in data if k not in _TOP_LEVEL_KEYS]
    if unknown:
        guess = closest(unknown[0], _TOP_LEVEL_KEYS)
        hint = f"did you mean {guess!r}?" if guess else f"known: {', '.join(_TOP_LEVEL_KEYS)}"
        raise ConfigError(f"{where}: unknown top-level key {unknown[0]!r} ({hint})")
    return JobFile(
        launch=_check_launch(data.get("launch") or {}, launch_actions(parser), where=where),
        script=_check_script(data.get("script"), where=where),
        script_args=_check_script_args(data.get("script_args") or [], where=where),
        leto=from_dict(LetoConfig, data.get("leto") or {}, where=where, key="leto"),
    )


def _read_yaml(path: Path) -> Any:
    """Parse ``path``; YAML syntax errors become one line with the line and column."""
    return read_yaml(path, what="config file")


def _check_launch(
    launch: Any, actions: dict[str, argparse.Action], *, where: str
) -> dict[str, Any]:
    """Validate the ``launch`` mapping against torchrun's options; return parser defaults."""
    if not isinstance(launch, dict):
        raise ConfigError(f"{where}: launch: expected a mapping, got {type(launch).__name__}")
    out: dict[str, Any] = {}
    for key, value in launch.items():
        action = actions.get(key)
        if action is None:
            raise ConfigError(f"{where}: launch: unknown key {key!r}{_launch_hint(key, actions)}")
        out[key] = _launch_value(action, value, where=f"{where}: launch.{key}")
    return out


def _launch_hint(key: Any, actions: dict[str, argparse.Action]) -> str:
    """What an unknown ``launch`` key should have been."""
    if key in _NOT_LAUNCH_KEYS:
        return " (write script/script_args at top level)"
    if key in LetoConfig.__dataclass_fields__:
        return " (a Leto setting: write it under leto:)"
    guess = closest(key, actions)
    if guess is not None:
        return f"; did you mean {guess!r}?"
    return (
        "; keys are torchrun options by their dest name, e.g. nproc_per_node, max_restarts, "
        "rdzv_backend"
    )


def _launch_value(action: argparse.Action, value: Any, *, where: str) -> Any:
    """Convert one YAML value to what argparse would store for the same flag."""
    if action.nargs == 0:  # a switch such as --standalone or -m
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: expected a single value, got {value!r}")
    text = str(value)
    if action.choices is not None and text not in action.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    if action.type is None:
        return text
    try:
        return action.type(text)
    except (TypeError, ValueError):
        name = getattr(action.type, "__name__", "value")
        raise ConfigError(f"{where}: expected {name}, got {value!r}") from None


def _check_script(script: Any, *, where: str) -> str | None:
    if script is not None and not isinstance(script, str):
        raise ConfigError(f"{where}: script: expected a path, got {script!r}")
    return script


def _check_script_args(args: Any, *, where: str) -> list[str]:
    """Script arguments must be a list; numbers are allowed and passed on as text."""
    if not isinstance(args, list):
        raise ConfigError(f"{where}: script_args: expected a list, got {type(args).__name__}")
    for i, arg in enumerate(args):
        if isinstance(arg, bool) or not isinstance(arg, (str, int, float)):
            raise ConfigError(f"{where}: script_args[{i}]: expected a string, got {arg!r}")
    return [str(a) for a in args]
