"""Loading and normalizing: sources, opsets, folding, batch dim, external data, bad input."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import odt_ops
from odt_ops.errors import InputError, KernelError, ModelCheckError, ModelLoadError, UnsupportedOpError

RNG = np.random.default_rng(0)


def mlp(opset: int, batch: int = 2) -> onnx.ModelProto:
    """x[batch,4] -> MatMul -> Add -> Relu -> MatMul -> Add -> Softmax, at ``opset`` (fixed weights)."""
    RNG = np.random.default_rng(42)
    w1 = numpy_helper.from_array(RNG.standard_normal((4, 8)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(RNG.standard_normal(8).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(RNG.standard_normal((8, 3)).astype(np.float32), "w2")
    b2 = numpy_helper.from_array(RNG.standard_normal(3).astype(np.float32), "b2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["h4"]),
        helper.make_node("Softmax", ["h4"], ["y"], axis=1),
    ]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 3])], [w1, b1, w2, b2],
    )
    ir = 3 if opset < 9 else onnx.helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    if ir < 4:  # IR 3 lists every initializer among the graph inputs
        graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in graph.initializer)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)


@pytest.mark.parametrize("opset", [7, 9, 11, 13, 17, 21, 24, onnx.defs.onnx_opset_version()])
def test_every_opset_loads_and_matches_reference(opset):
    proto = mlp(opset)
    model = odt_ops.load_model(proto)
    onnx.checker.check_model(model.proto, full_check=True)
    x = RNG.standard_normal((5, 4)).astype(np.float32)  # batch 5: the batch dim is symbolic now
    (got,) = odt_ops.InferenceSession(model).run(None, {"x": x})
    (want,) = ReferenceEvaluator(mlp(opset, batch=5)).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_normalized_model_runs_on_onnxruntime():
    model = odt_ops.load_model(mlp(9))
    assert model.opset == odt_ops.TARGET_OPSET
    assert model.proto.ir_version <= 10
    sess = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], odt_ops.InferenceSession(model).run(None, {"x": x})[0], rtol=1e-5)


def test_sources_path_bytes_and_proto_agree(tmp_path):
    proto = mlp(13)
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    outs = [odt_ops.InferenceSession(src).run(None, {"x": x})[0] for src in (proto, str(path), path, proto.SerializeToString())]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_constant_subgraphs_become_initializers():
    # a weight made by ConstantOfShape from a Shape of a constant, scaled by a Constant
    nodes = [
        helper.make_node("Constant", [], ["shape"], value=numpy_helper.from_array(np.array([4, 3], np.int64))),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"], value=numpy_helper.from_array(np.array([0.5], np.float32))),
        helper.make_node("Shape", ["ones"], ["s"]),
        helper.make_node("Cast", ["s"], ["sf"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["sf"], ["total"], keepdims=0),
        helper.make_node("Mul", ["ones", "total"], ["w"]),
        helper.make_node("MatMul", ["x", "w"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = odt_ops.load_model(proto)
    assert [n.op_type for n in model.graph.node] == ["MatMul"]
    (w,) = [numpy_helper.to_array(t) for t in model.graph.initializer]
    np.testing.assert_array_equal(w, np.full((4, 3), 3.5, np.float32))


def test_symbolic_batch_and_unique_names():
    proto = mlp(17, batch=1)
    for node in proto.graph.node:
        node.name = "same"
    model = odt_ops.load_model(proto)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    names = [n.name for n in model.graph.node]
    assert len(set(names)) == len(names)
    y = odt_ops.InferenceSession(model).run(None, {"x": np.ones((7, 4), np.float32)})[0]
    assert y.shape == (7, 3)


def test_external_data_is_memory_mapped(tmp_path):
    proto = mlp(17)
    onnx.save(proto, tmp_path / "big.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="big.data", size_threshold=0)
    model = odt_ops.load_model(tmp_path / "big.onnx")
    # tensors this small are copied into the model when it is read (odt_ops.ir.load._vetted); the
    # mapping of large ones is tested in test_external_data.py
    assert set(model.initializer_arrays()) == {"w1", "b1", "w2", "b2"}
    x = RNG.standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(odt_ops.InferenceSession(model).run(None, {"x": x})[0],
                               ReferenceEvaluator(mlp(17)).run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_missing_external_data_names_the_file(tmp_path):
    proto = mlp(17)
    onnx.save(proto, tmp_path / "big.onnx", save_as_external_data=True, location="big.data", size_threshold=0)
    (tmp_path / "big.data").unlink()
    with pytest.raises(ModelLoadError, match="big.data"):
        odt_ops.load_model(tmp_path / "big.onnx").initializer_arrays()


def test_truncated_and_garbage_files_name_the_file(tmp_path):
    data = mlp(17).SerializeToString()
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated.onnx"):
        odt_ops.load_model(bad)
    with pytest.raises(ModelLoadError, match="no such model file"):
        odt_ops.load_model(tmp_path / "absent.onnx")
    (tmp_path / "folder.onnx").mkdir()
    with pytest.raises(ModelLoadError, match="folder.onnx: a folder, not a model file"):
        odt_ops.load_model(tmp_path / "folder.onnx")
    with pytest.raises(ModelLoadError):
        odt_ops.load_model(b"\x00not onnx at all\xff" * 10)


def test_model_failing_the_checker_is_rejected():
    proto = mlp(17)
    proto.graph.node[0].input[1] = "nonexistent"
    with pytest.raises(ModelCheckError, match="nonexistent"):
        odt_ops.load_model(proto)


def test_unsupported_ops_are_listed_all_at_once():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("MyOp", ["a"], ["b"], domain="my.domain", name="custom1"),
        helper.make_node("MyOp", ["b"], ["c"], domain="my.domain", name="custom2"),
        helper.make_node("Other", ["c"], ["y"], domain="my.domain", name="other1"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.domain", 1)])
    with pytest.raises(UnsupportedOpError) as info:
        odt_ops.load_model(proto)
    assert set(info.value.missing) == {("my.domain", "MyOp", 1), ("my.domain", "Other", 1)}
    assert "custom1" in str(info.value)
    assert "custom2" in str(info.value)
    assert "other1" in str(info.value)


def test_run_time_feeds_are_checked():
    sess = odt_ops.InferenceSession(mlp(17))
    with pytest.raises(InputError, match="missing input"):
        sess.run(None, {})
    with pytest.raises(InputError, match="unknown input"):
        sess.run(None, {"x": np.ones((1, 4), np.float32), "z": 1})
    with pytest.raises(InputError, match="dtype float32"):
        sess.run(None, {"x": np.ones((1, 4), np.float64)})
    with pytest.raises(InputError, match=r"expected shape \[batch, 4\]"):
        sess.run(None, {"x": np.ones((1, 5), np.float32)})


def test_kernel_failure_names_the_node():
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"], name="the_reshape")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"]),
                                           helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])])
    sess = odt_ops.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(KernelError, match="the_reshape"):
        sess.run(None, {"x": np.ones(5, np.float32), "shape": np.array([2, 2], np.int64)})


def test_folding_keeps_the_users_weights():
    # an export made without constant folding: the weight reaches MatMul through a Transpose
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "w")
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3])], [w])
    model = odt_ops.load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    assert [t.name for t in model.graph.initializer] == ["w"]
    assert [n.op_type for n in model.graph.node] == ["Transpose", "MatMul"]


def test_ir3_models_whose_initializers_are_graph_inputs_load_and_train(tmp_path):
    """The older model zoo's layout: IR 3, every initializer also declared as a graph input,
    weights large enough to be set aside during the C++ passes. It passes onnx.checker and runs
    on onnxruntime, so it must load, and train from the same values onnxruntime computes with."""
    from odt_ops import artifacts
    from odt_ops.api import CheckpointState, Module

    rng = np.random.default_rng(3)
    weights = {"W": rng.standard_normal((200, 100)).astype(np.float32), "b": rng.standard_normal(100).astype(np.float32)}
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "zoo",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 200]),
         *(helper.make_tensor_value_info(n, TensorProto.FLOAT, list(a.shape)) for n, a in weights.items())],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 100])],
        [numpy_helper.from_array(a, n) for n, a in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8)])
    model.ir_version = 3
    onnx.checker.check_model(model)
    x = rng.standard_normal((2, 200)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    normalized = odt_ops.load_model(model)
    assert [i.name for i in normalized.graph.input] == ["x"]
    artifacts.generate_artifacts(model, requires_grad=["W", "b"], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=tmp_path, additional_output_names=["y"], opset=21)
    module = Module(tmp_path / "training_model.onnx", CheckpointState.load_checkpoint(tmp_path / "checkpoint"),
                    tmp_path / "eval_model.onnx").eval()
    _, y = module(x, np.zeros_like(expected))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("constant_folding", [True, False])
def test_a_batch_traced_into_a_reshape_follows_the_batch_it_is_run_with(tmp_path, constant_folding):
    """x.view(x.size(0), -1) exported without dynamic axes traces to Reshape(x, [2, -1]); once
    the batch is symbolic the Reshape must copy the batch, so training at another batch size
    computes what PyTorch computes (it used to fold the batch into the features)."""
    torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle here")
    import io
    import warnings

    from odt_ops import artifacts
    from odt_ops.api import CheckpointState, Module

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.fc = torch.nn.Conv2d(1, 3, 3), torch.nn.Linear(3 * 6 * 6, 4)

        def forward(self, x):
            return self.fc(torch.relu(self.conv(x)).view(x.size(0), -1))

    torch.manual_seed(0)
    net = Net()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, 1, 8, 8),), buffer, input_names=["x"], output_names=["y"],
                          do_constant_folding=constant_folding, dynamo=False)
    artifacts.generate_artifacts(onnx.load_from_string(buffer.getvalue()), requires_grad=["conv.weight", "fc.weight"],
                                 loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    x, y = torch.randn(5, 1, 8, 8), torch.randint(0, 4, (5,))
    loss = Module(tmp_path / "training_model.onnx", state)(x.numpy(), y.numpy())
    want = torch.nn.functional.cross_entropy(net(x), y)
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    np.testing.assert_allclose(state.parameters["fc.weight"].grad, net.fc.weight.grad.numpy(), rtol=1e-4, atol=1e-6)
