"""ProductSum (runtime/fusion/product_sum.py): sum(a * b) over every axis but the channels by
per-plane dot products (planes of ROW_DOT_MIN elements on), against a float64 numpy oracle; any other form runs the Mul and ReduceSum
kernels themselves, bit-equal to the two nodes; and the pass matches only a product nothing else reads."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from odt_ops.runtime.fusion import fuse
from odt_ops.runtime.fusion.graph import kernel_of
from odt_ops.runtime.fusion.normalization import reducer
from odt_ops.runtime.fusion.product_sum import product_sum


def _pair(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 2 + 0.5).astype(dtype), rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("shape", [(32, 16, 32, 32), (3, 5, 100), (2, 3, 8, 8), (2, 4, 4, 4, 4), (3, 5, 7), (1, 1, 1, 1), (4, 3, 0, 2)])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_channel_sums_of_products_match_float64(shape, keepdims, dtype):
    a, b = _pair(shape, dtype)
    axes = [0, *range(2, len(shape))]
    (got,) = product_sum(axes, keepdims, 17)(a, b)
    want = (a.astype(np.float64) * b).sum(tuple(axes), keepdims=bool(keepdims))
    assert got.dtype == dtype and got.shape == want.shape
    # float32 sums of up to 32768 products of magnitude ~3: a few float32 ulps of the total's scale
    scale = np.abs(a.astype(np.float64) * b).sum(tuple(axes)).max(initial=1.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * np.finfo(dtype).eps * scale)


@pytest.mark.parametrize("shape_a,shape_b,axes,keepdims", [
    ((8, 16, 4, 4), (1, 16, 1, 1), [0, 2, 3], 1),  # a broadcast operand
    ((8, 16, 4, 4), (8, 16, 4, 4), [0, 2, 3], 1),  # planes under ROW_DOT_MIN elements
    ((8, 16, 4, 4), (8, 16, 4, 4), [0, 1], 1),  # LayerNorm's form: not the channel sums
    ((8, 16, 4, 4), (8, 16, 4, 4), [1], 0),
    ((6, 10), (6, 10), [0], 1),  # rank 2
])
def test_other_forms_are_the_two_kernels_bit_for_bit(shape_a, shape_b, axes, keepdims):
    a, _ = _pair(shape_a, seed=1)
    b, _ = _pair(shape_b, seed=2)
    (got,) = product_sum(axes, keepdims, 17)(a, b)
    want = reducer("ReduceSum", 17, axes, keepdims)(kernel_of("Mul", 17)(a, b)[0])
    np.testing.assert_array_equal(got, want)
    assert got.dtype == want.dtype


def _nodes(product_read_twice: bool, axes: str = "axes"):
    nodes = [helper.make_node("Mul", ["dy", "x"], ["p"], name="mul"),
             helper.make_node("ReduceSum", ["p", axes], ["s"], name="sum", keepdims=1)]
    if product_read_twice:
        nodes.append(helper.make_node("Neg", ["p"], ["q"]))
    return nodes


def test_the_pass_fuses_a_product_only_the_sum_reads():
    constants = {"axes": np.array([0, 2, 3], np.int64), "last": np.array([-1], np.int64), "rows": np.array([0, 1], np.int64)}
    fused = fuse(_nodes(False), constants, keep={"s"}, only=["product_sum"])
    assert [(n.op_type, list(n.input), list(n.output)) for n in fused] == [("ProductSum", ["dy", "x"], ["s"])]
    kept = fuse(_nodes(True), constants, keep={"s", "q"}, only=["product_sum"])
    assert [n.op_type for n in kept] == ["Mul", "ReduceSum", "Neg"]
    assert [n.op_type for n in fuse(_nodes(False), constants, keep={"s", "p"}, only=["product_sum"])] == ["Mul", "ReduceSum"]
    # Softmax's and LayerNorm's gradients sum along other axes: left as they are
    for axes in ("last", "rows"):
        assert [n.op_type for n in fuse(_nodes(False, axes), constants, keep={"s"}, only=["product_sum"])] == ["Mul", "ReduceSum"]
