"""Leaving training: the inference export runs on onnxruntime like the eval model on the engine;
model differences round-trip, aggregate by weight, and refuse what does not fit."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.checkpoint import load_checkpoint
from odt_ops.export import ModelDiffError, aggregate, apply_diff, load_diff, model_diff, save_diff
from tests.odt_ops.models import classification_data, cnn


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("cnn")
    artifacts.generate_artifacts(cnn(), requires_grad=["conv2.*", "fc.*"], frozen_params=["conv1.*", "bn1.weight", "bn1.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW, artifact_directory=d)
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    module = Module(d / "training_model.onnx", state, d / "eval_model.onnx")
    opt = Optimizer(d / "optimizer_model.onnx", module)
    opt.set_learning_rate(3e-3)
    x, y = classification_data(64, features=784)
    x = x.reshape(-1, 1, 28, 28)
    for i in range(4):
        module(x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16])
        opt.step()
        module.lazy_reset_grad()
    CheckpointState.save_checkpoint(state, d / "trained")
    return d, module, state, x, y


def test_export_runs_on_onnxruntime_like_the_eval_model(trained, tmp_path):
    d, module, state, x, y = trained
    module.export_model_for_inferencing(tmp_path / "inference.onnx", ["output"])
    proto = onnx.load(tmp_path / "inference.onnx")
    onnx.checker.check_model(proto, full_check=True)
    assert [i.name for i in proto.graph.input] == ["input"]
    assert [o.name for o in proto.graph.output] == ["output"]
    assert not any(n.op_type in ("SoftmaxCrossEntropyLoss",) for n in proto.graph.node)
    # the running statistics the training steps updated are baked in
    bn_mean = next(t for t in proto.graph.initializer if t.name == "bn1.running_mean")
    assert np.abs(onnx.numpy_helper.to_array(bn_mean)).sum() > 0
    got = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"input": x[:8]})[0]
    # the eval model's extra output is not requested here, so compare with a fresh eval on logits
    from odt_ops import InferenceSession
    want = InferenceSession(proto).run(None, {"input": x[:8]})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    module.eval()
    loss = module(x[:8], y[:8])
    ref = -np.log(np.exp(got - got.max(1, keepdims=True)) / np.exp(got - got.max(1, keepdims=True)).sum(1, keepdims=True))[np.arange(8), y[:8]].mean()
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    module.train()


def test_model_diff_round_trip_and_apply(trained, tmp_path):
    d, module, state, x, y = trained
    base = load_checkpoint(d / "checkpoint")
    diff = model_diff(base, d / "trained", num_examples=64, num_steps=4)
    assert set(diff.deltas) == {"conv2.weight", "conv2.bias", "fc.weight", "fc.bias"}  # trainable only
    save_diff(diff, tmp_path / "update.odtdiff")
    back = load_diff(tmp_path / "update.odtdiff")
    assert (back.num_examples, back.num_steps, back.base_hash) == (64, 4, diff.base_hash)
    applied = apply_diff(base, tmp_path / "update.odtdiff")
    trained_ckpt = load_checkpoint(d / "trained")
    for name in diff.deltas:
        np.testing.assert_allclose(applied.parameters[name], trained_ckpt.parameters[name], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(applied.parameters["conv1.weight"], base.parameters["conv1.weight"])


def test_aggregate_is_weighted_federated_averaging(trained):
    d, *_ = trained
    base = load_checkpoint(d / "checkpoint")
    diff = model_diff(base, d / "trained", num_examples=30)
    other = model_diff(base, d / "trained", num_examples=10)
    other.deltas = {n: -3 * v for n, v in other.deltas.items()}
    avg = aggregate([diff, other])
    for n in diff.deltas:
        np.testing.assert_allclose(avg.deltas[n], 0.75 * diff.deltas[n] + 0.25 * other.deltas[n], rtol=1e-5, atol=1e-7)
    assert avg.num_examples == 40
    equal = aggregate([diff, other], weights=[1, 1])
    np.testing.assert_allclose(equal.deltas["fc.bias"], -diff.deltas["fc.bias"], rtol=1e-5, atol=1e-7)


def test_diff_refuses_what_does_not_fit(trained, tmp_path):
    d, *_ = trained
    base = load_checkpoint(d / "checkpoint")
    diff = model_diff(base, d / "trained")
    trained_ckpt = load_checkpoint(d / "trained")
    with pytest.raises(ModelDiffError, match="another base"):
        apply_diff(trained_ckpt, diff)  # the trained model is not the base the diff was made from
    bad = model_diff(base, d / "trained")
    bad.deltas["fc.bias"] = bad.deltas["fc.bias"][:3]
    with pytest.raises(ModelDiffError, match="fc.bias"):
        apply_diff(base, bad)
    bad = model_diff(base, d / "trained")
    bad.deltas["nope"] = np.zeros(2, np.float32)
    with pytest.raises(ModelDiffError, match="nope"):
        apply_diff(base, bad)
    bad = model_diff(base, d / "trained")
    bad.deltas["fc.weight"] = bad.deltas["fc.weight"].astype(np.float64)
    with pytest.raises(ModelDiffError, match="fc.weight"):
        apply_diff(base, bad)
    bad = model_diff(base, d / "trained")
    bad.deltas["fc.bias"][0] = np.nan
    with pytest.raises(ModelDiffError, match="NaN"):
        save_diff(bad, tmp_path / "nan.odtdiff")
    assert not (tmp_path / "nan.odtdiff").exists()
    with pytest.raises(ModelDiffError, match="different base"):
        other = model_diff(base, d / "trained")
        other.base_hash = "0" * 64
        aggregate([diff, other])
