"""The own test set: real architectures from Hugging Face transformers (tests/odt_ops/library_models.py),
built from configs with random weights, exported as ONNX Runtime's training documentation
says (the TorchScript exporter, opset 17, TrainingMode.TRAINING, no constant folding) with a
dynamic batch axis, and trained at another batch size than the export's.

Oracle: PyTorch. One step's loss (rtol 1e-5) and every parameter's gradient, compared per tensor
relative to that tensor's largest magnitude (max |ours - torch| <= 1e-3 * max |torch|), so a
small tensor's error is not hidden by a large one's scale; then AdamW steps (onnxblock's AdamW
in torch's arithmetic) against torch.optim.AdamW: every loss to rtol 1e-4 and every parameter
after the steps per tensor as above.

A tensor whose torch gradient is below 1e-6 of the model's largest is float32 noise in both
engines (a bias right before a normalization has an exact gradient of 0) and is compared
absolutely at that level. BatchNormalization's running variance is not compared: the ONNX
spec keeps the population variance where torch keeps the unbiased one (README, "The engine").
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle here")
pytest.importorskip("transformers", reason="transformers (the dev extra) builds the test set's models")

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.onnxblock import optim
from tests.odt_ops.library_models import MODELS, LibraryModel
from tests.odt_ops.test_architectures import grad, matched_parameters, value

EXPORT_BATCH, TRAIN_BATCH = 2, 3  # trained at another batch than the export's: the batch axis is dynamic
STEPS, LR, WEIGHT_DECAY, EPS = 4, 3e-3, 0.01, 1e-6
PER_TENSOR = 1e-3  # max abs error relative to the tensor's own largest magnitude
NOISE = 1e-6  # of the model's largest gradient: float32 rounding in both engines

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def export(model: LibraryModel, module: torch.nn.Module) -> onnx.ModelProto:
    x, _ = model.batch(EXPORT_BATCH)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.from_numpy(x),), buffer, dynamo=False, opset_version=17,
                          input_names=[model.input_name], output_names=["logits"], training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, dynamic_axes={model.input_name: {0: "batch"}, "logits": {0: "batch"}})
    return onnx.load_from_string(buffer.getvalue())


def assert_per_tensor(got: np.ndarray, want: np.ndarray, floor: float, what: str) -> None:
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    error = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert error <= max(PER_TENSOR * scale, floor), f"{what}: max error {error:.3g}, {error / max(scale, 1e-30):.3g} of its scale {scale:.3g}"


@pytest.mark.parametrize("model", [pytest.param(m, id=m.name, marks=[pytest.mark.slow] if m.slow else []) for m in MODELS.values()])
def test_library_model_trains_like_torch(model: LibraryModel, tmp_path):
    proto = export(model, model.build())  # its own instance: exporting runs forward (BatchNorm's statistics move)
    reference = model.build()
    matched, forms = matched_parameters(proto, reference)
    trainable = sorted(matched)
    artifacts.generate_artifacts(proto, requires_grad=trainable, loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=tmp_path, optimizer=optim.AdamW(mode="torch", weight_decay=WEIGHT_DECAY, eps=EPS))
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", module)
    optimizer.set_learning_rate(LR)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=WEIGHT_DECAY)

    x, labels = model.batch(TRAIN_BATCH)
    ours, theirs = [], []
    for step in range(STEPS):
        ours.append(float(module(x, labels)))
        loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(labels))
        loss.backward()
        theirs.append(loss.item())
        if step == 0:
            np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, err_msg="first loss")
            floor = NOISE * max(float(np.abs(forms[key][1](grad)).max()) for key in matched.values())
            for name, key in matched.items():
                got = state.parameters[name].grad
                assert_per_tensor(got, np.reshape(forms[key][1](grad), got.shape), floor, f"gradient of {name} ({key})")
        optimizer.step()
        module.lazy_reset_grad()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, err_msg=f"{STEPS} AdamW steps' losses")
    for name, key in matched.items():
        got = state.parameters[name].data
        assert_per_tensor(got, np.reshape(forms[key][1](value), got.shape), 0.0, f"{name} ({key}) after {STEPS} AdamW steps")
