"""The runtime's compiled plan: the generated run names a failing node with its inputs,
and a profiler can wrap every kernel."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from odt_ops.errors import KernelError
from odt_ops.runtime.plan import Plan


def _two_nodes() -> onnx.GraphProto:
    return helper.make_graph(
        [helper.make_node("Relu", ["a"], ["r"], name="first"), helper.make_node("MatMul", ["r", "b"], ["y"], name="second")],
        "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, None), helper.make_tensor_value_info("b", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])


def test_a_failing_kernel_is_named_with_its_inputs():
    plan = Plan(_two_nodes(), {"": 21}, {}, ["a", "b"], ["y"])
    with pytest.raises(KernelError, match=r"MatMul node 'second' failed on inputs \(float32\[2,3\], float32\[4,5\]\)"):
        plan.run([np.ones((2, 3), np.float32), np.ones((4, 5), np.float32)])


def test_instrument_wraps_every_kernel_and_undoes_it():
    plan = Plan(_two_nodes(), {"": 21}, {}, ["a", "b"], ["y"])
    calls = []

    def wrap(step, fn):
        return lambda *args: (calls.append(step.node.name), fn(*args))[1]

    feeds = [np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)]
    plan.instrument(wrap)
    (y,) = plan.run(feeds)
    assert calls == ["first", "second"] and y.shape == (2, 4)
    plan.instrument(None)
    plan.run(feeds)
    assert calls == ["first", "second"]
