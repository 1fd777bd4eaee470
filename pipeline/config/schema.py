"""The configuration schema: the building blocks each owner uses, and the collected ``Config``.

A section's dataclass lives with the module that owns it (``CONFIG = {"section":
Dataclass}`` in a stage module, or in ``tracking`` and ``retrain``); ``config_class()``
collects them, so a new stage or option never edits this package. Rules every section
follows:

- no defaults in Python: every field is ``MISSING`` and conf/ holds the value (fields a
  group option leaves out on purpose, such as ``model.path`` for a built-in model, are
  ``None``);
- the checks sit in the section (``Section.check``), run by ``__post_init__`` when
  ``OmegaConf.to_object`` builds the typed configuration;
- an engine block (a loss or an optimizer graph) is a ``_target_`` node, declared with
  ``LOSS`` or ``OPTIMIZER``: its ``_target_`` must be one of the odt_ops.onnxblock classes
  of that kind and its keys that class's constructor arguments, checked here before
  Hydra's ``instantiate`` ever sees it (so params.yaml cannot import or run anything else).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from typing import Any

from omegaconf import MISSING

from pipeline.errors import ConfigError

# Modules other than the stages that own a section (read by no stage: never a DVC param).
SECTION_OWNERS = ("tracking", "retrain")


class FieldError(ConfigError):
    """A value out of range, raised by a section's check; ``validate`` adds the section's path."""

    def __init__(self, owner: type, key: str, value: Any, expected: str):
        super().__init__(f"{key}={show(value)}: expected {expected}")
        self.owner, self.key, self.value, self.expected = owner, key, value, expected


class Section:
    """Base of the section dataclasses: ``check`` runs once every field holds a value
    (OmegaConf first builds the bare schema, all ``MISSING``, and skips it then)."""

    def __post_init__(self) -> None:
        if _complete(self):
            self.check()

    def check(self) -> None:
        """Range and cross-field checks, each with ``self.need``; none by default."""

    def need(self, ok: bool, key: str, expected: str) -> None:
        """``key`` (a field, or ``a.b`` inside a nested section) holds an allowed value, or a FieldError."""
        if not ok:
            value: Any = self
            for part in key.split("."):
                value = getattr(value, part)
            raise FieldError(type(self), key, value, expected)


def _complete(section: Any) -> bool:
    """No field, nested sections' included, is still MISSING."""
    for f in fields(section):
        value = getattr(section, f.name)
        if isinstance(value, str) and value == MISSING or is_dataclass(value) and not _complete(value):
            return False
    return True


# --------------------------------------------------------------------------- engine blocks


@dataclass(frozen=True)
class Blocks:
    """The odt_ops.onnxblock classes a ``_target_`` node of one kind may name: every
    subclass of ``base`` defined in ``module`` (a new engine optimizer is allowed, and must
    have its conf/ option: a test checks both sets are equal)."""

    kind: str
    module: str
    base: str  # "module:Class"

    def classes(self) -> dict[str, type]:
        mod = importlib.import_module(self.module)
        base_module, _, base_name = self.base.partition(":")
        base = getattr(importlib.import_module(base_module), base_name)
        return {f"{self.module}.{name}": cls for name, cls in sorted(vars(mod).items())
                if isinstance(cls, type) and issubclass(cls, base) and cls is not base and cls.__module__ == self.module}

    def field(self) -> Any:
        """A dataclass field holding one such node (``_target_`` plus constructor arguments)."""
        return field(default=MISSING, metadata={"blocks": self})


LOSS = Blocks("loss", "odt_ops.onnxblock.loss", "odt_ops.onnxblock.base:Block")
OPTIMIZER = Blocks("optimizer", "odt_ops.onnxblock.optim", "odt_ops.onnxblock.optim:Optimizer")

# Constructor arguments a node may not set: an object-valued alias (an optimizer's
# clip_grad is max_norm as a ClipGradNorm object). (state_names is not an argument at all.)
NOT_ARGUMENTS = frozenset({"self", "clip_grad"})


def arguments(cls: type) -> list[str]:
    """The keyword arguments of ``cls``'s constructor a conf/ node may set (the engine is their one source)."""
    return sorted(p for p in inspect.signature(cls).parameters if p not in NOT_ARGUMENTS)


def build(node: Mapping) -> Any:
    """The engine block a validated node names (plain lists and dicts, not OmegaConf's)."""
    from hydra.utils import instantiate

    return instantiate(dict(node), _convert_="all")


# --------------------------------------------------------------------------- the collected schema


@functools.cache
def config_class() -> type:
    """``Config``: ``seed`` plus every section a stage module (dvc.yaml's stages) or a module
    of SECTION_OWNERS declares in its ``CONFIG``; a section declared twice is an error."""
    from pipeline.paths import stages

    sections: dict[str, tuple[Any, str]] = {}
    for name in (*stages(), *SECTION_OWNERS):
        module = importlib.import_module(f"pipeline.{name}")
        for section, spec in getattr(module, "CONFIG", {}).items():
            if section in sections:
                raise TypeError(f"config section {section!r} is declared by pipeline.{sections[section][1]} and pipeline.{name}")
            sections[section] = (spec, name)
    specs: list[tuple[str, Any, Any]] = [("seed", int, field(default=MISSING))]
    for section, (spec, _) in sections.items():
        if isinstance(spec, Blocks):
            specs.append((section, dict[str, Any], spec.field()))
        else:
            specs.append((section, spec, field(default_factory=spec)))
    return make_dataclass("Config", specs, bases=(Section,))


def section_paths(schema: type, prefix: str = "") -> Iterator[tuple[str, type]]:
    """(dotted path, section dataclass) for every nested section of ``schema``."""
    for f in fields(schema):
        tp = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(tp, type) and is_dataclass(tp):
            path = f"{prefix}{f.name}"
            yield path, tp
            yield from section_paths(tp, path + ".")


def block_nodes(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, Blocks]]:
    """(dotted path, node, its Blocks) for every ``_target_`` field of a built configuration."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if "blocks" in f.metadata:
            yield f"{prefix}{f.name}", value, f.metadata["blocks"]
        elif is_dataclass(value):
            yield from block_nodes(value, f"{prefix}{f.name}.")


def show(value: Any) -> str:
    """A config value as YAML would spell it."""
    import enum

    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
