"""Back to the QDQ layout onnxruntime runs: drop the straight-through nodes, re-quantize
each trained float master copy with its DequantizeLinear's own scale and zero point, and
fold LoRA adapters into a quantized weight the same way."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from odt_ops.errors import QuantizationError
from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels.quantize import dequantize, quantize
from odt_ops.quant.qat import Site


def _dq_parameters(graph: onnx.GraphProto, node: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray | None, int, int]:
    inits = {t.name: t for t in graph.initializer}
    attrs = node_attributes(node)
    scale = numpy_helper.to_array(inits[node.input[1]])
    zp = numpy_helper.to_array(inits[node.input[2]]) if len(node.input) > 2 and node.input[2] else None
    return scale, zp, int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))


def strip_straight_through(graph: onnx.GraphProto, sites: list[Site]) -> None:
    """In an exported inference graph: the QDQ layout the model came in, with trained weights."""
    by_name = {n.name: n for n in graph.node}
    inits = {t.name: t for t in graph.initializer}
    added = {name for s in sites for name in s.added}
    for s in sites:
        node = by_name.get(s.dequantize)
        if node is None:
            raise QuantizationError(f"DequantizeLinear node {s.dequantize!r} of the QAT metadata is not in the graph; the model is damaged")
        if s.master is not None:
            scale, zp, axis, block = _dq_parameters(graph, node)
            master = numpy_helper.to_array(inits[s.master])
            dtype = zp.dtype if zp is not None else _stored_dtype(by_name[s.quantize])
            graph.initializer.append(numpy_helper.from_array(quantize(master, scale, zp, dtype, axis=axis, block_size=block), s.quantized))
            node.input[0] = s.quantized
    for s in sites:  # the DequantizeLinear writes its original output (and reads its computed scale) again
        by_name[s.dequantize].output[0] = s.ste_output
        if s.scale_input:
            by_name[s.dequantize].input[1] = s.scale_input
    kept = [n for n in graph.node if n.name not in added]
    del graph.node[:]
    graph.node.extend(kept)


def _stored_dtype(quantize_node: onnx.NodeProto) -> np.dtype:
    from onnx import helper

    return helper.tensor_dtype_to_np_dtype(node_attributes(quantize_node).get("output_dtype", onnx.TensorProto.UINT8))


def merge_into_quantized(graph: onnx.GraphProto, adapter, delta: np.ndarray) -> None:
    """W_q <- quantize(dequantize(W_q) + delta) with the weight's own scale and zero point."""
    node = next(n for n in graph.node if n.name == adapter.dequantize)
    scale, zp, axis, block = _dq_parameters(graph, node)
    init = next(t for t in graph.initializer if t.name == adapter.weight)
    stored = numpy_helper.to_array(init)
    merged = dequantize(stored, scale, zp, axis=axis, block_size=block).astype(np.float64) + delta
    init.CopyFrom(numpy_helper.from_array(quantize(merged.astype(np.float32), scale, zp, stored.dtype, axis=axis, block_size=block),
                                          adapter.weight))
