"""The model a Block builds into, and the Block protocol."""
from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import onnx

from odt_ops.domain import default_opset
from odt_ops.errors import ArtifactError
from odt_ops.ir.builder import GraphBuilder
from odt_ops.ir.model import TARGET_IR_VERSION, TARGET_OPSET

_CURRENT: contextvars.ContextVar[tuple[onnx.ModelProto, GraphBuilder, ModelAccessor] | None] = contextvars.ContextVar(
    "onnxblock_base", default=None)


class ModelAccessor:
    """What ``with base(model) as accessor`` yields: ``accessor.model`` as in ONNX Runtime; every
    other attribute is the model's own, so code that used the yielded value as the model still works."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.eval_model: onnx.ModelProto | None = None  # set by a TrainingBlock built inside (ONNX Runtime 1.14's accessor)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


@contextlib.contextmanager
def base(model: onnx.ModelProto) -> Iterator[ModelAccessor]:
    """Blocks called inside this context add their nodes to a copy of ``model``, which
    ``accessor.model`` holds; the caller's model stays as it was (ONNX Runtime's ``base``
    deep-copies it too, onnxblock/model_accessor.py), so it can be built on again."""
    if not isinstance(model, onnx.ModelProto):
        raise ArtifactError(f"onnxblock.base takes an onnx.ModelProto, got {type(model).__name__}; "
                            "use onnxblock.empty_base() to build a model from scratch")
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    with building_into(copy) as accessor:
        yield accessor


@contextlib.contextmanager
def building_into(model: onnx.ModelProto) -> Iterator[ModelAccessor]:
    """``base`` without the copy: blocks add their nodes to ``model`` itself (the engine's own
    builders, whose model is already theirs: a copy of a large model costs its size again)."""
    builder = builder_for(model, prefix="loss")
    accessor = ModelAccessor(model)
    token = _CURRENT.set((model, builder, accessor))
    try:
        yield accessor
    finally:
        _CURRENT.reset(token)
        model.graph.node.extend(builder.nodes)
        model.graph.initializer.extend(builder.initializers)


def flush() -> onnx.ModelProto:
    """Move what the blocks built so far into the open model and return it (a ForwardBlock or
    TrainingBlock reads the whole model while the context is still open)."""
    model, builder = current()
    model.graph.node.extend(builder.nodes)
    model.graph.initializer.extend(builder.initializers)
    del builder.nodes[:]
    del builder.initializers[:]
    return model


def builder_for(model: onnx.ModelProto, prefix: str = "") -> GraphBuilder:
    """A builder that knows every name, type and constant of ``model`` already has."""
    graph = model.graph
    types = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output) if v.type.HasField("tensor_type")}
    taken = {n for node in graph.node for n in (*node.input, *node.output)} | {node.name for node in graph.node}
    opset = default_opset(model.opset_import, TARGET_OPSET)
    return GraphBuilder(taken=taken, opset=opset, types=types, constants={t.name: t for t in graph.initializer}, prefix=prefix)


@contextlib.contextmanager
def empty_base(opset_version: int = TARGET_OPSET) -> Iterator[ModelAccessor]:
    """A new empty model to build into (optimizer graphs start from one)."""
    model = onnx.helper.make_model(
        onnx.helper.make_graph([], "onnxblock", [], []),
        opset_imports=[onnx.helper.make_opsetid("", opset_version)],
        ir_version=TARGET_IR_VERSION,
    )
    with building_into(model) as accessor:
        yield accessor


def current() -> tuple[onnx.ModelProto, GraphBuilder]:
    return _state()[:2]


def current_accessor() -> ModelAccessor:
    return _state()[2]


def _state():
    state = _CURRENT.get()
    if state is None:
        raise ArtifactError("a Block was called outside `with onnxblock.base(model):`; open a base model first")
    return state


@contextlib.contextmanager
def onnx_model(model: onnx.ModelProto | None = None) -> Iterator[ModelAccessor]:
    """ONNX Runtime 1.14's entry point: blocks build into ``model`` itself (1.14 did not copy it,
    and its published examples save ``model`` afterwards; ``base`` copies, as later releases do),
    or into an empty model without one; after a TrainingModel is built inside,
    ``accessor.eval_model`` is its eval model."""
    with (building_into(model) if model is not None else empty_base()) as accessor:
        yield accessor


def current_builder() -> GraphBuilder:
    return current()[1]


class Block:
    """Subclass and implement ``build(*input_names) -> output name(s)``."""

    # as in onnxruntime, generate_artifacts hands a custom loss block every model output;
    # the built-in losses and PassThrough say False and take the first
    takes_all_outputs = True

    def build(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must implement build()")

    def __call__(self, *args, **kwargs):
        current()  # fail early, with the fix, when no base model is open
        return self.build(*args, **kwargs)
