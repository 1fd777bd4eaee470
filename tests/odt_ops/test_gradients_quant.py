"""DequantizeLinear's gradient with respect to its scale (what LSQ learns scales through),
against finite differences: per-tensor and per-axis scales, with and without zero points.
(Its integer input has no gradient; QuantizeLinear's output is integer: it has none.)"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tests.odt_ops.gradcheck import check_gradients, make_model


@pytest.mark.parametrize("per_axis,zero_point,axis", [(False, False, 1), (False, True, 1), (True, True, 1), (True, False, 0), (True, True, -1)])
def test_dequantize_linear_scale_gradient(per_axis, zero_point, axis):
    rng = np.random.default_rng(int(per_axis) * 4 + int(zero_point) * 2 + axis % 3)
    x = rng.integers(-128, 128, (3, 4, 5)).astype(np.int8)
    channels = x.shape[axis]
    scale = rng.uniform(0.01, 0.1, (channels,) if per_axis else ()).astype(np.float32)
    inputs = ["Xq", "S"] + (["Z"] if zero_point else [])
    initializers = {"Xq": x}
    if zero_point:
        initializers["Z"] = rng.integers(-5, 5, scale.shape).astype(np.int8)
    model = make_model([helper.make_node("DequantizeLinear", inputs, ["Y"], axis=axis, name="DequantizeLinear_Y")], {"S": scale},
                       initializers=initializers)
    # Y is linear in the scale: float32 central differences with a large step are exact up to rounding
    check_gradients(model, {"S": scale}, ["S"], eps=1e-2, rtol=1e-3, atol=1e-4)
