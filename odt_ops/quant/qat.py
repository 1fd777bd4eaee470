"""Fine-tuning a QDQ model: straight-through fake quantization in standard ONNX.

Every DequantizeLinear on the way to the loss cuts the gradient (its input is an
integer tensor). ``prepare`` makes each one differentiable the way quantization-aware
training does, without leaving ai.onnx:

    inside = lo < x < hi             lo, hi = (qmin - zp -+ 0.5) * scale: the values that
    y = DequantizeLinear(QuantizeLinear(x)) + Where(inside, x - stop_gradient(x), 0)
                                     round into [qmin, qmax]

(stop_gradient made of standard float32 ops, exact: see _COARSE). ``y`` equals the
fake-quantized x exactly (the Where is 0.0), and its gradient is the straight-through
estimator: 1 where x rounds inside the clip range, 0 outside it (torch.fake_quantize_per_{tensor,channel}_affine's gradient). For an activation
x is the QuantizeLinear's input; for a quantized weight (``weights=True``: QAT) the int
weight is replaced by a float master copy (its dequantized value) that trains and is
re-quantized by a new QuantizeLinear with the model's scale and zero point. With
``weights=False`` the int weights stay as stored and frozen (a quantized base for LoRA).
What was added is recorded in the model's metadata (``odt.qat``) for the export.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from odt_ops.domain import is_default
from odt_ops.errors import QuantizationError
from odt_ops.ir.attributes import node_attributes
from odt_ops.ir.builder import unique_name
from odt_ops.ir.load import load_model
from odt_ops.ir.model import Model
from odt_ops.kernels.quantize import broadcast_param, dequantize, integer_range

METADATA_KEY = "odt.qat"


@dataclass(frozen=True)
class Site:
    """One DequantizeLinear made differentiable."""

    dequantize: str  # the DequantizeLinear node
    output: str  # its output, renamed (what the STE nodes read)
    ste_output: str  # its original output, now the STE's: what its readers read
    added: list[str]  # the STE nodes (and, for a weight, the QuantizeLinear)
    master: str | None = None  # the float master copy of a quantized weight
    quantized: str | None = None  # the int initializer it replaced
    quantize: str | None = None  # the QuantizeLinear node that re-quantizes the master
    scale_input: str | None = None  # a computed scale (DynamicQuantizeLinear's) the DequantizeLinear read before


def prepare(model: Model, *, weights: bool = True, activations: bool = True, learn_scales: bool = False) -> tuple[Model, list[Site]]:
    """A new model with straight-through fake quantization; returns it and the sites.
    ``learn_scales``: every scale becomes trainable, with LSQ's gradient (its name is in
    ``learned_scales(model)``); the zero points stay fixed."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    graph = proto.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    taken = {t.name for t in graph.initializer} | {n.name for n in graph.node} | {v for n in graph.node for v in (*n.input, *n.output)}
    taken |= {i.name for i in graph.input} | {o.name for o in graph.output}
    before: dict[str, list[onnx.NodeProto]] = {}
    learned: set[str] = set()
    after: dict[str, list[onnx.NodeProto]] = {}
    sites = []

    def fresh(hint: str) -> str:
        name = unique_name(hint, taken)
        taken.add(name)
        return name

    for node in list(graph.node):
        if node.op_type != "DequantizeLinear" or not is_default(node.domain):
            continue
        x = node.input[0]
        q = producer.get(x)
        if x not in inits and node.input[1] not in inits and q is not None and q.op_type == "QuantizeLinear":
            if activations:  # quantized with its batch's own statistics: DynamicQuantizeLinear (expanded at load)
                sites.append(_dynamic_site(node, q, graph, fresh, before, after))
            continue
        attrs = node_attributes(node)
        axis, block = int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))
        scale = _const(inits, node.input[1], node)
        zp = _const(inits, node.input[2], node) if len(node.input) > 2 and node.input[2] else None
        master = quantized = quantize = None
        if x in inits:
            stored = numpy_helper.to_array(inits[x])
            if not weights or stored.dtype == np.int32:  # int32: a bias quantized to the product of scales stays as it is
                continue
            master = fresh(x[: -len("_quantized")] if x.endswith("_quantized") else f"{x}.float")
            graph.initializer.append(numpy_helper.from_array(dequantize(stored, scale, zp, axis=axis, block_size=block), master))
            requantized = fresh(f"{x}/requantized")
            q_attrs = {"axis": axis, **({"block_size": block} if block else {}),
                       **({} if zp is not None else {"output_dtype": helper.np_dtype_to_tensor_dtype(stored.dtype)})}
            quantize = fresh(f"{node.name}/quantize")
            before.setdefault(node.name, []).append(helper.make_node("QuantizeLinear", [master, *node.input[1:]], [requantized],
                                                                     name=quantize, **q_attrs))
            node.input[0] = requantized
            quantized, source, dtype = x, master, stored.dtype
        elif q is not None and q.op_type == "QuantizeLinear" and activations:
            source, dtype = q.input[0], (zp.dtype if zp is not None else np.dtype(np.uint8))
        else:
            continue
        shape = _shape_of(graph, inits, source, master)
        bounds = _bounds(scale, zp, dtype, shape, axis, block, node)
        if np.dtype(scale.dtype) != np.float32:
            raise QuantizationError(f"DequantizeLinear node {node.name!r} dequantizes to {scale.dtype}; odt_ops fine-tunes float32 QDQ models")
        lsq = None
        if learn_scales:
            lsq = _learned_scale(node, scale, zp, dtype, shape, axis, block, graph, fresh, before)
            learned.add(node.input[1])
        final = node.output[0]  # its readers (and a graph output) keep reading this name, now the STE's
        node.output[0] = fresh(f"{final}/quantized")
        nodes = _straight_through(node, source, bounds, graph, fresh, final, lsq)
        after[node.name] = nodes
        sites.append(Site(node.name, node.output[0], final, [*(n.name for n in nodes), *([quantize] if quantize else [])],
                          master, quantized, quantize))
    if not sites:
        return model, []
    ordered = []
    for node in graph.node:
        ordered += [*before.get(node.name, []), node, *after.get(node.name, [])]
    del graph.node[:]
    graph.node.extend(ordered)
    used = {i for n in graph.node for i in n.input}
    kept = [t for t in graph.initializer if t.name in used or t.name in {o.name for o in graph.output}]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    proto.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=json.dumps(
        {"version": 1, "sites": [asdict(s) for s in sites], "learned_scales": sorted(learned)})))
    prepared = Model(proto, base_dir=model.base_dir, source=model.source)
    if learned:  # normalizing again would fold the (scalar) scales into the bounds before they become parameters
        prepared.normalized, prepared.derived = True, set(model.derived)
        return prepared, sites
    return load_model(prepared), sites


# A stop-gradient made of standard float32 ops, exact for |v| < 2**107 (every value it meets: a
# clip range, a scale, an activation inside its range): coarse = v rounded to a multiple of 2**-21
# (v * 2**21 fits float32), then the remainder v - coarse (exact: both are multiples of v's ulp,
# and |remainder| <= 2**-22) is a multiple of 2**-149, so scaled by 2**149 (in two steps: 2**149
# is no float32) it is an integer that Round leaves as it is. coarse + remainder is v exactly, and
# Round's gradient is zero, so no gradient passes. (Before: one float64 chain, twice the bytes.)
_COARSE = 2.0 ** 21
_FINE = (2.0 ** 75, 2.0 ** 74)


class _Emitter:
    """Nodes (and their constants) for one site, named after its DequantizeLinear."""

    def __init__(self, graph, fresh, stem: str):
        self.graph, self.fresh, self.stem, self.nodes = graph, fresh, stem, []

    def const(self, value: np.ndarray, hint: str) -> str:
        name = self.fresh(f"{self.stem}/ste_{hint}")
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], hint: str, output: str | None = None, **attrs) -> str:
        out = output or self.fresh(f"{self.stem}/ste_{hint}_out")
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.fresh(f"{self.stem}/ste_{hint}"), **attrs))
        return out

    def scaled(self, value: str, factors, hint: str) -> str:
        for i, f in enumerate(factors):
            value = self.op("Mul", [value, self.const(np.array(f, np.float32), f"{hint}{i}")], f"{hint}{i}")
        return value

    def stop_gradient(self, value: str, hint: str) -> str:
        """``value`` itself (float32, exactly, |value| < 2**107), with no gradient: see _COARSE."""
        coarse = self.scaled(self.op("Round", [self.scaled(value, [_COARSE], f"{hint}_up")], f"{hint}_round"), [1 / _COARSE], f"{hint}_down")
        rest = self.op("Sub", [value, coarse], f"{hint}_rest")
        fine = self.op("Round", [self.scaled(rest, _FINE, f"{hint}_rest_up")], f"{hint}_rest_round")
        return self.op("Add", [coarse, self.scaled(fine, [1 / f for f in _FINE], f"{hint}_rest_down")], f"{hint}_frozen")


def _straight_through(node: onnx.NodeProto, source: str, bounds, graph, fresh, final: str, lsq=None) -> list:
    """final = DequantizeLinear's output + (c - stop_gradient(c)), c = x clipped to [lo, hi]:
    exactly the fake-quantized value forward, dy/dx = 1 inside the range and 0 outside.

    ``lsq`` = (scale as it broadcasts against x, (qmin - zp - 1/2, qmax - zp + 1/2) per channel):
    the bounds follow the learned scale. LSQ's scale gradient (torch._fake_quantize_learnable_
    per_*_affine's: round(x/s) - x/s inside the range, qmin - zp or qmax - zp outside) is
    DequantizeLinear's own, q - zp (odt_ops/grad/rules/quantize.py), plus the quantizer's -x/s inside
    the range, added by a term that is 0.0 forward: (s - stop_gradient(s)) * stop_gradient(-x/s)."""
    e = _Emitter(graph, fresh, node.name)
    dq = node.output[0]
    if isinstance(bounds[0], str):  # computed in the graph (a dynamic site's)
        lo, hi = bounds
    elif lsq is None:
        lo, hi = e.const(bounds[0], "lo"), e.const(bounds[1], "hi")
    else:
        scale, (k_lo, k_hi) = lsq
        frozen_scale = e.stop_gradient(scale, "scale")
        lo, hi = e.op("Mul", [frozen_scale, e.const(k_lo, "k_lo")], "lo"), e.op("Mul", [frozen_scale, e.const(k_hi, "k_hi")], "hi")
    if lsq is None:
        # zero = Where(inside, x - stop_gradient(x), 0): its gradient keeps one boolean per value
        # for the backward, where a clip (Min, Max) keeps two float32 copies of x
        inside = e.op("And", [e.op("Greater", [source, lo], "above"), e.op("Less", [source, hi], "below")], "inside")
        through = e.op("Sub", [source, e.stop_gradient(source, "x")], "through")
        zero = e.op("Where", [inside, through, e.const(np.array(0, np.float32), "nothing")], "zero")
        e.op("Add", [dq, zero], "ste", output=final)
        return e.nodes
    clipped = e.op("Max", [e.op("Min", [source, hi], "upper"), lo], "clipped")
    zero = e.op("Sub", [clipped, e.stop_gradient(clipped, "clip")], "zero")
    inside = e.op("Cast", [e.op("Equal", [clipped, source], "inside_bool")], "inside", to=onnx.TensorProto.FLOAT)
    g = e.op("Div", [e.op("Neg", [e.op("Mul", [inside, source], "x_inside")], "minus_x"), frozen_scale], "g")
    lsq_term = e.op("Mul", [e.op("Sub", [scale, frozen_scale], "scale_zero"), e.stop_gradient(g, "g")], "lsq")
    e.op("Add", [e.op("Add", [dq, zero], "ste_x"), lsq_term], "ste", output=final)
    return e.nodes


def _dynamic_site(node: onnx.NodeProto, q: onnx.NodeProto, graph, fresh, before, after) -> Site:
    """The STE for an activation quantized with its batch's scale and zero point (computed in the
    graph from the batch's min and max, as DynamicQuantizeLinear specifies). The DequantizeLinear
    and the clip range read the scale through a stop-gradient: as torch's fake quantization takes
    its observer's statistics, the scale is a constant to the gradient, which is then exactly the
    straight-through estimator's (the range holds the batch, so nothing but a rounding edge clips)."""
    if len(node.input) < 3 or not node.input[2]:
        raise QuantizationError(f"DequantizeLinear node {node.name!r}: a computed scale without a zero point is not the layout "
                                "DynamicQuantizeLinear writes; odt_ops fine-tunes computed scales only as quantize_dynamic writes them")
    qmin, qmax = integer_range(np.dtype(_elem_dtype(graph, node.input[0])))
    e = _Emitter(graph, fresh, node.name)
    scale_input = node.input[1]
    frozen = e.stop_gradient(scale_input, "scale")
    node.input[1] = frozen
    zp = e.op("Cast", [node.input[2]], "zero_point", to=onnx.TensorProto.FLOAT)
    lo = e.op("Mul", [e.op("Sub", [e.const(np.array(qmin - 0.5, np.float32), "qmin"), zp], "lo_steps"), frozen], "lo")
    hi = e.op("Mul", [e.op("Sub", [e.const(np.array(qmax + 0.5, np.float32), "qmax"), zp], "hi_steps"), frozen], "hi")
    before.setdefault(node.name, []).extend(e.nodes)
    final = node.output[0]
    node.output[0] = fresh(f"{final}/quantized")
    nodes = _straight_through(node, q.input[0], (lo, hi), graph, fresh, final)
    after[node.name] = nodes
    return Site(node.name, node.output[0], final, [*(n.name for n in e.nodes), *(n.name for n in nodes)], scale_input=scale_input)


def _elem_dtype(graph: onnx.GraphProto, value: str) -> np.dtype:
    """The element type shape inference gave ``value`` (uint8, DynamicQuantizeLinear's, if unknown)."""
    info = next((v for v in graph.value_info if v.name == value), None)
    elem = info.type.tensor_type.elem_type if info is not None else 0
    return helper.tensor_dtype_to_np_dtype(elem) if elem else np.dtype(np.uint8)


def _learned_scale(node, scale: np.ndarray, zp, dtype, shape, axis: int, block: int, graph, fresh, before) -> tuple[str, tuple]:
    """(the scale as it broadcasts against x, LSQ's per-channel constants) for ``node``."""
    if block:
        raise QuantizationError(f"DequantizeLinear node {node.name!r} is blocked (block_size={block}); learned scales (LSQ) cover "
                                "per-tensor and per-axis scales")
    qmin, qmax = integer_range(np.dtype(dtype))
    z = np.zeros_like(scale, dtype=np.float32) if zp is None else zp.astype(np.float32)
    k_lo, k_hi = (qmin - z - 0.5).astype(np.float32), (qmax - z + 0.5).astype(np.float32)
    name = node.input[1]
    if scale.size == 1:
        return name, (k_lo.reshape(()), k_hi.reshape(()))
    if shape is None:
        raise QuantizationError(f"DequantizeLinear node {node.name!r}: the rank of its input is unknown, so its per-axis scale cannot be placed")
    placed = [1] * len(shape)
    placed[axis if axis >= 0 else axis + len(shape)] = scale.size
    target = fresh(f"{node.name}/ste_scale_shape")
    graph.initializer.append(numpy_helper.from_array(np.array(placed, np.int64), target))
    reshaped = fresh(f"{name}/placed")
    before.setdefault(node.name, []).append(helper.make_node("Reshape", [name, target], [reshaped], name=fresh(f"{node.name}/ste_scale_place")))
    return reshaped, (k_lo.reshape(placed), k_hi.reshape(placed))


def _record(proto: onnx.ModelProto) -> dict:
    entry = next((p.value for p in proto.metadata_props if p.key == METADATA_KEY), None)
    return json.loads(entry) if entry else {}


def learned_scales(proto: onnx.ModelProto) -> list[str]:
    """The scales ``prepare(learn_scales=True)`` made trainable."""
    return list(_record(proto).get("learned_scales", []))



def _const(inits, name: str, node: onnx.NodeProto) -> np.ndarray:
    if name not in inits:
        raise QuantizationError(f"DequantizeLinear node {node.name!r}: its scale or zero point {name!r} is computed, not a constant; "
                                "odt_ops fine-tunes QDQ models whose scales and zero points are initializers")
    return numpy_helper.to_array(inits[name])


def _shape_of(graph, inits, value: str, master: str | None) -> tuple[int, ...] | None:
    if master is not None:
        return tuple(next(t.dims for t in graph.initializer if t.name == master))
    info = next((v for v in (*graph.value_info, *graph.input) if v.name == value), None)
    if info is None:
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else 1 for d in info.type.tensor_type.shape.dim)


def _bounds(scale, zp, dtype, shape, axis: int, block: int, node) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi): x rounds into [qmin, qmax] iff lo < x < hi; shaped to broadcast against x."""
    qmin, qmax = integer_range(np.dtype(dtype))
    if qmin is None:
        raise QuantizationError(f"DequantizeLinear node {node.name!r} reads {np.dtype(dtype)}; odt_ops fine-tunes int8, uint8, int16, uint16, "
                                "int4 and uint4 quantization")
    z = np.zeros_like(scale, dtype=np.float32) if zp is None else zp.astype(np.float32)
    lo, hi = (qmin - z - 0.5) * scale.astype(np.float32), (qmax - z + 0.5) * scale.astype(np.float32)
    if scale.size == 1 and block == 0:
        return lo.reshape(()).astype(scale.dtype), hi.reshape(()).astype(scale.dtype)
    if shape is None:
        raise QuantizationError(f"DequantizeLinear node {node.name!r}: the rank of its input is unknown, so its per-axis scale cannot be placed")
    return (broadcast_param(lo, shape, axis, block, "bound").astype(scale.dtype),
            broadcast_param(hi, shape, axis, block, "bound").astype(scale.dtype))


def read_sites(proto: onnx.ModelProto) -> list[Site]:
    entry = next((p.value for p in proto.metadata_props if p.key == METADATA_KEY), None)
    if entry is None:
        return []
    try:
        return [Site(**s) for s in json.loads(entry)["sites"]]
    except (ValueError, TypeError, KeyError) as exc:
        raise QuantizationError(f"the {METADATA_KEY!r} metadata is damaged ({exc})") from None
