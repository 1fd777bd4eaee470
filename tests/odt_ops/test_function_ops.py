"""Ops that ONNX defines as functions (Swish, MeanVarianceNormalization, RMSNormalization,
Attention, ...) run and train through their spec bodies: the forward equals onnx.reference on
the original node, and a weight in front of them trains as PyTorch says it should."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import odt_ops
from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle for the gradients")
F = torch.nn.functional

RNG = np.random.default_rng(0)
D = 8


def _model(op_nodes, extra_inputs, opset, weights):
    """x[2, 5, D] -> MatMul(W) -> the op -> y, with the op's other inputs as graph inputs."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), *op_nodes]
    inputs = [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 5, D]),
              *(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, list(a.shape)) for n, a in extra_inputs.items())]
    graph = helper.make_graph(nodes, "fn", inputs, [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(a, n) for n, a in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(model)


def _typed_output(model):
    inferred = {v.name: v for v in model.graph.value_info}
    if "y" in inferred:
        model.graph.output[0].CopyFrom(inferred["y"])
    return model


CASES = {
    "Swish": (24, lambda: [helper.make_node("Swish", ["h"], ["y"], alpha=1.5)], {},
              lambda h, t: h * torch.sigmoid(1.5 * h)),
    "MeanVarianceNormalization": (21, lambda: [helper.make_node("MeanVarianceNormalization", ["h"], ["y"], axes=[0, 1])], {},
                                  lambda h, t: (h - h.mean(dim=(0, 1), keepdim=True))
                                  / torch.sqrt(h.var(dim=(0, 1), unbiased=False, keepdim=True) + 1e-9)),
    "RMSNormalization": (23, lambda: [helper.make_node("RMSNormalization", ["h", "scale"], ["y"], axis=-1, epsilon=1e-5)],
                         {"scale": RNG.standard_normal(D).astype(np.float32)},
                         lambda h, t: F.rms_norm(h, (D,), weight=t["scale"], eps=1e-5)),
    "Attention": (23, lambda: [helper.make_node("Attention", ["h", "h", "h"], ["y"], is_causal=1, q_num_heads=2, kv_num_heads=2)],
                  {}, lambda h, t: _heads_back(F.scaled_dot_product_attention(_heads(h), _heads(h), _heads(h), is_causal=True))),
}


def _heads(h):  # [2, 5, D] -> [2, 2, 5, D/2], as Attention's 3-D inputs with num_heads split
    return h.reshape(2, 5, 2, D // 2).transpose(1, 2)


def _heads_back(y):
    return y.transpose(1, 2).reshape(2, 5, D)


@pytest.mark.parametrize("op", sorted(CASES))
def test_function_op_runs_as_the_spec_and_trains_as_pytorch(tmp_path, op):
    opset, make_nodes, extra, torch_fn = CASES[op]
    w = (RNG.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32)
    x = RNG.standard_normal((2, 5, D)).astype(np.float32)
    model = _typed_output(_model(make_nodes(), {}, opset, {"W": w, **extra}))

    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    normalized = odt_ops.load_model(model)
    assert op not in {n.op_type for n in normalized.graph.node}  # ran as its body
    np.testing.assert_allclose(odt_ops.InferenceSession(normalized).run(None, {"x": x})[0], want, rtol=1e-4, atol=1e-5)

    artifacts.generate_artifacts(model, requires_grad=["W", *extra], loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path,
                                 opset=max(opset, 21))
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    target = RNG.standard_normal(want.shape).astype(np.float32)
    loss = Module(tmp_path / "training_model.onnx", state)(x, target)

    t = {n: torch.tensor(a, requires_grad=True) for n, a in {"W": w, **extra}.items()}
    expected = F.mse_loss(torch_fn(torch.tensor(x) @ t["W"], t), torch.tensor(target))
    expected.backward()
    np.testing.assert_allclose(loss, expected.item(), rtol=1e-4)
    for name, p in t.items():
        np.testing.assert_allclose(state.parameters[name].grad, p.grad.numpy(), rtol=1e-3, atol=1e-5, err_msg=name)
