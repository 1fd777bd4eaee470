"""One line per configuration error, naming the key and what it allows: Hydra's and
OmegaConf's exceptions reworded (from their attributes where they carry them: the
OmegaConf key, Hydra's missing option), and the messages for unknown keys."""
from __future__ import annotations

import difflib
import re
import types
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from pipeline.config.schema import Blocks, arguments, first_line
from pipeline.errors import ConfigError


def compose_error(exc: BaseException, overrides: Sequence[str], conf: Path, schema: type) -> ConfigError:
    """Hydra's composition failure as a ConfigError."""
    from hydra.errors import MissingConfigException

    msg = str(exc)
    # model=cnnn: Hydra names the missing option (group/option) in its message and lists none we can use
    m = re.search(r"Could not find '([^']+)/([^'/]+)'", msg) if isinstance(exc, MissingConfigException) else None
    if m:
        group, option = m.group(1), m.group(2)
        options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
        return ConfigError(
            f"{group}={option}: no such option in config group '{group}'; allowed: {', '.join(options)}"
            + did_you_mean(option, options)
        )
    # optimizer.lrr=1: "Could not override 'optimizer.lrr'" with a ConfigKeyError cause
    m = re.search(r"Could not (?:override|append to) '([^']+)'", msg)
    if m:
        key = m.group(1)
        override = next((o for o in overrides if o.lstrip("+~").split("=", 1)[0] == key), key)
        cause = exc.__cause__ or exc.__context__
        if cause is not None and "not in struct" not in str(cause) and "not found" not in str(cause).lower():
            return ConfigError(f"override '{override}': {first_line(cause)}")
        return ConfigError(f"override '{override}': {unknown_key_message(key, schema)}")
    if "ParseException" in type(exc).__name__ or "Error parsing override" in msg:
        return ConfigError(f"cannot parse the overrides {list(overrides)}: {first_line(exc)} (Hydra grammar: key=value, group=option, +key=value)")
    return ConfigError(f"cannot compose conf/ with overrides {list(overrides)}: {first_line(exc)}")


def schema_error(exc, schema: type) -> ConfigError:
    """An OmegaConf merge or build error as one line naming the key and what it allows."""
    from omegaconf.errors import ConfigKeyError, MissingMandatoryValue

    key = str(getattr(exc, "full_key", "") or "")
    if isinstance(exc, ConfigKeyError):
        return ConfigError(unknown_key_message(key, schema))
    tp = field_type(schema, key)
    if isinstance(exc, MissingMandatoryValue):
        return ConfigError(f"{key}: missing; expected {describe(tp) if tp is not None else 'a value'} (conf/ sets every key: "
                           "regenerate params.yaml with `python -m pipeline.config --write`)")
    if tp is None:
        return ConfigError(f"{key or 'configuration'}: {first_line(exc)}")
    value = getattr(exc, "value", None) if hasattr(exc, "value") else None
    value = _offending_value(exc) if value is None else value
    shown = f"={value!r}" if value is not None else ""
    return ConfigError(f"{key}{shown}: expected {describe(tp)}")


def unknown_key_message(key: str, schema: type) -> str:
    parts = key.split(".")
    parent_key = ".".join(parts[:-1])
    blocks = _blocks_at(schema, parent_key)
    if blocks is not None:
        return unknown_block_key(key, blocks)
    parent = field_type(schema, parent_key) if parent_key else schema
    if parent is not None and is_dataclass(parent):
        allowed = sorted(f.name for f in fields(parent))
        where = f"'{parent_key}'" if parent_key else "the top level"
        return f"unknown key '{key}'; {where} takes: {', '.join(allowed)}" + did_you_mean(parts[-1], allowed, prefix=parent_key)
    return f"unknown key '{key}'"


def unknown_block_key(key: str, blocks: Blocks, target: str | None = None) -> str:
    """A key a block node does not take: what its target takes (or every allowed target, when
    the node's target is not known), and which targets take the key if any do."""
    parent_key, _, arg = key.rpartition(".")
    takes = {name: arguments(cls) for name, cls in blocks.classes().items()}
    owners = [name for name, args in takes.items() if arg in args]
    if target is not None:
        hint = (f" ('{arg}' is an argument of {' and '.join(owners)} only)" if owners
                else did_you_mean(arg, takes[target], prefix=parent_key))
        return f"unknown key '{key}'; {target} takes: {', '.join(takes[target])}" + hint
    union = sorted({a for args in takes.values() for a in args})
    listed = "; ".join(f"{name}: {', '.join(args)}" for name, args in takes.items())
    return f"unknown key '{key}'; {parent_key} takes _target_ and its target's arguments ({listed})" + did_you_mean(arg, union, prefix=parent_key)


def _blocks_at(schema: type, dotted: str) -> Blocks | None:
    """The Blocks declared for the field at ``dotted``, if it is a block node."""
    parent_key, _, name = dotted.rpartition(".")
    parent = field_type(schema, parent_key) if parent_key else schema
    if parent is None or not is_dataclass(parent):
        return None
    f = next((f for f in fields(parent) if f.name == name), None)
    return f.metadata.get("blocks") if f is not None else None


def _offending_value(exc) -> Any:
    m = re.search(r"Value '([^']*)'|Invalid value '([^']*)'", str(exc))
    if m:
        return m.group(1) if m.group(1) is not None else m.group(2)
    return None


def field_type(schema: type, dotted: str) -> Any:
    """The annotated type at ``dotted`` (``a.b[1]``) inside ``schema``, or None."""
    tp: Any = schema
    for token in re.findall(r"[^.\[\]]+", dotted):
        tp = _strip_optional(tp)
        if is_dataclass(tp):
            hints = get_type_hints(tp)
            if token not in hints:
                return None
            tp = hints[token]
        elif get_origin(tp) in (list, Sequence) and token.isdigit():
            tp = get_args(tp)[0] if get_args(tp) else Any
        elif get_origin(tp) is dict:
            tp = get_args(tp)[1] if get_args(tp) else Any
        else:
            return None
    return tp


def _is_union(tp: Any) -> bool:
    """``Optional[X]``/``Union[...]`` and ``X | None`` (a types.UnionType) alike."""
    return get_origin(tp) in (Union, types.UnionType)


def _strip_optional(tp: Any) -> Any:
    if _is_union(tp):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def describe(tp: Any) -> str:
    optional = _is_union(tp) and type(None) in get_args(tp)
    base = _strip_optional(tp)
    if isinstance(base, type) and issubclass(base, Enum):
        text = f"one of: {', '.join(e.value for e in base)}"
    elif base is bool:
        text = "true or false"
    elif base is int:
        text = "an integer"
    elif base is float:
        text = "a number"
    elif base is str:
        text = "a string"
    elif get_origin(base) is list:
        (item,) = get_args(base) or (Any,)
        text = f"a list of {describe(item).removeprefix('an ').removeprefix('a ')}s"
    elif is_dataclass(base):
        text = f"a section with keys {', '.join(f.name for f in fields(base))}"
    elif get_origin(base) is dict:
        text = "a mapping"
    else:
        text = "a value"
    return f"{text} or null" if optional else text


def did_you_mean(word: str, options: Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    if not close:
        return ""
    return f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)"
