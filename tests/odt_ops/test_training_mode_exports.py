"""Models exported from PyTorch in training mode, as ONNX Runtime's documentation told users to
export them: the eval model and the inference export behave as PyTorch's eval mode (running
statistics, no Dropout), the training model as PyTorch's train mode. PyTorch is the oracle."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle here")

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module


class ConvBnDropout(torch.nn.Module):
    def __init__(self, dropout: float):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.drop = torch.nn.Dropout(dropout)
        self.fc = torch.nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(self.drop(torch.relu(self.bn(self.conv(x))).flatten(1)))


def _net(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    net = ConvBnDropout(dropout)
    with torch.no_grad():  # running statistics unlike any batch's, so the two modes differ clearly
        net.bn.running_mean.uniform_(-1, 1)
        net.bn.running_var.uniform_(0.5, 2.0)
    return net


def _export_training_mode(net, x, path, opset: int) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), str(path), training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          input_names=["input"], output_names=["output"], opset_version=opset, dynamo=False)
    return onnx.load(str(path))


def _artifacts(net, x, d, opset: int) -> CheckpointState:
    model = _export_training_mode(net, x, d / "exported.onnx", opset)
    ops = {n.op_type for n in model.graph.node}
    assert {"BatchNormalization", "Dropout"} <= ops, ops  # the export is the one the issue is about
    artifacts.generate_artifacts(model, requires_grad=["conv.weight", "conv.bias", "fc.weight", "fc.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=d, additional_output_names=["output"])
    return CheckpointState.load_checkpoint(d / "checkpoint")


@pytest.mark.parametrize("opset", [13, 17, 20])
def test_eval_model_and_inference_export_match_pytorch_eval(tmp_path, opset):
    net = _net(dropout=0.5)
    x = torch.randn(5, 1, 8, 8)
    state = _artifacts(net, x, tmp_path, opset)
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    expected = net.eval()(x).detach().numpy()

    module.eval()
    _, logits = module(x.numpy(), np.zeros(5, np.int64))
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    _, again = module(x.numpy(), np.zeros(5, np.int64))
    np.testing.assert_array_equal(again, logits)  # no Dropout draw in eval

    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["output"])
    session = ort.InferenceSession(str(tmp_path / "inference.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["output"], {"input": x.numpy()})[0], expected, rtol=1e-5, atol=1e-5)
    exported = onnx.load(str(tmp_path / "inference.onnx"))
    for node in exported.graph.node:
        if node.op_type == "BatchNormalization":
            assert len(node.output) == 1
            assert not any(a.name == "training_mode" and a.i for a in node.attribute)
        if node.op_type == "Dropout":
            assert len(node.input) < 3 or not node.input[2]


def test_training_model_keeps_batch_statistics_and_updates_running_ones(tmp_path):
    net = _net(dropout=0.0)
    x = torch.randn(5, 1, 8, 8)
    state = _artifacts(net, x, tmp_path, 17)
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")

    old_var = net.bn.running_var.clone()
    net.train()
    expected = net(x).detach().numpy()  # also moves PyTorch's running statistics one step
    module.train()
    _, logits = module(x.numpy(), np.zeros(5, np.int64))
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.checkpoint.buffers["bn.running_mean"], net.bn.running_mean.numpy(), rtol=1e-5, atol=1e-6)
    # ONNX's BatchNormalization moves the running variance with the batch's population variance;
    # PyTorch with the unbiased one (a factor n/(n-1) apart), so the oracle is the spec's formula
    batch_var = net.conv(x).detach().var(dim=(0, 2, 3), unbiased=False)
    spec_var = (0.9 * old_var + 0.1 * batch_var).numpy()
    np.testing.assert_allclose(state.checkpoint.buffers["bn.running_var"], spec_var, rtol=1e-5, atol=1e-6)


def test_export_puts_an_eval_model_written_in_training_mode_into_inference_mode(tmp_path):
    """Eval models generated before this fix keep training mode; exporting them must still be right."""
    net = _net(dropout=0.5)
    x = torch.randn(5, 1, 8, 8)
    state = _artifacts(net, x, tmp_path, 17)
    eval_model = onnx.load(str(tmp_path / "eval_model.onnx"))
    from odt_ops.ir.modes import set_training_mode

    set_training_mode(eval_model.graph)  # what an eval model of the earlier releases looked like
    onnx.save(eval_model, str(tmp_path / "old_eval_model.onnx"))
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "old_eval_model.onnx")
    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["output"])
    session = ort.InferenceSession(str(tmp_path / "inference.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["output"], {"input": x.numpy()})[0], net.eval()(x).detach().numpy(), rtol=1e-5, atol=1e-5)
