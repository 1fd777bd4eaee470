"""The on-device training API: an onnxruntime training loop ported by changing imports,
gradient accumulation, exact resume in a fresh process, determinism, export, bad input."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from odt_ops import artifacts
from odt_ops.api import CheckpointState, LinearLRScheduler, Module, Optimizer, TrainingDivergedError
from odt_ops.errors import CheckpointError
from tests.odt_ops.models import classification_data, mlp


def _generate(d, dropout):
    artifacts.generate_artifacts(
        mlp((784, 32, 10), dropout=dropout), requires_grad=["fc*"], loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW, artifact_directory=d, nominal_checkpoint=True, additional_output_names=["output"],
    )
    return d


@pytest.fixture(scope="module")
def mlp_artifacts(tmp_path_factory):
    return _generate(tmp_path_factory.mktemp("mlp"), dropout=0.0)


@pytest.fixture(scope="module")
def dropout_artifacts(tmp_path_factory):
    """With Dropout, so determinism and resume also cover the random masks."""
    return _generate(tmp_path_factory.mktemp("dropout"), dropout=0.2)


def test_onnxruntime_training_loop_ported_by_changing_imports(tmp_path):
    # The loop below is written as onnxruntime's on-device training documentation shows it;
    # only the two import lines differ (onnxruntime.training -> odt_ops).
    from odt_ops import artifacts
    from odt_ops.api import CheckpointState, Module, Optimizer

    onnx_model = mlp((784, 32, 10))
    requires_grad = [t.name for t in onnx_model.graph.initializer]
    artifacts.generate_artifacts(onnx_model, requires_grad=requires_grad, frozen_params=[],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    model = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    optimizer = Optimizer(str(tmp_path / "optimizer_model.onnx"), model)

    x, y = classification_data(512)
    batches = [(x[i : i + 64], y[i : i + 64]) for i in range(0, 512, 64)]

    def train():
        model.train()
        losses = []
        for data, target in batches:
            forward_inputs = [data.reshape(len(data), 784), target.astype(np.int64)]
            train_loss = model(*forward_inputs)
            optimizer.step()
            model.lazy_reset_grad()
            losses.append(train_loss)
        return np.mean(losses)

    def test():
        model.eval()
        return np.mean([model(data.reshape(len(data), 784), target.astype(np.int64)) for data, target in batches])

    before = test()
    for _ in range(3):
        train()
    after = test()
    assert after < before * 0.5, (before, after)
    model.export_model_for_inferencing(str(tmp_path / "inference.onnx"), ["output"])
    CheckpointState.save_checkpoint(state, str(tmp_path / "trained_checkpoint"))
    sess = ort.InferenceSession(str(tmp_path / "inference.onnx"), providers=["CPUExecutionProvider"])
    logits = sess.run(["output"], {"input": x[:64]})[0]
    assert (logits.argmax(1) == y[:64]).mean() > 0.9


def test_gradients_accumulate_until_lazy_reset(mlp_artifacts):
    x, y = classification_data(8)
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state, mlp_artifacts / "eval_model.onnx", seed=1)
    module.eval()
    loss_eval, logits = module(x, y)
    module.train()
    loss_train, _ = module(x, y)
    assert loss_train == pytest.approx(float(loss_eval), rel=1e-6)  # no dropout: both modes agree
    g1 = state.parameters["fc0.weight"].grad.copy()
    module(x, y)
    np.testing.assert_array_equal(state.parameters["fc0.weight"].grad, 2 * g1)
    module.lazy_reset_grad()
    module(x, y)
    np.testing.assert_array_equal(state.parameters["fc0.weight"].grad, g1)
    assert logits.shape == (8, 10)


def _train_steps(art, steps, x, y, state, seed=7):
    module = Module(art / "training_model.onnx", state, art / "eval_model.onnx", seed=seed)
    opt = Optimizer(art / "optimizer_model.onnx", module)
    opt.set_learning_rate(1e-2)
    for i in range(steps):
        module(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16])
        opt.step()
        module.lazy_reset_grad()
    return module


def test_same_seed_gives_bit_identical_parameters(dropout_artifacts):
    x, y = classification_data(160)
    a = _train_steps(dropout_artifacts, 6, x, y, CheckpointState.load_checkpoint(dropout_artifacts / "checkpoint"))
    b = _train_steps(dropout_artifacts, 6, x, y, CheckpointState.load_checkpoint(dropout_artifacts / "checkpoint"))
    assert np.array_equal(a.get_contiguous_parameters(), b.get_contiguous_parameters())
    c = _train_steps(dropout_artifacts, 6, x, y, CheckpointState.load_checkpoint(dropout_artifacts / "checkpoint"), seed=8)
    assert not np.array_equal(a.get_contiguous_parameters(), c.get_contiguous_parameters())  # the seed drives the masks


def test_resume_in_a_fresh_process_is_exact(dropout_artifacts, tmp_path):
    mlp_artifacts = dropout_artifacts
    x, y = classification_data(160)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    full = _train_steps(mlp_artifacts, 10, x, y, CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint"))
    first = _train_steps(mlp_artifacts, 4, x, y, state := CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint"))
    assert first is not None
    CheckpointState.save_checkpoint(state, tmp_path / "half", include_optimizer_state=True)
    script = textwrap.dedent(f"""
        import numpy as np
        from odt_ops.api import CheckpointState, Module, Optimizer
        art = {str(mlp_artifacts)!r}
        d = np.load({str(tmp_path / "data.npz")!r})
        x, y = d["x"], d["y"]
        state = CheckpointState.load_checkpoint({str(tmp_path / "half")!r})
        module = Module(art + "/training_model.onnx", state, art + "/eval_model.onnx", seed=999)
        opt = Optimizer(art + "/optimizer_model.onnx", module)
        for i in range(4, 10):
            module(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16])
            opt.step()
            module.lazy_reset_grad()
        np.save({str(tmp_path / "resumed.npy")!r}, module.get_contiguous_parameters())
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=str(tmp_path.parent))
    resumed = np.load(tmp_path / "resumed.npy")
    assert np.array_equal(resumed, full.get_contiguous_parameters())


def test_nominal_checkpoint_takes_weights_from_a_buffer(mlp_artifacts):
    full = Module(mlp_artifacts / "training_model.onnx", CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint"))
    nominal_state = CheckpointState.load_checkpoint(mlp_artifacts / "nominal_checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", nominal_state, mlp_artifacts / "eval_model.onnx")
    assert module.get_parameters_size() == full.get_parameters_size() == 784 * 32 + 32 + 32 * 10 + 10
    module.copy_buffer_to_parameters(full.get_contiguous_parameters())
    assert np.array_equal(nominal_state.parameters["fc1.weight"].data, full._state.parameters["fc1.weight"].data)


def test_optimizer_matches_its_graph_on_onnxruntime(mlp_artifacts):
    x, y = classification_data(16)
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state)
    opt = Optimizer(mlp_artifacts / "optimizer_model.onnx", module)
    opt.set_learning_rate(0.01)
    for _ in range(2):
        module(x, y)
        opt.step()
    module(x, y)
    proto = onnx.load(mlp_artifacts / "optimizer_model.onnx")
    names = [i.name for i in proto.graph.input]
    before = {n: state.parameters[n].data.copy() for n in state.parameters.keys()}  # noqa: SIM118 - iterating gives (name, value), as ORT's
    moments = {n: [s.copy() for s in state.checkpoint.optimizer.states[n].values()] for n in before}
    feeds = {"learning_rate": np.array(0.01, np.float32), "step": np.array(3, np.int64)}
    meta = [p for p in __import__("odt_ops.meta", fromlist=["x"]).read_optimizer(proto)["parameters"]]
    for p in meta:
        feeds[p["value"]] = before[p["name"]]
        feeds[p["grad"]] = state.parameters[p["name"]].grad.copy()
        for (_state_name, sinput), value in zip(p["states"].items(), moments[p["name"]]):
            feeds[sinput] = value
    assert set(feeds) == set(names)
    outs = dict(zip([o.name for o in proto.graph.output], ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)))
    opt.step()
    for p in meta:
        np.testing.assert_allclose(state.parameters[p["name"]].data, outs[p["outputs"][0]], rtol=1e-6, atol=1e-7)


def test_linear_scheduler_has_the_documented_meaning(mlp_artifacts):
    module = Module(mlp_artifacts / "training_model.onnx", CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint"))
    opt = Optimizer(mlp_artifacts / "optimizer_model.onnx", module)
    sched = LinearLRScheduler(opt, warmup_step_count=2, total_step_count=6, initial_lr=1.0)
    rates = [opt.get_learning_rate()]
    for _ in range(6):
        sched.step()
        rates.append(opt.get_learning_rate())
    assert rates == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0]


def test_nan_loss_stops_and_leaves_parameters(mlp_artifacts):
    state = CheckpointState.load_checkpoint(mlp_artifacts / "checkpoint")
    module = Module(mlp_artifacts / "training_model.onnx", state)
    before = module.get_contiguous_parameters()
    x, y = classification_data(4)
    x[0, 0] = np.nan
    with pytest.raises(TrainingDivergedError, match="loss"):
        module(x, y)
    assert np.array_equal(module.get_contiguous_parameters(), before)


def test_checkpoint_that_does_not_fit_names_the_parameters(tmp_path, mlp_artifacts):
    artifacts.generate_artifacts(mlp((784, 16, 10)), requires_grad=["fc*"], loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    with pytest.raises(CheckpointError, match="fc0.weight"):
        Module(mlp_artifacts / "training_model.onnx", CheckpointState.load_checkpoint(tmp_path / "checkpoint"))
