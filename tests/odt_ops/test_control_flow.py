"""Control flow (If, Loop, Scan): loading keeps what subgraphs read, forward kernels against
onnxruntime and onnx.reference, lowering at load (constant Ifs inlined, static Loops and Scans
unrolled, data-dependent Ifs selected with Where), and training through them against torch."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from odt_ops.ir import passes
from odt_ops.ir.control_flow import implicit_inputs, outer_reads
from odt_ops.ir.model import Model

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _if_reading_initializer() -> onnx.ModelProto:
    """If whose branches read initializers that no top-level node reads."""
    then = helper.make_graph([helper.make_node("Add", ["x", "w"], ["t"])], "then", [], [helper.make_tensor_value_info("t", F, [2])])
    other = helper.make_graph([helper.make_node("Mul", ["x", "w2"], ["e"])], "else", [], [helper.make_tensor_value_info("e", F, [2])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("c", B, []), helper.make_tensor_value_info("x", F, [2])],
        [helper.make_tensor_value_info("y", F, [2])],
        [numpy_helper.from_array(np.array([1, 2], np.float32), "w"), numpy_helper.from_array(np.array([3, 4], np.float32), "w2"),
         numpy_helper.from_array(np.array([5, 6], np.float32), "unused")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_outer_reads_are_seen_by_use_analysis():
    model = Model(_if_reading_initializer())
    node = model.graph.node[0]
    assert sorted(implicit_inputs(node)) == ["w", "w2", "x"]
    assert outer_reads(next(a.g for a in node.attribute if a.name == "then_branch")) == ["x", "w"]
    passes.prune_unused(model)
    assert sorted(t.name for t in model.graph.initializer) == ["w", "w2"]
    passes.fold_constants(model)
    assert sorted(t.name for t in model.graph.initializer) == ["w", "w2"]
