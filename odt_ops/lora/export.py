"""Leaving LoRA training: the merged inference model, and the adapter alone for onnxruntime.

- ``export_merged``: the inference model with every adapter folded into its weight
  (W + scale A B, in the weight's stored layout and dtype) and the adapter nodes gone,
  so it is exactly the base model's graph with new weights.
- ``export_adapter_base``: the inference model with the adapters kept, their A and B as
  graph inputs that default to zero (initializers of the same name), so the model alone
  computes the base model, and onnxruntime feeds a user's adapter per request.
- ``export_adapter``: that adapter as onnxruntime's own adapter file
  (``onnxruntime.AdapterFormat``; a server loads it with ``onnxruntime.LoraAdapter`` and
  ``RunOptions.add_active_adapter``).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from odt_ops.checkpoint import Checkpoint
from odt_ops.errors import LoraError
from odt_ops.ir.load import read_model, save_model
from odt_ops.ir.model import Model
from odt_ops.ir.passes import prune_unused
from odt_ops.lora.rewrite import Adapter, read_adapters
from odt_ops.quant.export import inference_without_ste
from odt_ops.quant.requantize import merge_into_quantized


def _inference(eval_model, checkpoint: Checkpoint, path) -> tuple[onnx.ModelProto, list[Adapter]]:
    """The inference model with the adapters (a quantized base back in its QDQ layout)."""
    source = read_model(eval_model)
    _, adapters = read_adapters(source.proto, source.source)
    return inference_without_ste(source, checkpoint, path), adapters


def export_merged(eval_model, checkpoint: Checkpoint, path: str | os.PathLike) -> onnx.ModelProto:
    """The inference model with the adapters folded into the weights (no extra nodes)."""
    proto, adapters = _inference(eval_model, checkpoint, path)
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    params = {**checkpoint.parameters}
    added = {n for a in adapters for n in a.added}
    rename = {base: final for a in adapters for base, final in a.outputs}
    for a in adapters:
        if a.dequantize is not None:  # a quantized base: re-quantize the merged weight with its own scale
            merge_into_quantized(graph, a, a.delta(params[a.A], params[a.B]))
            continue
        weight = numpy_helper.to_array(inits[a.weight])
        merged = (weight.astype(np.float64) + a.delta(params[a.A], params[a.B])).astype(weight.dtype)
        inits[a.weight].CopyFrom(numpy_helper.from_array(merged, a.weight))
    dropped = {o for n in graph.node if n.name in added for o in n.output}
    kept = [n for n in graph.node if n.name not in added]
    for node in kept:
        for i, out in enumerate(node.output):
            if out in rename:
                node.output[i] = rename[out]
    del graph.node[:]
    graph.node.extend(kept)
    stale = [v for v in graph.value_info if v.name in rename or v.name in dropped]
    for v in stale:
        graph.value_info.remove(v)
    model = Model(proto, source=str(path))
    prune_unused(model)
    leftover = [n.name for n in model.graph.node if any(i in {x for a in adapters for x in (a.A, a.B)} for i in n.input)]
    if leftover:
        raise LoraError(f"{path}: adapter nodes {leftover} are left after merging; the eval model's LoRA metadata does not fit its graph")
    return _finish(model.proto, path)


def export_adapter_base(eval_model, checkpoint: Checkpoint, path: str | os.PathLike) -> onnx.ModelProto:
    """The inference model whose adapter inputs (every A and B) default to zero."""
    proto, adapters = _inference(eval_model, checkpoint, path)
    graph = proto.graph
    names = [n for a in adapters for n in (a.A, a.B)]
    inits = {t.name: t for t in graph.initializer}
    for name in names:
        zero = np.zeros(tuple(inits[name].dims), helper.tensor_dtype_to_np_dtype(inits[name].data_type))
        inits[name].CopyFrom(numpy_helper.from_array(zero, name))
        graph.input.append(helper.make_tensor_value_info(name, inits[name].data_type, list(zero.shape)))
    return _finish(proto, path)


def adapter_arrays(eval_model, checkpoint: Checkpoint) -> dict[str, np.ndarray]:
    """The trained adapter: each A and B by the input name the base model gives it."""
    source = read_model(eval_model)
    _, adapters = read_adapters(source.proto, source.source)
    missing = [n for a in adapters for n in (a.A, a.B) if n not in checkpoint.parameters]
    if missing:
        raise LoraError(f"the checkpoint holds no values for the adapters {missing}; is it from these artifacts?")
    return {n: np.ascontiguousarray(checkpoint.parameters[n]) for a in adapters for n in (a.A, a.B)}


def export_adapter(eval_model, checkpoint: Checkpoint, path: str | os.PathLike, *, adapter_version: int = 1, model_version: int = 1) -> Path:
    """onnxruntime's adapter file (``.onnx_adapter``) of the trained A and B, written atomically."""
    try:
        import onnxruntime
    except ImportError:
        raise LoraError("writing onnxruntime's adapter file needs onnxruntime (pip install onnxruntime>=1.20); "
                        "adapter_arrays() gives the same tensors as numpy arrays") from None
    if not hasattr(onnxruntime, "AdapterFormat"):
        raise LoraError(f"onnxruntime {onnxruntime.__version__} has no AdapterFormat (added in 1.20); upgrade onnxruntime")
    arrays = adapter_arrays(eval_model, checkpoint)
    fmt = onnxruntime.AdapterFormat()
    fmt.set_adapter_version(adapter_version)
    fmt.set_model_version(model_version)
    fmt.set_parameters({n: onnxruntime.OrtValue.ortvalue_from_numpy(a) for n, a in arrays.items()})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        fmt.export_adapter(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def _finish(proto: onnx.ModelProto, path) -> onnx.ModelProto:
    proto = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    onnx.checker.check_model(proto, full_check=True)
    save_model(proto, path)
    return proto
