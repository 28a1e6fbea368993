"""Strict mapping <-> dataclass conversion for recipes.

Every recipe section is a dataclass; this module turns nested YAML mappings into those
dataclasses and back, and applies ``a.b.c=value`` command-line overrides. It is strict by
design (STYLE.md, habit 2): an unknown key or a value of the wrong type is a
:class:`ConfigError` that names the full key path and, for unknown keys, suggests the
closest valid one. Every float field refuses nan and infinities here, once for all sections.
Validation of other *values* lives in each dataclass's ``__post_init__``.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import types
import typing
from typing import Any, Literal, Mapping, get_args, get_origin, get_type_hints

import yaml

__all__ = [
    "ConfigError",
    "from_mapping",
    "to_mapping",
    "apply_override",
    "parse_override",
    "field_docs",
]


class ConfigError(ValueError):
    """A recipe or command-line configuration problem. The CLI exits with code 2 on it."""

    exit_code = 2


def _suggest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(valid))}"


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert ``value`` to type ``tp``; raise ConfigError naming ``path`` when impossible."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Union or origin is types.UnionType:
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        if len(errors) == 1:  # Optional[X]: X's own message says what is wrong (e.g. not finite)
            raise ConfigError(errors[0])
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{path}: {value!r} is not one of {list(choices)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
            items = [_convert(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args))]
        else:
            item_tp = args[0] if args else Any
            items = [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {_convert(k, key_tp, path): _convert(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_mapping(tp, value, path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        try:
            return tp(value)
        except ValueError:
            raise ConfigError(f"{path}: {value!r} is not one of {[m.value for m in tp]}") from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(number):
            # One place for every float field of every section: nan/inf never reach a run.
            raise ConfigError(f"{path}: must be a finite number, got {value!r}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported field type {_type_name(tp)}")


def from_mapping(cls: type, data: Mapping[str, Any] | None, path: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types are errors."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or cls.__name__}: expected a mapping, got {data!r}")
    resolve = getattr(cls, "resolve_schema", None)  # a base whose subclass the mapping selects (model.family)
    if resolve is not None:
        cls = resolve(data, path or "model")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in fields:
            raise ConfigError(f"unknown key '{key_path}'{_suggest(str(key), list(fields))}")
        kwargs[key] = _convert(value, hints[key], key_path)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if path and not str(exc).startswith(path):
            raise ConfigError(f"{path}.{exc}") from None
        raise


def to_mapping(obj: Any) -> Any:
    """Inverse of :func:`from_mapping`: plain YAML-safe values (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_mapping(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_mapping(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``section.key=value`` into a key path and a YAML-parsed value."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like section.key=value")
    key, raw = text.split("=", 1)
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
        where = f" at column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"override '{text}': value is not valid YAML{where} ({problem or ' '.join(str(exc).split())}); "
                          "quote it or fix the brackets") from None
    return keys, value


def apply_override(tree: dict, text: str) -> None:
    """Apply one ``a.b.c=value`` override to a nested mapping in place."""
    keys, value = parse_override(text)
    node = tree
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{text}': '{'.'.join(keys[: depth + 1])}' is not a section")
        node = child
    node[keys[-1]] = value


def field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal under each field), for `--help`-style listings."""
    import ast
    import inspect
    import textwrap

    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    tree = ast.parse(source)
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                if isinstance(nxt.value.value, str):
                    docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
