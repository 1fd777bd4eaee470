"""ChannelAffine (runtime/fusion/channel_affine.py): Add(Mul(x, gamma), beta) and a following Relu
held bit for bit to the Mul, Add and Relu kernels run one after another, on per-channel operands
(the fast path) and on any other broadcast (the kernels themselves); and which graphs the pass matches."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from odt_ops.runtime.fusion import fuse
from odt_ops.runtime.fusion.channel_affine import channel_affine
from odt_ops.runtime.fusion.graph import kernel_of


def _unfused(a, b, c, bias_first, relu):
    product = kernel_of("Mul", 17)(a, b)[0]
    y = kernel_of("Add", 17)(*((c, product) if bias_first else (product, c)))[0]
    return kernel_of("Relu", 17)(y)[0] if relu else y


@pytest.mark.parametrize("x_shape,v_shape", [
    ((32, 16, 32, 32), (16, 1, 1)),  # UNet's GroupNorm affine
    ((8, 6, 5, 7), (1, 6, 1, 1)),
    ((4, 3, 10), (3, 1)),
    ((1, 4, 3, 3), (4, 1, 1)),  # one image: numpy's broadcast inside per_channel
    ((4, 3, 5, 5), (1, 1, 5)),  # not per channel: the kernels
    ((4, 3), (3,)),  # rank 2: the kernels
])
@pytest.mark.parametrize("bias_first", [0, 1])
@pytest.mark.parametrize("relu", [0, 1])
@pytest.mark.parametrize("swap", [False, True])
def test_equals_the_kernels_bit_for_bit(x_shape, v_shape, bias_first, relu, swap):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32)
    gamma, beta = (rng.standard_normal(v_shape).astype(np.float32) for _ in range(2))
    x.flat[:3] = [np.nan, -np.inf, -0.0]
    a, b = (gamma, x) if swap else (x, gamma)
    (got,) = channel_affine(bias_first, relu, 17)(a, b, beta)
    want = _unfused(a, b, beta, bias_first, relu)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want))


def _graph(relu: bool, product_read_twice: bool = False, bias_first: bool = False, gated: bool = False):
    nodes = [helper.make_node("Sigmoid", ["z"], ["gate"]), helper.make_node("Tanh", ["w"], ["state"])] if gated else []
    nodes += [helper.make_node("Mul", ["state", "gate"] if gated else ["x", "gamma"], ["p"], name="mul"),
             helper.make_node("Add", ["beta", "p"] if bias_first else ["p", "beta"], ["s"], name="add")]
    if relu:
        nodes.append(helper.make_node("Relu", ["s"], ["r"], name="relu"))
    if product_read_twice:
        nodes.append(helper.make_node("Neg", ["p"], ["q"]))
    return nodes


def test_the_pass_takes_the_product_the_sum_and_a_relu_only_when_nothing_else_reads_them():
    def fused(nodes, keep):
        return [(n.op_type, list(n.input), list(n.output)) for n in fuse(nodes, {}, keep=keep, only=["channel_affine"])]

    assert fused(_graph(relu=True), {"r"}) == [("ChannelAffine", ["x", "gamma", "beta"], ["r"])]
    assert fused(_graph(relu=False, bias_first=True), {"s"}) == [("ChannelAffine", ["x", "gamma", "beta"], ["s"])]
    # the sum is needed: the Relu stays apart
    assert [op for op, *_ in fused(_graph(relu=True), {"r", "s"})] == ["ChannelAffine", "Relu"]
    # a factor computed from the data (an LSTM step's gate times its state): left to the recurrent passes
    assert [op for op, *_ in fused(_graph(relu=False, gated=True), {"s"})] == ["Sigmoid", "Tanh", "Mul", "Add"]
    # the product is needed: nothing fuses
    assert [op for op, *_ in fused(_graph(relu=True, product_read_twice=True), {"r", "q"})] == ["Mul", "Add", "Relu", "Neg"]
