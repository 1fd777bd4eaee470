"""Artifacts at the base model's opset, as ONNX Runtime writes them: each artifact graph, run
by onnxruntime at that opset, computes what our Module and Optimizer compute."""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from odt_ops import artifacts, meta
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.errors import ArtifactError

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) exports the models here")


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.fc = torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def _export(opset: int) -> onnx.ModelProto:
    torch.manual_seed(0)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(ConvNet(), (torch.randn(5, 1, 8, 8),), buffer, input_names=["x"], output_names=["logits"],
                          opset_version=opset, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


def _opset(path) -> int:
    return next(o.version for o in onnx.load(str(path)).opset_import if o.domain in ("", "ai.onnx"))


@pytest.mark.parametrize("opset", [14, 17])
def test_artifacts_keep_the_base_opset_and_onnxruntime_agrees_with_the_module(tmp_path, opset):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to our opset
        artifacts.generate_artifacts(_export(opset), requires_grad=["conv.weight", "conv.bias", "fc.weight", "fc.bias"],
                                     loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=tmp_path)
    for kind in ("training_model", "eval_model", "optimizer_model"):
        assert _opset(tmp_path / f"{kind}.onnx") == opset
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((5, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, 5)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    weights = {n: np.array(p.data) for n, p in state.parameters.items()} | {n: np.array(b) for n, b in state.checkpoint.buffers.items()}
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)

    _training_model_agrees_with_onnxruntime(tmp_path, module, state, weights, x, y)

    # the optimizer graph at that opset makes the update the Module's optimizer makes
    opt_model = onnx.load(str(tmp_path / "optimizer_model.onnx"))
    opt_meta = meta.read_optimizer(opt_model)
    feeds = {"learning_rate": np.array(1e-3, np.float32), "step": np.array(1, np.int64)}
    for entry in opt_meta["parameters"]:
        feeds[entry["value"]] = weights[entry["name"]]
        feeds[entry["grad"]] = np.array(state.parameters[entry["name"]].grad)
        for s in entry["states"].values():
            feeds[s] = np.zeros_like(weights[entry["name"]])
    updated = dict(zip([o.name for o in opt_model.graph.output],
                       ort.InferenceSession(opt_model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)))
    optimizer.step()
    for entry in opt_meta["parameters"]:
        np.testing.assert_allclose(state.parameters[entry["name"]].data, updated[entry["outputs"][0]], rtol=1e-5, atol=1e-7)


def _training_model_agrees_with_onnxruntime(directory, module, state, weights, x, y) -> None:
    """onnxruntime runs training_model.onnx to our Module's loss and gradients."""
    training = onnx.load(str(directory / "training_model.onnx"))
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    first, label = training.graph.input[0].name, training.graph.input[1].name
    outputs = session.run(None, {first: x, label: y, **{i.name: weights[i.name] for i in training.graph.input[2:]}})
    np.testing.assert_allclose(module(x, y), outputs[0], rtol=1e-5)
    by_name = dict(zip([o.name for o in training.graph.output], outputs))
    for param, grad in meta.read(training).gradients.items():
        np.testing.assert_allclose(state.parameters[param].grad, by_name[grad], rtol=1e-4, atol=1e-6, err_msg=param)


class Recurrent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.fc = torch.nn.LSTM(3, 5, batch_first=True), torch.nn.Linear(5, 2)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


def test_an_lstm_export_keeps_opset_17_its_gradient_pads_rewritten_for_it(tmp_path):
    """The exporter slices the LSTM's weights per gate; their gradients pad only the sliced axis
    (Pad's axes input, opset 18), written out for every axis at 17."""
    torch.manual_seed(0)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Recurrent(), (torch.randn(2, 4, 3),), buffer, input_names=["x"], output_names=["logits"], opset_version=17,
                          dynamic_axes={"x": {0: "batch"}}, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          dynamo=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        artifacts.generate_artifacts(onnx.load_from_string(buffer.getvalue()), requires_grad=["rnn.weight_ih_l0", "rnn.bias_hh_l0", "fc.weight"],
                                     loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    assert _opset(tmp_path / "training_model.onnx") == 17
    assert any(n.op_type == "Pad" for n in onnx.load(str(tmp_path / "training_model.onnx")).graph.node)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    weights = {n: np.array(p.data) for n, p in state.parameters.items()}
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((3, 4, 3)).astype(np.float32), rng.integers(0, 2, 3)
    _training_model_agrees_with_onnxruntime(tmp_path, Module(tmp_path / "training_model.onnx", state), state, weights, x, y)


def test_an_opset_the_model_cannot_be_written_at_is_refused_by_node_when_asked_for(tmp_path):
    # BatchNormalization in training mode needs opset 14 (below it, training is told by the output count)
    with pytest.raises(ArtifactError, match="BatchNormalization.*training_mode"):
        artifacts.generate_artifacts(_export(13), requires_grad=["fc.weight"], loss=artifacts.LossType.CrossEntropyLoss,
                                     artifact_directory=tmp_path, opset=13)
    assert not any(tmp_path.iterdir())


def test_the_default_falls_back_to_our_opset_with_a_warning_that_says_why(tmp_path):
    with pytest.warns(UserWarning, match="(?s)opset 21, not at the base model.s opset 13.*BatchNormalization"):
        artifacts.generate_artifacts(_export(13), requires_grad=["fc.weight"], loss=artifacts.LossType.CrossEntropyLoss,
                                     artifact_directory=tmp_path)
    assert _opset(tmp_path / "training_model.onnx") == 21
    artifacts.generate_artifacts(_export(17), requires_grad=["fc.weight"], loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=tmp_path / "ours", opset=21)
    assert _opset(tmp_path / "ours" / "training_model.onnx") == 21
