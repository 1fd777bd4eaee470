"""Dividing by a tensor's size (a mean's gradient) without the Size and CastLike nodes."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from odt_ops.runtime.fusion.graph import STANDARD, Graph, fused_node, fused_op, fusion, kernel_of


@fusion("divide_by_size")
def _divide_by_size(g: Graph) -> bool:
    """Div(a, CastLike(Size(x), like)) -> one node: the count is converted as a scalar instead of
    passing through two 0-d kernels (the mean loss's gradient scale, every step)."""
    changed = False
    for div in [n for n in g.nodes if n.op_type == "Div" and n.domain in STANDARD]:
        cast = g.producer(div.input[1], "CastLike")
        size = g.producer(cast.input[0], "Size") if cast else None
        if cast is None or size is None or not (g.sole_reader(cast.output[0], "Div", 1) is div and g.sole_reader(size.output[0], "CastLike", 0) is cast):
            continue
        fused = fused_node("DivideBySize", [div.input[0], size.input[0], cast.input[1]], div.output, f"fused/{div.name or div.output[0]}")
        changed = g.replace([size, cast, div], fused) or changed
    return changed


@fused_op("DivideBySize")
def _divide_by_size_op(attrs: dict, opset: int) -> Callable[..., tuple]:
    divide = kernel_of("Div", opset)

    def run(a, x, like):
        # CastLike(Size(x)) is the int64 count rounded once to like's type: the same scalar
        return divide(a, np.asarray(x.size, dtype=like.dtype))

    return run
