"""CheckpointState and Module as ONNX Runtime documents them: nominal checkpoints refuse to
train until filled and never lose what was trained, the property bag holds only the user's
properties, iteration yields ONNX Runtime's pairs, and 0-d (scalar) parameters round-trip."""
from __future__ import annotations

import json

import numpy as np
import pytest
from onnx import helper, numpy_helper

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from odt_ops.errors import CheckpointError
from tests.odt_ops.models import classification_data, mlp

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle for the scalar parameter")


def _generate(d, *, frozen=(), dropout=0.0):
    trainable = [n for n in ("fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias") if n not in frozen]
    artifacts.generate_artifacts(mlp((20, 16, 4), dropout=dropout), requires_grad=trainable, frozen_params=list(frozen),
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=d, nominal_checkpoint=True)
    return d


def _data(n=8):
    x, y = classification_data(n, features=20, classes=4)
    return x, y.astype(np.int64)


def _session(d, checkpoint):
    state = CheckpointState.load_checkpoint(d / checkpoint)
    module = Module(d / "training_model.onnx", state, d / "eval_model.onnx")
    return state, module, Optimizer(d / "optimizer_model.onnx", module)


def _train(module, optimizer, x, y, steps=3):
    module.train()
    losses = []
    for _ in range(steps):
        losses.append(float(module(x, y)))
        optimizer.step()
        module.lazy_reset_grad()
    return losses


def test_nominal_checkpoint_filled_trains_as_the_full_one_and_saves_what_it_trained(tmp_path):
    d = _generate(tmp_path)
    x, y = _data()
    full_state, full, full_opt = _session(d, "checkpoint")
    nominal_state, nominal, nominal_opt = _session(d, "nominal_checkpoint")
    nominal.copy_buffer_to_parameters(full.get_contiguous_parameters(), trainable_only=False)

    assert _train(nominal, nominal_opt, x, y) == _train(full, full_opt, x, y)
    CheckpointState.save_checkpoint(nominal_state, tmp_path / "trained")
    saved = load_checkpoint(tmp_path / "trained")
    assert not saved.nominal
    for name, parameter in full_state.parameters:
        np.testing.assert_array_equal(saved.parameters[name], parameter.data)
    # and the saved file evaluates as the module that trained
    state = CheckpointState.load_checkpoint(tmp_path / "trained")
    module = Module(d / "training_model.onnx", state, d / "eval_model.onnx")
    module.eval()
    full.eval()
    np.testing.assert_array_equal(module(x, y), full(x, y))


def test_nominal_state_refuses_every_use_until_its_parameters_are_copied_in(tmp_path):
    d = _generate(tmp_path)
    x, y = _data()
    state, module, optimizer = _session(d, "nominal_checkpoint")
    assert module.get_parameters_size() == 20 * 16 + 16 + 16 * 4 + 4  # sizes are known without values
    assert "fc0.weight" in state.parameters
    uses = {
        "train step": lambda: module.train()(x, y),
        "eval step": lambda: module.eval()(x, y),
        "optimizer step": optimizer.step,
        "contiguous parameters": module.get_contiguous_parameters,
        "export": lambda: module.export_model_for_inferencing(tmp_path / "inference.onnx"),
    }
    for use, call in uses.items():
        with pytest.raises(CheckpointError, match="Please load the model parameters first") as raised:
            call()
        assert "copy_buffer_to_parameters" in str(raised.value), use
    with pytest.raises(CheckpointError, match="Please load the parameter states first"):
        state.parameters["fc0.weight"]
    with pytest.raises(CheckpointError, match="Please load all the parameter states first"):
        state.parameters["fc0.weight"] = np.ones((16, 20), np.float32)
    assert not (tmp_path / "inference.onnx").exists()


def test_a_partly_filled_nominal_state_neither_trains_nor_saves_over_good_data(tmp_path):
    d = _generate(tmp_path, frozen=("fc0.weight", "fc0.bias"))
    x, y = _data()
    _, full, _ = _session(d, "checkpoint")
    state, module, _ = _session(d, "nominal_checkpoint")
    module.copy_buffer_to_parameters(full.get_contiguous_parameters(trainable_only=True), trainable_only=True)
    with pytest.raises(CheckpointError, match="fc0.weight"):
        module.train()(x, y)
    before = (d / "checkpoint").read_bytes()
    with pytest.raises(CheckpointError, match="trainable_only=False"):
        CheckpointState.save_checkpoint(state, d / "checkpoint")
    assert (d / "checkpoint").read_bytes() == before
    module.copy_buffer_to_parameters(full.get_contiguous_parameters(), trainable_only=False)
    full.train()
    assert float(module(x, y)) == float(full(x, y))


def test_the_property_bag_holds_only_the_users_properties(tmp_path):
    d = _generate(tmp_path, dropout=0.3)  # Dropout: the engine has a generator to save
    x, y = _data()
    state, module, optimizer = _session(d, "checkpoint")
    assert len(state.properties) == 0
    state.properties["epoch"] = 3
    state.properties["user"] = "u7"
    _train(module, optimizer, x, y)
    CheckpointState.save_checkpoint(state, tmp_path / "saved", include_optimizer_state=True)
    back = CheckpointState.load_checkpoint(tmp_path / "saved")
    assert len(back.properties) == 2
    assert dict(back.properties) == {"epoch": 3, "user": "u7"}  # iteration yields (key, value) pairs
    assert back["epoch"] == 3
    assert "user" in back  # ONNX Runtime 1.16's state[name]

    # the Dropout generator was saved elsewhere: the resumed run draws the masks the first run would
    resumed = Module(d / "training_model.onnx", back, d / "eval_model.onnx")
    resumed_opt = Optimizer(d / "optimizer_model.onnx", resumed)
    assert _train(resumed, resumed_opt, x, y, 2) == _train(module, optimizer, x, y, 2)


def test_checkpoints_of_earlier_versions_move_the_generator_out_of_the_property_bag(tmp_path):
    saved = json.dumps(np.random.default_rng(3).bit_generator.state)  # a real state: damaged ones are refused
    save_checkpoint(Checkpoint(parameters={"w": np.ones(2, np.float32)}, requires_grad={"w": True},
                               properties={"odt.rng_state": saved, "mine": 1}), tmp_path / "old")
    back = load_checkpoint(tmp_path / "old")
    assert back.properties == {"mine": 1}
    assert back.engine == {"rng_state": saved}


def test_parameters_iterate_as_name_and_parameter_pairs(tmp_path):
    d = _generate(tmp_path, frozen=("fc0.weight", "fc0.bias"))
    state, module, _ = _session(d, "checkpoint")
    x, y = _data()
    module.train()(x, y)
    pairs = list(state.parameters)
    assert [name for name, _ in pairs] == state.parameters.keys()
    assert len(state.parameters) == 4
    for name, parameter in pairs:
        assert parameter.name == name
        assert (parameter.grad is None) == (not parameter.requires_grad) == name.startswith("fc0")
    flat = module.get_contiguous_parameters()
    assert isinstance(flat.numpy(), np.ndarray)
    assert np.shares_memory(flat.numpy(), flat)  # .numpy() is a view


def _temperature_model(w, t):
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Div", ["h", "temperature"], ["y"])], "scaled",
        [helper.make_tensor_value_info("x", 1, ["N", 4])], [helper.make_tensor_value_info("y", 1, ["N", 3])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(t, "temperature")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_scalar_parameter_trains_as_pytorch_and_round_trips_as_0d(tmp_path):
    rng = np.random.default_rng(0)
    w, t = rng.standard_normal((4, 3)).astype(np.float32), np.array(1.7, np.float32)
    x, y = rng.standard_normal((6, 4)).astype(np.float32), rng.integers(0, 3, 6)
    artifacts.generate_artifacts(_temperature_model(w, t), requires_grad=["W", "temperature"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path, nominal_checkpoint=True)
    assert load_checkpoint(tmp_path / "checkpoint").parameters["temperature"].shape == ()
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    loss = module(x, y)

    tw, tt = torch.tensor(w, requires_grad=True), torch.tensor(t, requires_grad=True)
    want = torch.nn.functional.cross_entropy(torch.tensor(x) @ tw / tt, torch.tensor(y))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-6)
    np.testing.assert_allclose(state.parameters["temperature"].grad, tt.grad.numpy(), rtol=1e-5)
    assert state.parameters["temperature"].grad.shape == ()

    state.parameters["temperature"].data = np.array(2.5, np.float32)
    CheckpointState.save_checkpoint(state, tmp_path / "saved")
    assert CheckpointState.load_checkpoint(tmp_path / "saved").parameters["temperature"].data == np.float32(2.5)
    nominal = CheckpointState.load_checkpoint(tmp_path / "nominal_checkpoint")
    filled = Module(tmp_path / "training_model.onnx", nominal)
    filled.copy_buffer_to_parameters(Module(tmp_path / "training_model.onnx", CheckpointState.load_checkpoint(tmp_path / "saved"))
                                     .get_contiguous_parameters(), trainable_only=False)
    assert nominal.parameters["temperature"].data == np.float32(2.5)
