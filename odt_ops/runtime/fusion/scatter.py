"""Gradients scattered into fresh zeros (MaxPool's), with the ReLU mask folded in."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels._fast import BITS
from odt_ops.runtime.fusion.graph import DOMAIN, STANDARD, Graph, fused_node, fused_op, fusion


@fusion("scatter_into_zeros")
def _scatter_into_zeros(g: Graph) -> bool:
    """ScatterElements (none or add) into a fresh 1-D ConstantOfShape of zeros -> one node that
    scatters into np.zeros (the zeros are not filled, then copied again; MaxPool's gradient)."""
    changed = False
    for scatter in [n for n in g.nodes if n.op_type == "ScatterElements" and n.domain in STANDARD]:
        attrs = node_attributes(scatter)
        fill = g.producer(scatter.input[0], "ConstantOfShape")
        if fill is None or g.sole_reader(fill.output[0], "ScatterElements", 0) is not scatter:
            continue
        value = node_attributes(fill).get("value")
        value = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
        zero = value.size == 1 and value[0] == 0 and not np.signbit(value[0])
        if not zero or attrs.get("axis", 0) not in (0, -1) or attrs.get("reduction", "none") not in ("none", "add") \
                or not _one_long(g, fill.input[0]):
            continue
        fused = fused_node("ScatterIntoZeros", [fill.input[0], scatter.input[1], scatter.input[2]], [scatter.output[0]],
                            f"fused/{scatter.name or scatter.output[0]}", reduction=attrs.get("reduction", "none"),
                            dtype=onnx.helper.np_dtype_to_tensor_dtype(value.dtype))
        changed = g.replace([fill, scatter], fused) or changed
    return changed


def _one_long(g: Graph, shape: str) -> bool:
    """Whether the shape tensor ``shape`` has one element (the data is 1-D)."""
    value = g.constant(shape)
    if value is not None:
        return value.shape == (1,)
    reshape = g.producer(shape, "Reshape")
    target = reshape and g.constant(reshape.input[1])
    return target is not None and target.tolist() == [1]


@fusion("relu_masked_scatter")
def _relu_masked_scatter(g: Graph) -> bool:
    """Where(Greater(Y, 0), Reshape(ScatterIntoZeros(...), Shape(Y)), 0) -> the scatter keeps only the
    updates whose target in Y is positive (ReLU's gradient through MaxPool's, at the pooled size
    instead of the input's)."""
    changed = False
    for where in [n for n in g.nodes if n.op_type == "Where" and n.domain in STANDARD]:
        greater = g.producer(where.input[0], "Greater")
        reshape = g.producer(where.input[1], "Reshape")
        if not (greater and reshape and g.is_zero(greater.input[1]) and g.is_zero(where.input[2])):
            continue
        y = greater.input[0]
        shape = g.producer(reshape.input[1], "Shape")
        scatter = g.producer(reshape.input[0], "ScatterIntoZeros", (DOMAIN,))
        if not (shape and scatter and shape.input[0] == y and not node_attributes(shape) and len(scatter.input) == 3
                and g.sole_reader(reshape.output[0], "Where", 1) is where
                and g.sole_reader(scatter.output[0], "Reshape", 0) is reshape):
            continue
        fused = fused_node("ScatterIntoZeros", [*scatter.input, y], [where.output[0]], f"fused/{where.name or where.output[0]}",
                            **node_attributes(scatter))
        # the mask and the shape go too unless something else reads them
        spent = [n for n, reader in ((greater, "Where"), (shape, "Reshape")) if g.sole_reader(n.output[0], reader)]
        changed = g.replace([where, reshape, scatter, *spent], fused) or changed
    return changed


@fused_op("ScatterIntoZeros")
def _scatter_into_zeros_op(attrs: dict, opset: int) -> Callable[..., tuple]:
    reduction, dtype = attrs["reduction"], onnx.helper.tensor_dtype_to_np_dtype(attrs["dtype"])

    def run(shape, indices, updates, masked_by=None):
        n = int(shape.reshape(-1)[0])
        if indices.ndim != 1 or updates.shape != indices.shape or updates.dtype != dtype:
            raise ValueError(f"ScatterElements into {n} zeros of {dtype}: indices {indices.shape} and updates "
                             f"{updates.dtype}{updates.shape} must be 1-D of one shape and the zeros' dtype")
        out = np.zeros(n, dtype)
        if masked_by is not None:
            if masked_by.size != n:
                raise ValueError(f"cannot reshape {n} scattered values to {masked_by.shape}")
            # Where(Y > 0, scattered, 0) decided at the scattered positions only: elsewhere both are 0
            updates = _zero_unless(np.take(masked_by.reshape(-1), indices) > masked_by.dtype.type(0), updates)
        if reduction == "none":
            out[indices] = updates
        else:
            np.add.at(out, indices, updates)
        return (out if masked_by is None else out.reshape(masked_by.shape),)

    return run


def _zero_unless(keep: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Where(keep, values, +0) as one AND of the raw bits with 0 / all-ones: np.where branches
    per element, ten times slower on an unpredictable mask."""
    bits = BITS.get(values.dtype.itemsize)
    if bits is None or values.dtype.kind == "c":
        return np.where(keep, values, values.dtype.type(0))
    mask = np.negative(keep.view(np.int8), dtype=bits)  # True (1) -> -1: every bit set
    return np.bitwise_and(mask, values.view(bits), out=mask).view(values.dtype)
