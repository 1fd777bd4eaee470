"""Ops that ONNX defines as functions of other ops run as those functions.

Many newer ops of the default domain (Swish, RMSNormalization, MeanVarianceNormalization,
Attention, RotaryEmbedding, AffineGrid, CenterCropPad, the window functions, ...) come
with a function body in their schema: the spec's own expansion into simpler ops. A node
of such an op that the engine has no kernel for is replaced, at load, by that body (the
context-dependent ones are built for the node's attributes and input types). The
existing kernels then run it and the existing gradient rules differentiate it, and the
artifacts stay standard ONNX, at the price of a few more nodes than a fused kernel.
"""
from __future__ import annotations

import onnx
import onnx.inliner
from onnx import defs, helper

from odt_ops.domain import is_default
from odt_ops.errors import ModelCheckError
from odt_ops.ir.model import Model
from odt_ops.kernels import lookup

EXPANDED = "odt.expanded"  # the local-function domain the bodies pass through while inlined
_ROUNDS = 8  # bodies may use other function ops (Attention -> Softmax is a kernel, RMSNorm -> ...)


def expand_function_ops(model: Model) -> bool:
    """Replace every top-level node whose op has no kernel but a schema function body by the body."""
    changed = False
    for _ in range(_ROUNDS):
        if not _expand_once(model):
            return changed
        changed = True
    return changed


def _expand_once(model: Model) -> bool:
    proto = model.proto
    opset = model.opset
    candidates = [n for n in proto.graph.node if is_default(n.domain) and lookup("", n.op_type, opset) is None]
    if not candidates:
        return False
    types = None
    functions = []
    for i, node in enumerate(candidates):
        try:
            schema = defs.get_schema(node.op_type, opset)
        except defs.SchemaError:
            continue
        body = None
        # the body as the spec writes it for the latest opset it has one for, up to the model's
        versions = [v for v in schema.function_opset_versions if v <= opset]  # type: ignore[attr-defined]  # onnx's stubs lack it
        cd_versions = [v for v in schema.context_dependent_function_opset_versions if v <= opset]  # type: ignore[attr-defined]
        if versions:
            body = onnx.FunctionProto()
            body.ParseFromString(schema.get_function_with_opset_version(max(versions)))  # type: ignore[attr-defined]
        elif cd_versions:
            if types is None:
                types = _input_types(proto)
            missing = [x for x in node.input if x and x not in types]
            if missing:
                raise ModelCheckError(f"{model.source}: {node.op_type} node {node.name!r} is expanded into its ONNX function, "
                                      f"which needs the types of {missing}; they are unknown")
            inputs = [types[x].SerializeToString() if x else onnx.TypeProto().SerializeToString() for x in node.input]
            node_with_defaults = _with_default_attributes(node, schema)
            built = schema.get_context_dependent_function_with_opset_version(  # type: ignore[attr-defined]
                max(cd_versions), node_with_defaults.SerializeToString(), inputs)
            if not built:
                continue
            body = onnx.FunctionProto()
            body.ParseFromString(built)
        if body is None:
            continue
        _fill_default_attributes(node, schema)
        body.domain, body.name = EXPANDED, f"{node.op_type}_{i}"
        # at the model's opset, or the inliner leaves the call in place (the body's ops are the
        # spec's choice for an opset at most the model's, and their meaning holds up to it)
        kept = [o for o in body.opset_import if not is_default(o.domain)]
        del body.opset_import[:]
        body.opset_import.extend([*kept, helper.make_opsetid("", opset)])
        node.domain, node.op_type = EXPANDED, body.name
        functions.append(body)
    if not functions:
        return False
    proto.functions.extend(functions)
    proto.opset_import.append(helper.make_opsetid(EXPANDED, 1))
    inlined = onnx.inliner.inline_local_functions(proto)
    del inlined.functions[:]
    kept = [o for o in inlined.opset_import if o.domain != EXPANDED]
    del inlined.opset_import[:]
    inlined.opset_import.extend(kept)
    model.proto = inlined
    model.forget_arrays()
    return True


def _input_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True).graph
    types = {v.name: v.type for v in (*inferred.input, *inferred.value_info, *inferred.output)}
    for t in proto.graph.initializer:
        types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    return types


def _with_default_attributes(node: onnx.NodeProto, schema) -> onnx.NodeProto:
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    _fill_default_attributes(copy, schema)
    return copy


def _fill_default_attributes(node: onnx.NodeProto, schema) -> None:
    """Spell out the schema's defaults: a function body's reference to an attribute the node
    leaves unset would otherwise fall back to the default of the inner op, not of this one."""
    given = {a.name for a in node.attribute}
    for name, attr in schema.attributes.items():
        default = attr.default_value
        if name not in given and default is not None and default.type != onnx.AttributeProto.UNDEFINED:
            value = onnx.AttributeProto()
            value.CopyFrom(default)
            value.name = name
            node.attribute.append(value)
