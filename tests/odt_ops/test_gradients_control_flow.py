"""The Loop gradient rule against float64 finite differences (tests/odt_ops/gradcheck.py): a trip
count fed at run time, a carried state that changes each iteration, a weight carried through
unchanged (as loading carries the float values a body reads), and a scan output."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.odt_ops.gradcheck import check_gradients, make_model

F = TensorProto.DOUBLE  # gradcheck runs in float64


def _loop() -> list:
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Identity", ["w"], ["w_out"]),
         helper.make_node("MatMul", ["h", "w"], ["h1"]), helper.make_node("Tanh", ["h1"], ["h_out"]),
         helper.make_node("Mul", ["h_out", "h_out"], ["scan"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("h", F, [2, 3]), helper.make_tensor_value_info("w", F, [3, 3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []), helper.make_tensor_value_info("h_out", F, [2, 3]),
         helper.make_tensor_value_info("w_out", F, [3, 3]), helper.make_tensor_value_info("scan", F, [2, 3])])
    return [helper.make_node("Loop", ["M", "", "x", "W"], ["h", "W_last", "scans"], body=body)]


@pytest.mark.parametrize("trips", [0, 1, 3])
def test_loop_with_a_run_time_trip_count(trips):
    rng = np.random.default_rng(trips)
    feeds = {"M": np.array(trips, np.int64), "x": rng.standard_normal((2, 3)), "W": rng.standard_normal((3, 3)) * 0.6}
    model = make_model(_loop(), feeds, outputs=["h", "scans"])
    # onnx's Loop inference leaves them unranked; the projection loss needs their ranks
    model.graph.value_info.extend([helper.make_tensor_value_info("h", F, [2, 3]), helper.make_tensor_value_info("scans", F, [trips, 2, 3])])
    errors = check_gradients(model, feeds, ["x", "W"])
    assert max(errors.values()) < 1e-6, errors
