"""Load any forward ONNX model and normalize it once.

Normalization: check, convert to the engine's opset, fold constant subgraphs into
initializers, give inputs a symbolic batch dimension, make node names unique, infer
shapes, and verify every op has a kernel, so that a model that loads also runs.
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from odt_ops.errors import ModelCheckError, ModelFileNotFoundError, ModelLoadError, StaticBatchError, StaticBatchWarning, UnsupportedOpError
from odt_ops.ir import control_flow, external, functions, passes, recurrent, static_batch
from odt_ops.ir.integer_ops import dequantize_integer_ops
from odt_ops.ir.model import TARGET_IR_VERSION, TARGET_OPSET, Model

ModelSource = onnx.ModelProto | str | os.PathLike | bytes | Model


def read_model(source: ModelSource, *, base_dir: str | os.PathLike | None = None) -> Model:
    """Read a ModelProto, a path or serialized bytes, without normalizing it.

    External tensor data is looked for in ``base_dir``: by default the folder of a model read
    from a path; a model given as bytes or a ModelProto has no folder, so one with external
    data needs ``base_dir`` (see ``odt_ops.ir.external`` for what it may point at)."""
    if isinstance(source, Model):
        return source
    folder = None if base_dir is None else str(Path(base_dir).resolve())
    if isinstance(source, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(source)
        return _vetted(Model(proto, base_dir=folder))
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _vetted(Model(_parse(bytes(source), "<bytes>"), base_dir=folder))
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            raise ModelLoadError(f"{path}: a folder, not a model file; name the .onnx file in it")
        if not path.is_file():
            raise ModelFileNotFoundError(f"{path}: no such model file")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ModelLoadError(f"{path}: cannot read the model: {exc.strerror or exc}") from None
        # external data stays on disk and is memory-mapped later, never held twice
        return _vetted(Model(_parse(data, str(path)), base_dir=folder or str(path.parent.resolve()), source=str(path)))
    raise ModelLoadError(f"cannot load a model from {type(source).__name__}; pass a ModelProto, a path or bytes")


def _parse(data: bytes, source: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError, RecursionError) as exc:  # RecursionError: nesting past protobuf's limit
        raise ModelLoadError(f"{source}: not a readable ONNX model (truncated or corrupted?): {exc}") from None
    if not proto.HasField("graph") or not proto.opset_import:
        raise ModelLoadError(f"{source}: not an ONNX model (no graph or no opset import)")
    return proto


def _vetted(model: Model) -> Model:
    """Check every external data entry now, before any pass reads a tensor, and move the small
    ones and those outside the main graph's initializers into the model: onnx's helpers (used
    by passes and kernels on such tensors) would otherwise look for them relative to the working
    directory. The large initializers stay on disk, to be memory-mapped from the vetted file."""
    for tensor, top_level in external.walk_tensors(model.proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        if top_level and _nbytes(tensor) > HEAVY_BYTES:
            external.map_external(tensor, model.base_dir, model.source)  # opens, checks and drops the mapping
            continue
        external.inline(tensor, model.base_dir, model.source)
    return model


def load_model(source: ModelSource, *, target_opset: int | None = TARGET_OPSET, batch_dim: str | None = "batch",
               base_dir: str | os.PathLike | None = None) -> Model:
    """Read and normalize a model; the result passes onnx.checker's full check.

    ``target_opset=None`` keeps the model's own opset (the spec's node tests run this
    way); otherwise models are converted to it. A newer model that onnx's converter
    cannot lower keeps its opset, since kernels are registered per opset version.
    """
    model = read_model(source, base_dir=base_dir)
    if model.normalized and target_opset in (None, model.opset):
        return model
    with _weights_aside(model):  # the C++ passes below then never copy the weights
        passes.complete_output_types(model)
        _check(model, full=False)
        if target_opset is not None and model.opset != target_opset:
            passes.drop_saved_batch_statistics(model)
            _convert(model, target_opset)
    # IR >= 4 lets initializers be plain constants (IR 3 typed them only as graph inputs)
    model.proto.ir_version = ir_version_for(model.opset)
    for p in (dequantize_integer_ops, functions.expand_function_ops, passes.inline_constant_nodes, passes.fold_constants, passes.unique_node_names,
              recurrent.unroll_recurrent, control_flow.lower_control_flow):
        p(model)
    if batch_dim:
        baked = static_batch.export_batch(model)  # read before the inputs' batch turns symbolic
        if baked is None:
            passes.symbolic_batch_dim(model, batch_dim)
        else:
            _free_baked_batch_or_keep_it(model, baked, batch_dim)
    with _weights_aside(model):
        try:
            passes.infer_shapes(model)
        except ValueError as exc:  # onnx's C++ inference on an invalid data type
            raise ModelCheckError(f"{model.source}: shape inference fails: {exc}") from None
    passes.fold_constants(model)  # Shape of now-known static shapes
    passes.prune_unused(model)
    model.proto.ir_version = ir_version_for(model.opset)
    with _weights_aside(model):
        _check(model, full=True)
    passes.require_kernels(model)
    model.normalized = True
    return model


def _infer_aside(model: Model) -> None:
    with _weights_aside(model):
        passes.infer_shapes(model)


HEAVY_BYTES = 1 << 16  # initializers above this stand aside during C++ passes


def _free_baked_batch_or_keep_it(model: Model, baked: int, batch_dim: str) -> None:
    """A static-batch export runs at any batch where its data flow says which constants are the
    batch (ir/static_batch.py). Where it cannot tell, the model keeps the batch it was exported
    with, as it ran before, and a warning names the node: refusing would stop a model that runs."""
    kept, derived, axes = onnx.ModelProto(), set(model.derived), dict(model.batch_axes)
    kept.CopyFrom(model.proto)
    passes.symbolic_batch_dim(model, batch_dim)
    try:
        static_batch.free_baked_batch(model, baked, _infer_aside, batch_dim)
    except StaticBatchError as exc:
        model.proto.CopyFrom(kept)
        model.derived, model.batch_axes = derived, axes
        model.forget_arrays()
        warnings.warn(f"{model.source}: runs only at its export batch {baked}: {exc}", StaticBatchWarning, stacklevel=3)


@contextlib.contextmanager
def _weights_aside(model: Model) -> Iterator[None]:
    """Within, large initializers are stood in for by graph inputs of the same type.

    Every C++ pass (checker, shape inference, version conversion) serializes the whole
    model; with the weights aside it copies kilobytes instead of the weights. Shape
    inference needs only small constants (shapes, axes), which stay in place. External
    data stands aside too: the checker would look for it relative to the working
    directory; its files are verified when the tensors are mapped.
    """
    graph = model.graph
    heavy = [t for t in graph.initializer if _nbytes(t) > HEAVY_BYTES]
    if not heavy:
        yield
        return
    names = {t.name for t in heavy}
    held = []
    for t in heavy:
        copy = onnx.TensorProto()
        copy.CopyFrom(t)
        held.append(copy)
    keep = [t for t in graph.initializer if t.name not in names]
    kept = []
    for t in keep:
        copy = onnx.TensorProto()
        copy.CopyFrom(t)
        kept.append(copy)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    declared = {i.name for i in graph.input}  # IR 3 lists initializers among the graph inputs already
    stand_ins = {t.name for t in held if t.name not in declared}
    graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in held if t.name in stand_ins)
    try:
        yield
    finally:
        graph = model.graph  # a pass may have replaced the proto
        inputs = [i for i in graph.input if i.name not in stand_ins]
        del graph.input[:]
        graph.input.extend(inputs)
        graph.initializer.extend(held)
        model.forget_arrays()


def _nbytes(t: onnx.TensorProto) -> int:
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return math.prod(max(int(d), 0) for d in t.dims) * 8  # its dtype is checked when it is mapped
    if t.HasField("raw_data"):
        return len(t.raw_data)
    return math.prod(max(int(d), 0) for d in t.dims) * 4


def ir_version_for(opset: int) -> int:
    """The IR version onnx pairs with ``opset``, capped at what current runtimes load."""
    try:
        ir = onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", opset)], ignore_unknown=True)
    except Exception:
        ir = TARGET_IR_VERSION
    return max(ir, TARGET_IR_VERSION) if opset >= TARGET_OPSET else ir


def _check(model: Model, *, full: bool) -> None:
    try:
        onnx.checker.check_model(model.proto, full_check=full)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError, ValueError) as exc:
        # ValueError: onnx's C++ code on an invalid data type ("Invalid tensor data type 999.")
        raise ModelCheckError(f"{model.source}: fails onnx.checker: {exc}") from None


def check_artifact(model: Model) -> None:
    """onnx.checker's full check (strict shape inference) of an artifact read from a file: every
    artifact we write passes it, and a damaged one (an op swapped, an attribute retyped, an input
    renamed) fails here, naming the file, instead of inside a kernel at the first step."""
    with _weights_aside(model):
        _check(model, full=True)


def _convert(model: Model, target: int) -> None:
    current = model.opset
    try:
        converted = onnx.version_converter.convert_version(model.proto, target)
    except Exception as exc:
        if current > target:
            return  # newer than our target and not lowerable: run it at its own opset
        raise ModelCheckError(
            f"{model.source}: converting opset {current} to {target} failed: {str(exc)[:300]}; "
            f"re-export the model at opset {target}"
        ) from None
    model.proto = converted
    model.forget_arrays()


def save_model(model: Model | onnx.ModelProto, path: str | os.PathLike) -> None:
    """Write atomically (temp file, fsync, rename) so a crash never leaves half a model."""
    from odt_ops.io import atomic_write_bytes

    proto = model.proto if isinstance(model, Model) else model
    atomic_write_bytes(path, proto.SerializeToString())


__all__ = ["ModelSource", "UnsupportedOpError", "load_model", "read_model", "save_model"]
