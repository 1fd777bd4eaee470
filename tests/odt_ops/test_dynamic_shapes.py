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


class PatchFold(torch.nn.Module if torch else object):
    """MobileViT's unfold/fold: spatial sizes computed from x.shape (rounded up to whole patches),
    an interpolate to them, tokens folded back into an image for a conv. The TorchScript exporter
    writes the arithmetic as Shape/Gather/Add/Div/Mul/Concat on the traced sizes."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.mix = torch.nn.Linear(4, 4)
        self.project = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        h = self.stem(x)
        batch, channels, height, width = h.shape
        new_height, new_width = (height + 1) // 2 * 2, (width + 1) // 2 * 2
        h = torch.nn.functional.interpolate(h, size=(new_height, new_width), mode="bilinear", align_corners=False)
        tokens = self.mix(h.reshape(batch, channels, new_height * new_width).transpose(1, 2))
        image = tokens.transpose(1, 2).reshape(batch, channels, new_height, new_width)
        return self.head(torch.relu(self.project(image)).mean(dim=(2, 3)))


def test_conv_and_resize_after_spatial_sizes_computed_from_shapes_train_like_torch(tmp_path):
    """Exported with a dynamic batch, trained at another batch: the Conv's spatial dims and the
    Resize's sizes are computed from the input's static sizes, so they fold to numbers while the
    batch stays symbolic (before, the gradient builder refused: "the spatial dims of ... must be
    static", "scales and sizes must be constants")."""
    import io
    import warnings

    import onnx

    torch.manual_seed(0)
    net = PatchFold().train()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(2, 3, 5, 5),), buffer, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["y"], training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    proto = onnx.load_from_string(buffer.getvalue())
    assert {"Resize", "Concat", "Shape", "Gather", "Div"} <= {n.op_type for n in proto.graph.node}
    x = np.random.default_rng(1).standard_normal((3, 3, 5, 5)).astype(np.float32)
    labels = np.array([0, 2, 1])
    names = [n for n, _ in net.named_parameters()]
    loss, grads = _train_step(tmp_path, proto, names, artifacts.LossType.CrossEntropyLoss, x, labels)
    want = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(labels))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    for name, p in net.named_parameters():
        expected = p.grad.numpy()
        assert np.max(np.abs(grads[name] - expected)) <= 1e-4 * np.max(np.abs(expected)) + 1e-7, name


class TimeMajor(torch.nn.Module if torch else object):
    """An embedding and an LSTM with batch_first=False: the batch is axis 1 of the token ids."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 4)
        self.rnn = torch.nn.LSTM(4, 5)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, tokens):  # tokens [T, B]
        out, _ = self.rnn(self.embed(tokens))
        return self.head(out[-1])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static-export", "dynamic-axis-1"])
def test_a_time_major_recurrent_export_trains_like_torch_at_any_batch(tmp_path, dynamic):
    """Exported at batch 2 (with no dynamic axis, or the batch marked at axis 1), trained at batch 3:
    the symbolic batch goes on axis 1 of a time-major input, not on its time axis."""
    import io
    import warnings

    import onnx

    from tests.odt_ops.test_architectures import grad, layouts, match_parameters

    torch.manual_seed(0)
    net = TimeMajor().train()
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randint(0, 20, (6, 2)),), buffer, dynamo=False, opset_version=17, input_names=["tokens"],
                          output_names=["y"], training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          **({"dynamic_axes": {"tokens": {1: "batch"}, "y": {0: "batch"}}} if dynamic else {}))
    proto = onnx.load_from_string(buffer.getvalue())
    matched = match_parameters(proto, net)
    forms = layouts(net)
    assert {p for key in matched.values() for p in forms[key][0]} == {n for n, _ in net.named_parameters()}
    rng = np.random.default_rng(2)
    tokens, labels = rng.integers(0, 20, (6, 3)).astype(np.int64), np.array([2, 0, 1])
    loss, grads = _train_step(tmp_path, proto, sorted(matched), artifacts.LossType.CrossEntropyLoss, tokens, labels)
    want = torch.nn.functional.cross_entropy(net(torch.from_numpy(tokens)), torch.from_numpy(labels))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    for name, key in matched.items():
        expected = np.reshape(forms[key][1](grad), grads[name].shape)
        assert np.max(np.abs(grads[name] - expected)) <= 1e-4 * np.max(np.abs(expected)) + 1e-7, name
