"""onnxruntime's dynamic quantization (``quantize_dynamic``) rewritten into standard QDQ form.

quantize_dynamic writes each quantized MatMul and Conv as

    x_q, x_scale, x_zp = DynamicQuantizeLinear(x)
    scale = Mul(x_scale, w_scale)
    y_int = MatMulInteger(x_q, w_q, x_zp, w_zp)      (or ConvInteger, with the Conv's attributes)
    y     = Mul(Cast<float>(y_int), scale)

which no gradient can pass (its arithmetic is integer). The same product in QDQ form is

    y = MatMul(DequantizeLinear(x_q, x_scale, x_zp), DequantizeLinear(w_q, w_scale, w_zp))

equal up to float32 rounding (the integer sum is exact, the float sum rounds); the
DynamicQuantizeLinear stays (ONNX defines it as a function of standard ops, expanded at
load), so the activation is quantized with its batch's min/max exactly as the spec says.
odt_ops.quant.qat then trains through each DequantizeLinear like any QDQ model's.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from odt_ops.domain import is_default
from odt_ops.errors import QuantizationError
from odt_ops.ir.builder import unique_name
from odt_ops.ir.graph import consumers, producers
from odt_ops.ir.model import Model

INTEGER_OPS = {"MatMulInteger": "MatMul", "ConvInteger": "Conv"}
_CONV_ATTRIBUTES = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def dequantize_integer_ops(model: Model) -> bool:
    """Rewrite every MatMulInteger/ConvInteger of quantize_dynamic's pattern (module docstring)
    into DequantizeLinear + MatMul/Conv; a pattern it does not know is a QuantizationError naming the node."""
    graph = model.graph
    integer = [n for n in graph.node if is_default(n.domain) and n.op_type in INTEGER_OPS]
    if not integer:
        return False
    inits = {t.name: t for t in graph.initializer}
    producer, readers = producers(graph.node), consumers(graph.node)
    taken = {t.name for t in graph.initializer} | {n.name for n in graph.node} | {v for n in graph.node for v in (*n.input, *n.output)}
    taken |= {i.name for i in graph.input} | {o.name for o in graph.output}
    replaced: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> what stands in its place (its position follows its inputs)
    dropped: set[int] = set()
    dequantized: dict[tuple[str, str, str], str] = {}  # (x_q, scale, zero point) -> its DequantizeLinear's output
    for node in integer:
        where = f"{model.source}: {node.op_type} node {node.name!r}"
        cast, scaled, scales = _pattern(node, producer, readers, where)
        x_q, w_q = node.input[0], node.input[1]
        x_zp = node.input[2] if len(node.input) > 2 else ""
        w_zp = node.input[3] if len(node.input) > 3 else ""
        x_scale, w_scale = _scales(scales, x_q, w_q, producer, inits, where)
        if w_q not in inits:
            raise QuantizationError(f"{where}: its weight {w_q!r} is computed, not an initializer; odt_ops fine-tunes "
                                    "quantize_dynamic models, whose weights are stored quantized")
        w_shape = tuple(inits[w_q].dims)
        scale_size = int(np.prod(inits[w_scale].dims, dtype=np.int64))
        if node.op_type == "ConvInteger" and scale_size != 1:
            raise QuantizationError(f"{where}: a per-channel ConvInteger weight scale {w_scale!r} is not the layout quantize_dynamic "
                                    "writes; quantize it per tensor (per_channel=False) or to the QDQ format")
        axis = 0 if node.op_type == "ConvInteger" else len(w_shape) - 1  # per output channel: a Conv's axis 0, a MatMul's columns
        first = (x_q, x_scale, x_zp) not in dequantized  # one DequantizeLinear (one STE later) per activation, however many read it
        x_dq = dequantized.setdefault((x_q, x_scale, x_zp), unique_name(f"{x_q}/dequantized", taken))
        w_dq = unique_name(f"{w_q}/dequantized", taken)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.name in _CONV_ATTRIBUTES}
        replaced[id(node)] = [
            *([helper.make_node("DequantizeLinear", [x_q, x_scale, *([x_zp] if x_zp else [])], [x_dq],
                                name=unique_name(f"{node.name}/dequantize_input", taken))] if first else []),
            helper.make_node("DequantizeLinear", [w_q, w_scale, *([w_zp] if w_zp else [])], [w_dq], axis=axis,
                             name=unique_name(f"{node.name}/dequantize_weight", taken)),
            helper.make_node(INTEGER_OPS[node.op_type], [x_dq, w_dq], [scaled.output[0]], name=node.name, **attrs),
        ]
        dropped |= {id(cast), id(scaled)}
        if all(id(r) in dropped for r in readers.get(scales.output[0], [])):
            dropped.add(id(scales))
    nodes = []
    for n in graph.node:
        if id(n) in replaced:
            nodes += replaced[id(n)]
        elif id(n) not in dropped:
            nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)
    model.forget_arrays()
    return True


def _pattern(node: onnx.NodeProto, producer, readers, where: str) -> tuple[onnx.NodeProto, onnx.NodeProto, onnx.NodeProto]:
    """(the Cast to float, the Mul by the product of scales, that product's Mul) after ``node``."""
    expected = (f"{where}: not quantize_dynamic's pattern ({node.op_type} -> Cast to float -> Mul by x_scale * w_scale, "
                "x from DynamicQuantizeLinear, the weight an initializer)")
    cast = _only_reader(node.output[0], readers, "Cast")
    if cast is None or helper.get_attribute_value(next(a for a in cast.attribute if a.name == "to")) != onnx.TensorProto.FLOAT:
        raise QuantizationError(f"{expected}: its output is not cast to float by its only reader")
    scaled = _only_reader(cast.output[0], readers, "Mul")
    if scaled is None:
        raise QuantizationError(f"{expected}: the cast is not multiplied by the scales by its only reader")
    other = next((i for i in scaled.input if i != cast.output[0]), None)
    scales = producer.get(other) if other else None
    if scales is None or scales.op_type != "Mul" or not is_default(scales.domain):
        raise QuantizationError(f"{expected}: the cast is multiplied by {other!r}, not by a Mul of the two scales")
    source = producer.get(node.input[0])
    if source is None or source.op_type != "DynamicQuantizeLinear" or not is_default(source.domain):
        raise QuantizationError(f"{expected}: its input {node.input[0]!r} does not come from DynamicQuantizeLinear")
    return cast, scaled, scales


def _only_reader(value: str, readers, op_type: str) -> onnx.NodeProto | None:
    found = readers.get(value, [])
    return found[0] if len(found) == 1 and found[0].op_type == op_type and is_default(found[0].domain) else None


def _scales(scales: onnx.NodeProto, x_q: str, w_q: str, producer, inits, where: str) -> tuple[str, str]:
    """(x's scale, the weight's scale): the DynamicQuantizeLinear's scale output and an initializer."""
    source = producer[x_q]
    x_scale = source.output[1] if len(source.output) > 1 else ""
    if not x_scale or x_scale not in scales.input:
        raise QuantizationError(f"{where}: the scales' Mul {scales.name!r} does not read {x_scale!r}, the scale of its input {x_q!r}")
    w_scale = next(i for i in scales.input if i != x_scale) if list(scales.input).count(x_scale) == 1 else x_scale
    if w_scale not in inits:
        raise QuantizationError(f"{where}: the weight scale {w_scale!r} of weight {w_q!r} is computed, not an initializer")
    if numpy_helper.to_array(inits[w_scale]).dtype != np.float32:
        raise QuantizationError(f"{where}: weight scale {w_scale!r} is not float32; odt_ops fine-tunes float32 models")
    return x_scale, w_scale
