"""A per-channel affine's scale gradient, ReduceSum(Mul(dY, x)), as one node.

GroupNorm's export scales by Mul(normalized, gamma[C, 1, 1]); the gradient rule writes gamma's
gradient as the product dY * normalized, then ReduceSum over every axis but the channels. As one
node the product is never materialized: the per-(n, c) plane dot products run through BLAS
(kernels/reduce.py's row_dots, from planes of ROW_DOT_MIN elements) and the batch's are added. That sums in another order than the ReduceSum kernel, so the
result differs from the graph as written by float rounding only; every other operand shape,
dtype or axis set runs the Mul and ReduceSum kernels themselves, bit-equal to the graph.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels.reduce import ROW_DOT_MIN, row_dots
from odt_ops.runtime.fusion.graph import STANDARD, Graph, fused_node, fused_op, fusion, kernel_of
from odt_ops.runtime.fusion.normalization import reducer


@fusion("product_sum")
def _product_sum(g: Graph) -> bool:
    """ReduceSum(Mul(a, b), constant axes 0, 2, 3...) whose product nothing else reads -> ProductSum(a, b)."""
    changed = False
    for reduce in [n for n in g.nodes if n.op_type == "ReduceSum" and n.domain in STANDARD]:
        mul = g.producer(reduce.input[0], "Mul")
        axes = g.ints(reduce, 1, "axes")
        attrs = node_attributes(reduce)
        if mul is None or not axes or attrs.get("noop_with_empty_axes", 0) or g.sole_reader(mul.output[0], "ReduceSum", 0) is not reduce:
            continue
        if sorted(axes) != [0, *range(2, len(axes) + 1)]:
            continue  # not the channel sums (LayerNorm's and Softmax's gradients): nothing to gain
        fused = fused_node("ProductSum", list(mul.input), list(reduce.output), f"fused/{reduce.name or reduce.output[0]}",
                           axes=axes, keepdims=int(attrs.get("keepdims", 1)))
        changed = g.replace([mul, reduce], fused) or changed
    return changed


@fused_op("ProductSum")
def _product_sum_op(attrs: dict, opset: int) -> Callable[..., tuple]:
    return product_sum(list(attrs["axes"]), int(attrs["keepdims"]), opset)


def product_sum(axes: list[int], keepdims: int, opset: int) -> Callable[..., tuple]:
    """The fused node's kernel: sum(a * b) over ``axes``."""
    multiply, total = kernel_of("Mul", opset), reducer("ReduceSum", opset, axes, keepdims)

    def run(a, b):
        rank = a.ndim
        if a.shape == b.shape and a.dtype == b.dtype and a.dtype in (np.float32, np.float64) and rank >= 3 \
                and sorted(x % rank for x in axes) == [0, *range(2, rank)] and math.prod(a.shape[2:]) >= ROW_DOT_MIN:
            n, c = a.shape[:2]
            # one dot product per (n, c) plane, then the batch's added: no product array
            planes = row_dots(np.ascontiguousarray(a).reshape(n, c, -1), np.ascontiguousarray(b).reshape(n, c, -1))
            sums = np.add.reduce(planes, axis=0)
            return (sums.reshape((1, c) + (1,) * (rank - 2)) if keepdims else sums,)
        return (total(multiply(a, b)[0]),)

    return run
