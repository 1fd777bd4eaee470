"""Express a model built at our opset (21) at an older one, as ONNX Runtime kept artifacts
at the base model's opset.

onnx's version converter cannot go down for most ops (no adapter from CastLike-15,
Relu-14, Pow-15, BatchNormalization-15, ...), yet between opset 13 and 21 most ops
changed only their type lists. So each node is checked against the schema the target
opset selects: where only types changed, the node is kept as written (onnx.checker's
strict shape inference then holds every type and attribute to the target's schema);
where the signature changed, a small adapter rewrites the node (a CastLike becomes a
Cast, a Reduce's axes input becomes its attribute, an attribute the old version lacks
and that holds its default is dropped). Anything else is refused by name, before a file
is written.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import defs, helper, numpy_helper

from odt_ops.domain import default_opset, is_default
from odt_ops.errors import ArtifactError
from odt_ops.ir.load import ir_version_for

LOWEST = 13  # below it Softmax and its kin change meaning under the same signature

_REDUCE_AXES_INPUT = {"ReduceMean": 18, "ReduceMax": 18, "ReduceMin": 18, "ReduceProd": 18, "ReduceSumSquare": 18,
                      "ReduceL1": 18, "ReduceL2": 18, "ReduceLogSum": 18, "ReduceLogSumExp": 18, "ReduceSum": 13}
# (op, attribute, default, the first opset that has the attribute): dropped below it when it holds its default
_NEW_ATTRIBUTES = [("Reshape", "allowzero", 0, 14), ("BatchNormalization", "training_mode", 0, 14),
                   ("ScatterElements", "reduction", "none", 16), ("ScatterND", "reduction", "none", 16),
                   ("AveragePool", "dilations", None, 19), ("Cast", "saturate", 1, 19)]


def lower_opset(model: onnx.ModelProto, target: int, what: str) -> onnx.ModelProto:
    """``model`` (at opset 21 or lower) rewritten for ``target``; ArtifactError names every node that cannot be."""
    current = default_opset(model.opset_import, target)
    if target >= current:
        return model
    if target < LOWEST:
        raise ArtifactError(f"{what}: artifacts can be written at opset {LOWEST} or later, not {target}")
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    types, ranks = _types(lowered)
    constants = {t.name: t for t in lowered.graph.initializer}
    problems = []
    for node in lowered.graph.node:
        problem = _lower_node(node, target, types, constants)
        if problem is None and node.op_type == "Pad" and is_default(node.domain) and target < 18:
            problem = _pad_axes_to_full(node, ranks, constants, lowered.graph)
        if problem:
            problems.append(f"{node.name or node.op_type} ({node.op_type}): {problem}")
    if problems:
        raise ArtifactError(f"{what}: cannot be written at opset {target}:\n  " + "\n  ".join(problems)
                            + f"\nGenerate at a later opset (opset={current}) or re-export the model at one")
    for o in lowered.opset_import:
        if is_default(o.domain):
            o.version = target
    lowered.ir_version = ir_version_for(target)
    used = {n for node in lowered.graph.node for n in node.input}
    unused = [t for t in lowered.graph.initializer if t.name not in used]  # axes now held as attributes
    for t in unused:
        lowered.graph.initializer.remove(t)
    try:
        onnx.checker.check_model(lowered, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ArtifactError(f"{what}: cannot be written at opset {target}: {str(exc)[:500]}\n"
                            f"Generate at a later opset (opset={current})") from None
    return lowered


def _lower_node(node: onnx.NodeProto, target: int, types: dict, constants: dict) -> str | None:
    if not is_default(node.domain):
        return None
    if node.op_type == "CastLike" and target < 15:
        like = types.get(node.input[1])
        if like is None:
            return "the type to cast to is unknown"
        node.op_type = "Cast"
        del node.input[1:]
        node.attribute.append(helper.make_attribute("to", like))
        return None
    try:
        schema = defs.get_schema(node.op_type, target)
    except defs.SchemaError:
        return f"{node.op_type} does not exist at opset {target}"
    if schema.deprecated:
        return f"{node.op_type} is deprecated at opset {target}"
    if any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
        return None  # control flow: its bodies are checked with the graph
    since = _REDUCE_AXES_INPUT.get(node.op_type)
    if since is not None and target < since:
        problem = _axes_to_attribute(node, constants)
        if problem:
            return problem
    if node.op_type == "Split" and target < 18:
        _drop_attribute(node, "num_outputs")  # Split-13 with no sizes splits evenly among its outputs, as num_outputs does
    for op, name, default, first in _NEW_ATTRIBUTES:
        if node.op_type == op and target < first:
            attr = next((a for a in node.attribute if a.name == name), None)
            if attr is not None:
                if default is not None and helper.get_attribute_value(attr) not in (default, default.encode() if isinstance(default, str) else default):
                    return f"{name}={helper.get_attribute_value(attr)!r} needs opset {first}"
                if default is None and any(v != 1 for v in helper.get_attribute_value(attr)):
                    return f"{name} other than 1 needs opset {first}"
                _drop_attribute(node, name)
    return None


def _axes_to_attribute(node: onnx.NodeProto, constants: dict) -> str | None:
    noop = next((a.i for a in node.attribute if a.name == "noop_with_empty_axes"), 0)
    if noop:
        return "noop_with_empty_axes=1 needs opset 18"
    _drop_attribute(node, "noop_with_empty_axes")
    if len(node.input) < 2 or not node.input[1]:
        return None
    axes = constants.get(node.input[1])
    if axes is None:
        return f"its axes {node.input[1]!r} are computed, and before opset 18 they must be an attribute"
    del node.input[1:]
    node.attribute.append(helper.make_attribute("axes", [int(a) for a in np.atleast_1d(numpy_helper.to_array(axes))]))
    return None


def _pad_axes_to_full(node: onnx.NodeProto, ranks: dict, constants: dict, graph: onnx.GraphProto) -> str | None:
    """Pad-18's ``axes`` input (the pads of some axes only) as Pad-13's pads for every axis."""
    if len(node.input) < 4 or not node.input[3]:
        return None
    axes, pads, rank = constants.get(node.input[3]), constants.get(node.input[1]), ranks.get(node.input[0])
    if axes is None or pads is None or rank is None:
        return "its axes or pads are computed, or its input's rank is unknown; before opset 18 Pad takes pads for every axis"
    listed = [int(a) % rank for a in np.atleast_1d(numpy_helper.to_array(axes))]
    given = [int(p) for p in numpy_helper.to_array(pads).reshape(-1)]
    full = [0] * (2 * rank)
    for i, axis in enumerate(listed):
        full[axis], full[rank + axis] = given[i], given[len(listed) + i]
    name = f"{node.input[1]}/rank{rank}_axes{'_'.join(map(str, listed))}"  # pads constants are shared between nodes
    if name not in constants:
        constants[name] = numpy_helper.from_array(np.asarray(full, dtype=np.int64), name)
        graph.initializer.append(constants[name])
    node.input[1] = name
    del node.input[3:]
    return None


def _drop_attribute(node: onnx.NodeProto, name: str) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)


def _types(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]]:
    """Every value's element type and, where known, its rank."""
    inferred = onnx.shape_inference.infer_shapes(model).graph
    values = [v for v in (*inferred.input, *inferred.value_info, *inferred.output) if v.type.HasField("tensor_type")]
    types = {v.name: v.type.tensor_type.elem_type for v in values}
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in values if v.type.tensor_type.HasField("shape")}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    ranks.update({t.name: len(t.dims) for t in model.graph.initializer})
    return types, ranks
