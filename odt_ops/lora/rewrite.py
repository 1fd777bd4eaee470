"""add_adapters: a forward model with a LoRA adapter beside each targeted weight.

For a node ``y = op(x, W)`` the rewrite renames its output ``y/base`` and adds

    y = y/base + scale * op_B(op_A(dropout(x), A), B)        scale = alpha / rank

where op_A, op_B are MatMul (A: [in, r], B: [r, out]), Gemm (alpha folded into the scale),
or for a Conv a convolution with the node's strides, pads and dilations by A
([r, in, *kernel]) followed by a 1x1 convolution by B ([out, r, 1, 1]), as peft does. A
grouped Conv (group=g, W: [out, in/g, *kernel]) keeps its groups: A is a grouped convolution
([r*g, in/g, *kernel], group=g) and B a grouped 1x1 ([out, r, 1, 1], group=g), so each group's
block of W gets its own rank-r update and the merge folds back into the grouped weight exactly
(peft's A mixes every input channel, which no grouped weight can hold, so peft cannot merge it). The
base weight is left exactly as stored (float, or int8/int4 behind a DequantizeLinear).
What was added is recorded in the model's metadata (``odt.lora``), so the merged and the
adapter exports can undo or fold it later.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from odt_ops.errors import LoraError
from odt_ops.ir.builder import unique_name
from odt_ops.ir.load import load_model
from odt_ops.ir.model import Model
from odt_ops.lora.config import LoraConfig
from odt_ops.lora.targets import Target, select

METADATA_KEY = "odt.lora"
METADATA_VERSION = 1


@dataclass(frozen=True)
class Adapter:
    """One adapter as recorded: the weight it sits beside and the names the rewrite made."""

    weight: str
    kind: str  # MatMul, Gemm or Conv
    A: str
    B: str
    scale: float  # what multiplies (x A) B, a Gemm's alpha included
    transposed: bool  # the node multiplies by the stored weight transposed
    dequantize: str | None
    nodes: list[str]  # the adapted nodes (their output was renamed <output>/base)
    added: list[str]  # the nodes the rewrite added
    outputs: list[list[str]]  # per adapted node: [base output, final output]
    group: int = 1  # a grouped Conv's groups (A and B are grouped convolutions)

    def delta(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """scale * A B in the stored weight's layout: what merging adds to the (dequantized) weight."""
        if self.kind == "Conv":  # group j's output channels o: W[o, i, *k] += scale * sum_r B[o, r] A[j*rank + r, i, *k]
            g = self.group
            blocks = np.matmul(b.reshape(g, b.shape[0] // g, b.shape[1]), a.reshape(g, a.shape[0] // g, -1))
            return self.scale * blocks.reshape(b.shape[0], *a.shape[1:])
        d = self.scale * (a.astype(np.float64) @ b.astype(np.float64))
        return d.T if self.transposed else d


def adapter_names(weight: str) -> tuple[str, str]:
    """peft's naming: ``fc1.weight`` (or onnxruntime's quantized ``fc1.weight_quantized``) -> ``fc1.lora_A``, ``fc1.lora_B``."""
    stem = weight.removesuffix("_quantized")
    stem = stem.removesuffix(".weight")
    return f"{stem}.lora_A", f"{stem}.lora_B"


def add_adapters(model: Model, config: LoraConfig) -> tuple[Model, list[Adapter]]:
    """A new normalized model with adapters (``model`` is untouched) and what was added."""
    if METADATA_KEY in {p.key for p in model.proto.metadata_props}:
        raise LoraError(f"{model.source}: the model already has LoRA adapters; merge them (odt_ops.lora.export_merged) before adding new ones")
    targets = select(model.graph, config, model.source)
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    graph = proto.graph
    taken = {t.name for t in graph.initializer} | {n.name for n in graph.node} | {v for n in graph.node for v in (*n.input, *n.output)}
    taken |= {i.name for i in graph.input}
    rng = np.random.default_rng(config.seed)
    by_name = {n.name: n for n in graph.node}
    position = {n.name: i for i, n in enumerate(graph.node)}
    inserts: dict[int, list[onnx.NodeProto]] = {}
    adapters = []
    for t in targets:
        a_name, b_name = (unique_name(n, taken) for n in adapter_names(t.weight))
        taken |= {a_name, b_name}
        a, b = _initial_values(t, config.rank, rng)
        graph.initializer.extend([numpy_helper.from_array(a, a_name), numpy_helper.from_array(b, b_name)])
        gemm_alpha = float(_attr(by_name[t.nodes[0]], "alpha", 1.0)) if t.kind == "Gemm" else 1.0
        scale = config.scale * gemm_alpha
        scale_name = unique_name(f"{a_name}/scale", taken)
        taken.add(scale_name)
        graph.initializer.append(numpy_helper.from_array(np.array(scale, t.dtype), scale_name))
        added, outputs = [], []
        for node_name in t.nodes:
            node = by_name[node_name]
            new_nodes, ends = _adapter_nodes(node, t, a_name, b_name, scale_name, config.dropout, taken)
            inserts.setdefault(position[node_name], []).extend(new_nodes)
            added += [n.name for n in new_nodes]
            outputs.append(ends)
        adapters.append(Adapter(t.weight, t.kind, a_name, b_name, scale, t.transposed, t.dequantize, list(t.nodes), added, outputs,
                                group=t.group))
    nodes = []
    for i, node in enumerate(graph.node):
        nodes.append(node)
        nodes.extend(inserts.get(i, []))
    del graph.node[:]
    graph.node.extend(nodes)
    proto.metadata_props.append(onnx.StringStringEntryProto(key=METADATA_KEY, value=json.dumps(
        {"version": METADATA_VERSION, "rank": config.rank, "alpha": float(config.alpha), "dropout": float(config.dropout),
         "adapters": [a.__dict__ for a in adapters]})))
    out = Model(proto, base_dir=model.base_dir, source=model.source, derived=set(model.derived))
    return load_model(out), adapters


def _attr(node: onnx.NodeProto, name: str, default):
    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), default)


def _initial_values(t: Target, rank: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A Kaiming-uniform with a=sqrt(5) over fan_in (torch's and peft's init), B zeros."""
    fan_in = t.in_features * int(np.prod(t.kernel, dtype=np.int64))
    bound = 1.0 / np.sqrt(fan_in)
    if t.kind == "Conv":
        a = rng.uniform(-bound, bound, (rank * t.group, t.in_features, *t.kernel))  # in_features: a group's input channels
        b = np.zeros((t.out_features, rank) + (1,) * len(t.kernel))
    else:
        a = rng.uniform(-bound, bound, (t.in_features, rank))
        b = np.zeros((rank, t.out_features))
    return a.astype(t.dtype), b.astype(t.dtype)


def _adapter_nodes(node: onnx.NodeProto, t: Target, a: str, b: str, scale: str, dropout: float, taken: set[str]):
    """The nodes computing y = y/base + scale * (x A) B after ``node``; renames its output."""
    def fresh(hint: str) -> str:
        name = unique_name(hint, taken)
        taken.add(name)
        return name

    y = node.output[0]
    base = fresh(f"{y}/base")
    node.output[0] = base
    stem = f"{node.name}/lora"
    x = node.input[0]
    nodes = []
    if dropout > 0:
        ratio = fresh(f"{stem}/dropout_ratio")
        nodes.append(helper.make_node("Constant", [], [ratio], name=fresh(f"{stem}/ratio"), value=numpy_helper.from_array(np.array(dropout, t.dtype))))
        dropped = fresh(f"{stem}/x")
        nodes.append(helper.make_node("Dropout", [x, ratio], [dropped], name=fresh(f"{stem}/dropout")))
        x = dropped
    xa, xab = fresh(f"{stem}/xA"), fresh(f"{stem}/xAB")
    if t.kind == "Conv":
        conv_attrs = {at.name: helper.get_attribute_value(at) for at in node.attribute if at.name in ("strides", "pads", "dilations", "auto_pad")}
        grouped: dict[str, Any] = {"group": t.group} if t.group > 1 else {}
        nodes.append(helper.make_node("Conv", [x, a], [xa], name=fresh(f"{stem}/A"), **conv_attrs, **grouped))
        nodes.append(helper.make_node("Conv", [xa, b], [xab], name=fresh(f"{stem}/B"), **grouped))
    else:
        nodes.append(helper.make_node("MatMul", [x, a], [xa], name=fresh(f"{stem}/A")))
        nodes.append(helper.make_node("MatMul", [xa, b], [xab], name=fresh(f"{stem}/B")))
    delta = fresh(f"{stem}/delta")
    nodes.append(helper.make_node("Mul", [xab, scale], [delta], name=fresh(f"{stem}/scale")))
    nodes.append(helper.make_node("Add", [base, delta], [y], name=fresh(f"{stem}/add")))
    return nodes, [base, y]


def read_adapters(proto: onnx.ModelProto, what: str = "model") -> tuple[dict, list[Adapter]]:
    """The ``odt.lora`` record of a model the rewrite made (its training or eval artifacts too)."""
    entry = next((p.value for p in proto.metadata_props if p.key == METADATA_KEY), None)
    if entry is None:
        raise LoraError(f"{what}: no {METADATA_KEY!r} metadata; it has no LoRA adapters (generate the artifacts with lora=LoraConfig(...))")
    try:
        data = json.loads(entry)
        if data.get("version") != METADATA_VERSION:
            raise LoraError(f"{what}: LoRA metadata version {data.get('version')!r} is not {METADATA_VERSION}; upgrade odt")
        return data, [Adapter(**a) for a in data["adapters"]]
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise LoraError(f"{what}: the {METADATA_KEY!r} metadata is damaged ({exc})") from None
