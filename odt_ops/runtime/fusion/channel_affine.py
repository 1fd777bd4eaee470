"""A per-channel affine, Add(Mul(x, gamma), beta) and the ReLU that often follows, as one node.

GroupNorm's export ends Reshape -> Mul(gamma[C, 1, 1]) -> Add(beta[C, 1, 1]), and a ReLU comes
next. numpy broadcasts a [C, 1, 1] operand one short spatial row at a time; kernels/channels.py's
per_channel runs the same operation element by element over whole images, so the same bits, and
the sum and the ReLU are written over the product's array instead of two fresh ones: at UNet's
(32, 16, 32, 32) the Mul and Add took 0.23 ms, the fused pair 0.13 ms (one thread, Zen 4 under load).
Operands of any other shape run the Mul, Add (and Relu) kernels themselves.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from odt_ops.kernels.channels import per_channel
from odt_ops.kernels.elementwise import relu_in_place
from odt_ops.runtime.fusion.graph import STANDARD, Graph, fused_node, fused_op, fusion, kernel_of


@fusion("channel_affine")
def _channel_affine(g: Graph) -> bool:
    """Add(Mul(a, b), c), the product read by nothing else, one factor and c stored values, and a Relu
    that alone reads the sum -> ChannelAffine(a, b, c) (with relu=1 when the Relu is taken in)."""
    changed = False
    for add in [n for n in g.nodes if n.op_type == "Add" and n.domain in STANDARD]:
        mul = next((m for i in (0, 1) if (m := g.producer(add.input[i], "Mul")) is not None
                    and g.sole_reader(m.output[0], "Add") is add), None)
        if mul is None or len(set(add.input)) != 2:
            continue
        bias_first = int(add.input[0] != mul.output[0])
        if not (any(_stored(g, v) for v in mul.input) and _stored(g, add.input[1 - bias_first])):
            continue
        relu = g.sole_reader(add.output[0], "Relu", 0)
        nodes, outputs = ([mul, add, relu], relu.output) if relu is not None else ([mul, add], add.output)
        fused = fused_node("ChannelAffine", [*mul.input, add.input[0] if bias_first else add.input[1]],
                           outputs, f"fused/{add.name or add.output[0]}", bias_first=bias_first, relu=int(relu is not None))
        changed = g.replace(nodes, fused) or changed
    return changed


def _stored(g: Graph, name: str) -> bool:
    """Whether ``name`` is a stored value (a parameter, a constant) or one reshaped (GroupNorm's
    gamma and beta are Unsqueezed parameters): an affine's operand, not a value computed from the
    data such as an LSTM step's gates, whose products and sums the recurrent cell passes match."""
    node = g.made_by(name)
    if node is not None and node.op_type in ("Unsqueeze", "Reshape", "Identity") and node.domain in STANDARD:
        node = g.made_by(node.input[0])
    return node is None


@fused_op("ChannelAffine")
def _channel_affine_op(attrs: dict, opset: int) -> Callable[..., tuple]:
    return channel_affine(int(attrs.get("bias_first", 0)), int(attrs.get("relu", 0)), opset)


def _channel_values(v: np.ndarray, x: np.ndarray) -> bool:
    """Whether ``v`` holds one value per channel of ``x`` (N, C, ...), shaped to broadcast along axis 1."""
    c = x.shape[1]
    return v.dtype == x.dtype and v.size == c and v.ndim in (x.ndim - 1, x.ndim) \
        and v.shape[v.ndim - x.ndim + 1] == c


def channel_affine(bias_first: int, relu: int, opset: int) -> Callable[..., tuple]:
    """The fused node's kernel: Add(Mul(a, b), c) (Add(c, ...) when ``bias_first``), then Relu."""
    multiply, add, rectify = kernel_of("Mul", opset), kernel_of("Add", opset), kernel_of("Relu", opset)

    def run(a, b, c):
        x, scale = (a, b) if a.ndim >= b.ndim else (b, a)
        if x.ndim >= 3 and x.dtype.kind == "f" and _channel_values(scale, x) and _channel_values(c, x):
            # a product and a sum of two operands do not depend on their order: the same bits either way
            y = per_channel(np.multiply, x, scale)
            per_channel(np.add, y, c, out=y)
            return (relu_in_place(y) if relu else y,)
        product = multiply(a, b)[0]
        y = add(c, product)[0] if bias_first else add(product, c)[0]
        return rectify(y) if relu else (y,)

    return run
