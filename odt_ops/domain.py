"""ONNX's default domain has two spellings, "" and "ai.onnx" (the spec allows both in nodes and in
opset imports); the engine reads them as one, through these helpers only."""
from __future__ import annotations

from collections.abc import Iterable

import onnx

SPELLINGS = ("", "ai.onnx")  # the only place they are spelled: check with is_default, key with canonical


def is_default(domain: str) -> bool:
    """Whether ``domain`` names ONNX's default operator set."""
    return domain in SPELLINGS


def canonical(domain: str) -> str:
    """``domain`` with the default domain spelled ""."""
    return "" if is_default(domain) else domain


def opset_versions(imports: Iterable[onnx.OperatorSetIdProto]) -> dict[str, int]:
    """A model's opset imports as {domain: version}, the default domain under ""."""
    return {canonical(o.domain): o.version for o in imports}


def default_opset(imports: Iterable[onnx.OperatorSetIdProto], fallback: int) -> int:
    """The version of the default domain a model imports, else ``fallback``."""
    return next((o.version for o in imports if is_default(o.domain)), fallback)
