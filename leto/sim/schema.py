"""Build validated config dataclasses from YAML/JSON mappings, with one-line errors.

Every scenario dataclass is ``kw_only`` and checks its own ranges in ``__post_init__``
(raising ``ValueError``); this module walks the type hints, rejects unknown keys and turns
any problem into a :class:`~leto.errors.ConfigError` that names the file and the key path,
e.g. ``configs/sim/x.yaml: failures.mttf_min: must be > 0, got -1``.
"""

from __future__ import annotations

import dataclasses
import logging
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

from leto.config import read_yaml, unknown_key
from leto.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")


def read_mapping(path: Path, what: str = "file") -> dict[str, Any]:
    """Parse the YAML (or JSON, a YAML subset) at ``path`` into a mapping; ``what`` names
    the file in errors."""
    data = read_yaml(path, what)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at top level, got {type(data).__name__}")
    return data


def build(cls: type[T], data: Any, *, where: str, key: str = "") -> T:
    """Instantiate dataclass ``cls`` from ``data``; ``where`` is the file, ``key`` the path."""
    prefix = f"{where}: {key}: " if key else f"{where}: "
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}expected a mapping, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(f"{prefix}{unknown_key(unknown[0], names)}")
    kwargs = {
        name: _convert(hints[name], value, where=where, key=_join(key, name))
        for name, value in data.items()
    }
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        missing = str(e).split("argument")[-1].strip(": '")
        raise ConfigError(f"{prefix}missing required key {missing!r}") from None
    except ValueError as e:
        raise ConfigError(f"{prefix}{e}") from None


def _convert(hint: Any, value: Any, *, where: str, key: str) -> Any:
    """Check ``value`` against the type ``hint`` and convert nested dataclasses and lists."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, where=where, key=key)
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{where}: {key}: must be one of {choices}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: {key}: expected a list, got {_kind(value)}")
        return [_convert(args[0], v, where=where, key=f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: {key}: expected a mapping, got {_kind(value)}")
        return {
            str(k): _convert(args[1], v, where=where, key=f"{key}.{k}") for k, v in value.items()
        }
    if dataclasses.is_dataclass(hint):
        return build(hint, value, where=where, key=key)
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    raise ConfigError(f"{where}: {key}: expected {hint.__name__}, got {_kind(value)} {value!r}")


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def check(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition``; used by ``__post_init__``."""
    if not condition:
        raise ValueError(message)
