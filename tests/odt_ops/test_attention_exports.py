"""Attention as the exporters write it (the TorchScript exporter's shape arithmetic uses Mod):
nn.MultiheadAttention and nn.TransformerEncoderLayer classifiers train, and the loss and every
parameter gradient equal PyTorch autograd's."""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle here")


class AttentionClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.attention(x, x, x)[0].mean(1))


class EncoderClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


def _net(cls):
    torch.manual_seed(0)
    net = cls()
    with torch.no_grad():  # distinct LayerNorm weights: an exporter may merge equal initializers into one
        for name, p in net.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return net


def _export(net, x, exporter):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            return torch.onnx.export(net, (x,), dynamo=True, input_names=["x"], output_names=["logits"], verbose=False).model_proto
        buffer = io.BytesIO()
        torch.onnx.export(net, (x,), buffer, opset_version=exporter, input_names=["x"], output_names=["logits"],
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False)
        return onnx.load_from_string(buffer.getvalue())


@pytest.mark.parametrize(("cls", "exporter"), [(AttentionClassifier, 13), (AttentionClassifier, 17), (AttentionClassifier, "dynamo"),
                                               (EncoderClassifier, 17), (EncoderClassifier, 20), (EncoderClassifier, "dynamo")])
def test_attention_trains_as_pytorch(tmp_path, cls, exporter):
    net = _net(cls)
    x, y = torch.randn(2, 5, 16), torch.randint(0, 3, (2,))
    model = _export(net, x, exporter)
    if exporter != "dynamo":
        assert "Mod" in {n.op_type for n in model.graph.node}  # the export this test is about
    initializers = {t.name for t in model.graph.initializer}
    # the dynamo exporter may store a weight under a new name (transposed, split); what keeps its name is compared
    trainable = [n for n, _ in net.named_parameters() if n in initializers]
    assert len(trainable) >= len(list(net.parameters())) // 2
    artifacts.generate_artifacts(model, requires_grad=trainable, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    loss = Module(tmp_path / "training_model.onnx", state)(x.numpy(), y.numpy())

    want = torch.nn.functional.cross_entropy(net(x), y)
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    for name, p in net.named_parameters():
        if name in trainable:
            np.testing.assert_allclose(state.parameters[name].grad, p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
