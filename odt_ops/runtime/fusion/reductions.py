"""A keepdims reduction whose only reader squeezes the reduced axes, as one reduction."""
from __future__ import annotations

import onnx

from odt_ops.ir.attributes import node_attributes
from odt_ops.runtime.fusion.graph import STANDARD, Graph, fusion

_REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
           "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")


@fusion("reduce_squeeze")
def _reduce_squeeze(g: Graph) -> bool:
    """Reduce*(keepdims=1) whose only reader squeezes exactly the reduced axes -> Reduce*(keepdims=0)
    (the gradient walker's unbroadcast emits this for every bias)."""
    changed = False
    for reduce in [n for n in g.nodes if n.op_type in _REDUCE and n.domain in STANDARD]:
        attrs = node_attributes(reduce)
        squeeze = g.sole_reader(reduce.output[0], "Squeeze", 0)
        if squeeze is None or attrs.get("keepdims", 1) != 1 or attrs.get("noop_with_empty_axes", 0):
            continue
        axes, squeezed = g.ints(reduce, 1, "axes"), g.ints(squeeze, 1, "axes")
        if not axes or squeezed is None or sorted(axes) != sorted(squeezed):
            continue
        rewritten = onnx.NodeProto()
        rewritten.CopyFrom(reduce)
        rewritten.output[0] = squeeze.output[0]
        del rewritten.attribute[:]
        rewritten.attribute.extend(a for a in reduce.attribute if a.name != "keepdims")
        rewritten.attribute.append(onnx.helper.make_attribute("keepdims", 0))
        changed = g.replace([reduce, squeeze], rewritten) or changed
    return changed
