"""A train step given bad numbers, case by case on a small MLP: each gets a typed error that
names the value, and the parameters, gradients and optimizer state stay bit for bit as they were.

Oracles: onnxruntime (which refuses out-of-range labels too), its bindings' documented types
(set_learning_rate takes a float: anything else is a TypeError), and plain expectations
(a rate that is NaN, infinite or negative cannot train; 0/0 is not a loss)."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.checkpoint import load_checkpoint
from odt_ops.errors import ArgumentError, ArgumentTypeError, EmptyBatchError, InputError, LabelError, NonFiniteValueError
from tests.odt_ops.models import classification_data, mlp

CLASSES = 3


@pytest.fixture(scope="module")
def artifact_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad_numbers")
    artifacts.generate_artifacts(mlp((8, 6, CLASSES)), requires_grad=["fc*"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=d)
    return d


@pytest.fixture
def trained(artifact_dir):
    """A Module and Optimizer two steps in (so the moments are non-zero), and a batch."""
    state = CheckpointState.load_checkpoint(artifact_dir / "checkpoint")
    module = Module(artifact_dir / "training_model.onnx", state, artifact_dir / "eval_model.onnx")
    optimizer = Optimizer(artifact_dir / "optimizer_model.onnx", module)
    x, y = classification_data(6, features=8, classes=CLASSES)
    for _ in range(2):
        module(x, y)
        optimizer.step()
    return state, module, optimizer, x, y


def _snapshot(state, module) -> dict[str, np.ndarray]:
    ckpt = state.training_state.checkpoint
    out = {f"param {n}": np.array(a) for n, a in ckpt.parameters.items()}
    out |= {f"grad {n}": np.array(a) for n, a in module.grads.views.items()}
    out |= {f"{s} {p}": np.array(a) for p, states in ckpt.optimizer.states.items() for s, a in states.items()}
    out["step, lr"] = np.array([ckpt.optimizer.step, ckpt.optimizer.learning_rate])
    return out


def _assert_untouched(before, state, module):
    after = _snapshot(state, module)
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=key)


@pytest.mark.parametrize("rate, error", [(float("nan"), ArgumentError), (float("inf"), ArgumentError),
                                         (-1e-3, ArgumentError), ("0.1", ArgumentTypeError), (None, ArgumentTypeError)])
def test_a_bad_learning_rate_is_refused_by_name(trained, rate, error):
    state, module, optimizer, x, y = trained
    before = _snapshot(state, module)
    with pytest.raises(error, match=r"set_learning_rate\(" + repr(rate).replace("(", r"\(").replace(".", r"\.")) as info:
        optimizer.set_learning_rate(rate)
    if error is ArgumentTypeError:  # what onnxruntime's pybind11 binding raises for a non-float
        assert isinstance(info.value, TypeError)
    _assert_untouched(before, state, module)
    optimizer.step()  # and training goes on finite
    assert all(np.isfinite(a).all() for a in state.training_state.checkpoint.parameters.values())


def test_good_learning_rates_are_still_taken(trained):
    _, _, optimizer, _, _ = trained
    for rate in (0.0, 1, np.float32(0.5), 2e-4):
        optimizer.set_learning_rate(rate)
        assert optimizer.get_learning_rate() == float(rate)


@pytest.mark.parametrize("bad", [CLASSES, -1, 99])
def test_a_label_outside_the_classes_is_named_with_the_class_count(trained, artifact_dir, bad):
    state, module, optimizer, x, y = trained
    labels = y.copy()
    labels[4] = bad
    if bad >= CLASSES:  # onnxruntime refuses these as well (its gather wraps negative ones around;
        # the ONNX spec's SoftmaxCrossEntropyLoss takes labels in [0, C) only)
        ckpt = load_checkpoint(artifact_dir / "checkpoint")
        session = ort.InferenceSession(str(artifact_dir / "eval_model.onnx"), providers=["CPUExecutionProvider"])
        with pytest.raises(Exception, match="(?i)out of range"):
            session.run(None, {"input": x, "labels": labels, **ckpt.parameters})
    before = _snapshot(state, module)
    for mode in ("train", "accumulate", "eval"):
        if mode == "accumulate":
            module.train()
            module(x, y)  # the next step would add its gradients
            before = _snapshot(state, module)
        elif mode == "eval":
            module.eval()
        else:
            module.train()
            module.lazy_reset_grad()
        with pytest.raises(LabelError, match=rf"label {bad} at position \[4\] is outside \[0, {CLASSES}\).*{CLASSES} classes"):
            module(x, labels)
        _assert_untouched(before, state, module)


def test_an_empty_batch_is_named_not_called_divergence(trained):
    state, module, optimizer, x, y = trained
    before = _snapshot(state, module)
    for mode in (module.train, module.eval):
        mode()
        with pytest.raises(EmptyBatchError, match="'input' holds a batch of 0 examples") as info:
            module(x[:0], y[:0])
        assert isinstance(info.value, InputError)
        assert "learning rate" not in str(info.value)
        _assert_untouched(before, state, module)


def test_save_checkpoint_refuses_non_finite_parameters_and_keeps_the_old_file(trained, tmp_path):
    state, module, optimizer, x, y = trained
    path = tmp_path / "checkpoint"
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    good = path.read_bytes()
    name = next(iter(state.parameters.keys()))
    state.parameters[name].data.flat[3] = np.inf
    state.parameters[name].data.flat[5] = np.nan
    with pytest.raises(NonFiniteValueError, match=rf"not saved: '{name}' \(2 values\) hold NaN or infinite"):
        CheckpointState.save_checkpoint(state, path)
    assert path.read_bytes() == good
    state.parameters[name].data.flat[3] = state.parameters[name].data.flat[5] = 0.0
    moment = next(iter(state.training_state.checkpoint.optimizer.states[name].values()))
    moment.flat[0] = np.nan  # a moment gone bad matters only when the optimizer state is saved
    with pytest.raises(NonFiniteValueError, match=rf"'{name} \("):
        CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=False)
    reloaded = load_checkpoint(path)
    np.testing.assert_array_equal(reloaded.parameters[name], state.parameters[name].data)
