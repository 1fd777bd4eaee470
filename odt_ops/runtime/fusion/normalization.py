"""BatchNormalization's and InstanceNormalization's training gradients as one node."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import numpy as np
import onnx

from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels.channels import per_channel
from odt_ops.runtime.fusion.graph import STANDARD, Graph, fused_node, fused_op, fusion, kernel_entry, kernel_of


@fusion("normalization_grad")
def _normalization_grad(g: Graph) -> bool:
    """The training-mode gradient of BatchNormalization (grad/rules/nn.py, _statistics_grad:
    nine passes over X-sized data, and some fifteen small per-channel nodes), or of
    InstanceNormalization, whose rule has the same shape with statistics per (n, c) instance -> one
    node that runs the same kernels and ufuncs on the same operands, into two arrays of X's size
    instead of six."""
    changed = False
    for sub in [n for n in g.nodes if n.op_type == "Sub" and n.domain in STANDARD]:
        match = _match_normalization_grad(g, sub)
        if match is not None:
            nodes, inputs, outputs, attrs = match
            fused = fused_node("NormalizationTrainingGrad", inputs, outputs, f"fused/{sub.name or sub.output[0]}", **attrs)
            changed = g.replace(nodes, fused) or changed
    return changed


class _Chain:
    """Walks producers from a node, remembering every node it passes, for one pattern match."""

    def __init__(self, g: Graph):
        self.g = g
        self.nodes: list[onnx.NodeProto] = []

    def __call__(self, name: str, op_type: str) -> onnx.NodeProto:
        node = self.g.producer(name, op_type)
        if node is None:
            raise LookupError(name)
        if all(node is not n for n in self.nodes):
            self.nodes.append(node)
        return node


def _match_normalization_grad(g: Graph, sub: onnx.NodeProto):
    """(nodes, inputs, outputs, attributes) if ``sub`` ends the rule's training gradient, else None.
    Every value inside stays inside, but d scale and sum(dY)."""
    walk = _Chain(g)
    try:
        p0, corr = walk(sub.input[0], "Mul"), walk(sub.input[1], "Add")
        ua, p1 = walk(p0.input[1], "Unsqueeze"), walk(corr.input[0], "Mul")
        ut, us = walk(p1.input[1], "Unsqueeze"), walk(corr.input[1], "Unsqueeze")
        tilt, shift = walk(ut.input[0], "Mul"), walk(us.input[0], "Mul")
        t2, t3 = walk(tilt.input[0], "Mul"), walk(shift.input[0], "Mul")
        a, t1 = walk(ua.input[0], "Mul"), walk(t2.input[1], "Mul")
        sum_dy, dscale = walk(t3.input[1], "ReduceSum"), walk(t1.input[1], "Mul")
        inv, e2 = walk(a.input[1], "Reciprocal"), walk(dscale.input[0], "Einsum")
        root = walk(inv.input[0], "Sqrt")
        shifted = walk(root.input[0], "Add")
        var = walk(shifted.input[0], "Mul")
        e1 = walk(var.input[0], "Einsum")
        centered = walk(e1.input[0], "Sub")
        mean = walk(centered.input[1], "ReduceMean")
    except LookupError:
        return None
    X, dY, c, count = centered.input[0], p0.input[0], centered.output[0], var.input[1]
    equation = node_attributes(e1).get("equation")
    same = [list(e1.input) == [c, c], list(e2.input) == [dY, c], node_attributes(e2).get("equation") == equation,
            list(p1.input) == [c, ut.output[0]], t2.input[0] == a.output[0], t3.input[0] == a.output[0],
            list(t1.input) == [inv.output[0], dscale.output[0]], dscale.input[1] == inv.output[0],
            tilt.input[1] == count and shift.input[1] == count, mean.input[0] == X, sum_dy.input[0] == dY,
            g.constant(shifted.input[1]) is not None, not _is_computed_inside(walk.nodes, count)]
    axes, reduced = g.ints(mean, 1, "axes"), g.ints(sum_dy, 1, "axes")
    spread = [g.ints(u, 1, "axes") for u in (ua, ut, us)]
    if not all(same) or not equation or axes is None or axes != reduced or spread[0] is None or any(s != spread[0] for s in spread) \
            or node_attributes(mean).get("keepdims", 1) != 1 or node_attributes(sum_dy).get("keepdims", 1) != 0 \
            or any(node_attributes(r).get("noop_with_empty_axes", 0) for r in (mean, sum_dy)):
        return None
    nodes = [*walk.nodes, sub]
    inside = {id(n) for n in nodes}
    leaving = (sub.output[0], dscale.output[0], sum_dy.output[0])
    if any(o not in leaving and (o in g.keep or any(id(r) not in inside for r in g.consumers(o))) for n in nodes for o in n.output):
        return None
    inputs = [X, dY, a.input[0], count, shifted.input[1]]
    return nodes, inputs, list(leaving), {"axes": axes, "equation": equation, "spread": spread[0]}


def _is_computed_inside(nodes: Sequence[onnx.NodeProto], name: str) -> bool:
    return any(name in n.output for n in nodes)


def reducer(op_type: str, opset: int, axes: list[int], keepdims: int) -> Callable[[np.ndarray], np.ndarray]:
    """The ``op_type`` kernel in force at ``opset`` over ``axes``, however that version takes its
    axes (an input from ReduceSum-13 and ReduceMean-18 on, an attribute before)."""
    entry = kernel_entry(op_type, opset)
    param = inspect.signature(entry.fn).parameters.get("axes")
    if param is not None and param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
        as_input = np.asarray(axes, dtype=np.int64)
        return lambda x: entry.fn(x, as_input, keepdims=keepdims)[0]
    return lambda x: entry.fn(x, axes=list(axes), keepdims=keepdims)[0]


@fused_op("NormalizationTrainingGrad")
def _normalization_training_grad(attrs: dict, opset: int) -> Callable[..., tuple]:
    return normalization_training_grad(attrs["axes"], attrs["equation"], attrs["spread"], opset)


def normalization_training_grad(axes: list[int], equation: str, spread: list[int], opset: int) -> Callable[..., tuple]:
    """The fused gradient's kernel: statistics over ``axes``, ``equation`` the rule's Einsum, the
    per-channel values unsqueezed at ``spread``. The channels-last graph (layout.py) runs it on
    (N*H*W, C) rows: axes [0], spread [0]."""
    mean, total = reducer("ReduceMean", opset, axes, 1), reducer("ReduceSum", opset, axes, 0)
    einsum = kernel_of("Einsum", opset, equation=equation)
    sqrt, reciprocal = kernel_of("Sqrt", opset), kernel_of("Reciprocal", opset)
    spread_axes = tuple(spread)
    # BatchNormalization's layout, one value per channel: every axis but 1 (X's rank is len(spread) + 1)
    channel_statistics = spread_axes == (0, *range(2, len(spread_axes) + 1))

    def along_channels(ufunc, x, v, out=None, *, kept=False):
        """ufunc(x, Unsqueeze(v, spread)), or ufunc(x, v) for a ``kept`` (keepdims) statistic."""
        if channel_statistics:
            return per_channel(ufunc, x, v, out=out)
        # InstanceNormalization's rule has the same shape, with one value per (n, c) instance
        return ufunc(x, v if kept else np.expand_dims(v, spread_axes), out=out)

    def run(X, dY, scale, count, eps):
        if dY.shape != X.shape or dY.dtype != X.dtype:
            raise AssertionError("NormalizationTrainingGrad: dY does not have X's shape and type")
        # one line per node of the rule, in its order; the two arrays of X's size are c and out
        c = along_channels(np.subtract, X, mean(X), kept=True)
        inv = reciprocal(sqrt(np.add(np.multiply(einsum(c, c)[0], count), eps))[0])[0]
        sum_dy = total(dY)
        dscale = np.multiply(einsum(dY, c)[0], inv)
        a = np.multiply(scale, inv)
        tilt = np.multiply(np.multiply(a, np.multiply(inv, dscale)), count)
        shift = np.multiply(np.multiply(a, sum_dy), count)
        correction = along_channels(np.multiply, c, tilt, out=c)
        along_channels(np.add, correction, shift, out=correction)
        out = along_channels(np.multiply, dY, a)
        return np.subtract(out, correction, out=out), dscale, sum_dy

    return run
