"""ReLU of a fresh product in place, and the Sigmoid and Tanh gradients as one node each."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels.elementwise import relu_in_place
from odt_ops.kernels.parallel import elementwise
from odt_ops.runtime.fusion.graph import STANDARD, Factory, Graph, fused_node, fused_op, fusion, kernel_of

_FRESH_PRODUCTS = ("Gemm", "MatMul")  # their kernels always return a new array


@fusion("relu_in_place")
def _relu_of_product(g: Graph) -> bool:
    """Relu whose input is a Gemm or MatMul product nothing else reads -> one node that applies the
    ReLU over the product in place (no second array of the layer's size, no pass into fresh memory)."""
    changed = False
    for relu in [n for n in g.nodes if n.op_type == "Relu" and n.domain in STANDARD]:
        product = next((p for op in _FRESH_PRODUCTS if (p := g.producer(relu.input[0], op))), None)
        if product is None or g.sole_reader(product.output[0], "Relu") is not relu:
            continue
        fused = fused_node(f"{product.op_type}Relu", product.input, relu.output, f"fused/{product.name or product.output[0]}",
                            **node_attributes(product))
        changed = g.replace([product, relu], fused) or changed
    return changed


def _then_relu(op_type: str) -> Factory:
    def factory(attrs: dict, opset: int) -> Callable[..., tuple]:
        product, relu = kernel_of(op_type, opset, **attrs), kernel_of("Relu", opset)

        def run(*args, **engine):  # engine: the plan node's _products record, passed to the product
            y = product(*args, **engine)[0]
            # a product of two vectors comes back from numpy as a scalar, which has no memory to reuse
            return (relu_in_place(y),) if isinstance(y, np.ndarray) else relu(y)

        return run
    return factory


for _op in _FRESH_PRODUCTS:
    fused_op(f"{_op}Relu")(_then_relu(_op))


# ---------------------------------------------------------------- sigmoid and tanh gradients


@fusion("activation_grad")
def _activation_grad(g: Graph) -> bool:
    """The Sigmoid and Tanh gradient rules' three nodes -> one, which runs the same three ufuncs
    into one fresh array instead of three (an LSTM step has five such gradients, a SiLU one):
    Mul(dY, Mul(Y, Sub(1, Y))) -> SigmoidGrad(dY, Y, 1); Mul(dY, Sub(1, Mul(Y, Y))) -> TanhGrad(dY, Y, 1)."""
    changed = False
    for outer in [n for n in g.nodes if n.op_type == "Mul" and n.domain in STANDARD]:
        match = _activation_grad_match(g, outer)
        if match is not None:
            op_type, inner, y, one = match
            fused = fused_node(op_type, [outer.input[0], y, one], outer.output, f"fused/{outer.name or outer.output[0]}")
            changed = g.replace([*inner, outer], fused) or changed
    return changed


# fused op -> (the op producing the outer Mul's second input, the op producing that one's second input)
_ACTIVATION_GRADS = {"SigmoidGrad": ("Mul", "Sub"), "TanhGrad": ("Sub", "Mul")}


def _activation_grad_match(g: Graph, outer: onnx.NodeProto):
    """(fused op, the two inner nodes, Y, the constant 1) if ``outer`` ends one of the two rules."""
    for op_type, (first_op, second_op) in _ACTIVATION_GRADS.items():
        first = g.producer(outer.input[1], first_op)
        second = g.producer(first.input[1], second_op) if first else None
        if first is None or second is None or not (g.sole_reader(first.output[0], "Mul", 1) is outer
                and g.sole_reader(second.output[0], first_op, 1) is first):
            continue
        minus, product = (first, second) if first_op == "Sub" else (second, first)
        y = product.input[0]
        # Sigmoid: Mul(Y, Sub(1, Y)); Tanh: Sub(1, Mul(Y, Y))
        tail = minus.input[1] if op_type == "SigmoidGrad" else product.input[1]
        if tail == y and g.is_one(minus.input[0]):
            return op_type, [second, first], y, minus.input[0]
    return None


def _activation_grad_op(first_with_y: bool) -> Factory:
    """SigmoidGrad: t = 1 - Y; t = Y * t; dY * t. TanhGrad: t = Y * Y; t = 1 - t; dY * t. The same
    ufuncs on the same operands as the three nodes (a product or sum written into one of its
    own operands is the same product), so the same bits."""
    def factory(attrs: dict, opset: int) -> Callable[..., tuple]:
        mul, sub = kernel_of("Mul", opset), kernel_of("Sub", opset)

        def run(dY, Y, one):
            if dY.shape != Y.shape or dY.dtype != Y.dtype or Y.dtype not in (np.float32, np.float64) or one.dtype != Y.dtype:
                t = mul(Y, sub(one, Y)[0])[0] if first_with_y else sub(one, mul(Y, Y)[0])[0]
                return mul(dY, t)
            if first_with_y:
                t = np.subtract(one, Y)
                np.multiply(Y, t, out=t)
            else:
                t = np.multiply(Y, Y)
                np.subtract(one, t, out=t)
            np.multiply(dY, t, out=t)
            return (t,)

        return elementwise(run)  # large gradients: split across the BLAS thread count
    return factory


fused_op("SigmoidGrad")(_activation_grad_op(first_with_y=True))
fused_op("TanhGrad")(_activation_grad_op(first_with_y=False))
