"""Gradients where the shapes come from arithmetic the exporter wrote, against PyTorch autograd."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, checker, helper, numpy_helper

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle here")


def _train_step(tmp_path, model, requires_grad, loss, *feeds):
    artifacts.generate_artifacts(model, requires_grad=requires_grad, loss=loss, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    value = module(*feeds)
    return float(value), {n: np.array(state.parameters[n].grad) for n in requires_grad}


def test_group_normalization_21_after_an_add_trains_like_torch(tmp_path):
    """x[2,4,3] -> Add -> GroupNormalization(num_groups=2) at opset 21 -> MSE: onnx infers the
    normalization's output through its function body and loses its rank; the output is shaped
    as the input."""
    rng = np.random.default_rng(0)
    b, scale, bias = (rng.standard_normal(s).astype(np.float32) for s in ((2, 4, 3), (4,), (4,)))
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "b"], ["t1"]),
         helper.make_node("GroupNormalization", ["t1", "scale", "bias"], ["y"], num_groups=2, epsilon=1e-5)],
        "group_norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 3])],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scale, "scale"), numpy_helper.from_array(bias, "bias")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    checker.check_model(model, full_check=True)
    x, target = rng.standard_normal((2, 4, 3)).astype(np.float32), rng.standard_normal((2, 4, 3)).astype(np.float32)
    loss, grads = _train_step(tmp_path, model, ["b", "scale", "bias"], artifacts.LossType.MSELoss, x, target)

    tb, tscale, tbias = (torch.tensor(a, requires_grad=True) for a in (b, scale, bias))
    y = torch.nn.functional.group_norm(torch.tensor(x) + tb, 2, tscale, tbias, eps=1e-5)
    want = torch.nn.functional.mse_loss(y, torch.tensor(target))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    for name, t in (("b", tb), ("scale", tscale), ("bias", tbias)):
        expected = t.grad.numpy()
        assert np.max(np.abs(grads[name] - expected)) <= 1e-5 * np.max(np.abs(expected)) + 1e-7, name
