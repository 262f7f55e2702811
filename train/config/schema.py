"""Strict config schemas: dataclasses filled from YAML data and ``key=value`` overrides.

Every key is checked: an unknown key is an error that names the accepted ones (with a close match when
there is one), a value of the wrong type is an error that names the expected type. Shared by the image
trainer (``train.config.sections``) and the sequence benchmark (``benchmarks.seq1d.config``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union

import yaml

Hooks = dict[type, Callable[[Any, str], Any]] | None


class ConfigError(ValueError):
    """A config file or override is invalid; the message says what is wrong and what is accepted."""


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def convert(value: Any, tp: Any, where: str, hooks: Hooks = None) -> Any:
    """Check ``value`` against type ``tp`` and return it in that type (dataclasses built recursively)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return convert(value, a, where, hooks)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{where}: expected {type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool):
            raise ConfigError(f"{where}: {value!r} is not accepted; accepted: {', '.join(map(str, choices))}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list of {type_name(item_tp)}, got {value!r}")
        return [convert(v, item_tp, f"{where}[{i}]", hooks) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{where}: expected a mapping with string keys, got {value!r}")
        return copy.deepcopy(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where, hooks)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an int, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp!r}")  # a schema bug, not a user error


def from_dict(cls: type, data: Any, where: str, hooks: Hooks = None) -> Any:
    """Build dataclass ``cls`` from a mapping: unknown keys and missing required keys are errors.

    ``hooks`` maps a dataclass to a function ``(data, where) -> data`` run first (e.g. a short string form).
    """
    if hooks and cls in hooks:
        data = hooks[cls](data, where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        k = unknown[0]
        close = difflib.get_close_matches(str(k), fields, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown config key {prefix}{k}{hint}; accepted keys{' in ' + where if where else ''}: {', '.join(fields)}"
        )
    kwargs = {}
    for name, f in fields.items():
        key = f"{where}.{name}" if where else name
        if name in data:
            kwargs[name] = convert(data[name], hints[name], key, hooks)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key {key}")
    return cls(**kwargs)


def field_type(root: type, path: list[str]) -> Any:
    """The declared type at a dotted path of ``root``'s schema; unknown keys are errors."""
    tp: Any = root
    for i, part in enumerate(path):
        if not dataclasses.is_dataclass(tp):
            raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[:i])} has no sub-keys")
        hints = typing.get_type_hints(tp)
        if part not in hints:
            where = ".".join(path[:i]) or "the top level"
            close = difflib.get_close_matches(part, hints, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown config key {'.'.join(path)}{hint}; accepted keys in {where}: {', '.join(hints)}"
            )
        tp = hints[part]
    return tp


def parse_override_value(raw: str, tp: Any) -> Any:
    """A CLI value: strings stay strings for str fields, everything else is read as YAML."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp) if origin in (Union, types.UnionType) else (tp,)
    if raw.lower() in ("null", "none", "~") and type(None) in args:
        return None
    if str in args:
        return raw
    value = yaml.safe_load(raw) if raw else None
    return value


def apply_overrides(root: type, data: dict[str, Any], overrides: list[str], hooks: Hooks = None) -> dict[str, Any]:
    """Apply ``a.b=value`` strings to raw config data (type checks happen when the schema is filled)."""
    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: write key=value, e.g. train.lr=1e-3")
        key, raw = item.split("=", 1)
        if not key.strip():
            raise ConfigError(f"override {item!r}: no key before '='; write key=value, e.g. train.lr=1e-3")
        path = key.strip().split(".")
        tp = field_type(root, path)
        try:
            value = parse_override_value(raw.strip(), tp)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or type(e).__name__
            raise ConfigError(f"override {item!r}: {raw.strip()!r} is not a YAML value ({problem}); "
                              f"expected {type_name(tp)}") from None
        try:
            convert(value, tp, key, hooks)
        except ConfigError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            node = child
        node[path[-1]] = value
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML config file's top-level mapping, with errors that name the file."""
    path = Path(path)
    if path.is_dir():
        own = path / "config.yaml"  # a run folder keeps the config that made it
        hint = f", e.g. {own} (the run folder's own config)" if own.is_file() else " (see configs/)"
        raise ConfigError(f"config file {path} is a folder; give a YAML file{hint}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return data
