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
from odt_ops.export import ModelDiff, ModelDiffError, aggregate, apply_diff, load_diff, model_diff, save_diff
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


# ---- forged example counts (audit: num_examples = 10**400 raised OverflowError, two of 10**308 averaged to zeros) ----
FORGED_COUNTS = [10**400, 10**308, 2**53 + 1, -1, 1.5, 1e308, float("inf"), "7", True, None, [3]]


def _tiny(n, value, base_hash="h" * 64):
    return ModelDiff({"w": np.full((2, 3), value, np.float32), "b": np.arange(3, dtype=np.float32) * value}, base_hash, n)


def _forge_file(path, **header):
    """A model difference file whose manifest says what a forger wants (the writer does not check it)."""
    from odt_ops.export import DIFF_FORMAT, DIFF_VERSION
    from odt_ops.tensorfile import write_tensor_file

    header = {"base_hash": "h" * 64, "num_examples": 3, "num_steps": 1, "metadata": {}, **header}
    write_tensor_file(path, DIFF_FORMAT, DIFF_VERSION, header, [({"name": "w"}, np.ones((2, 3), np.float32))], ModelDiffError)


@pytest.mark.parametrize("key", ["num_examples", "num_steps"])
@pytest.mark.parametrize("value", FORGED_COUNTS, ids=lambda v: repr(v)[:24])
def test_load_diff_refuses_a_forged_count_naming_the_file_and_key(tmp_path, key, value):
    path = tmp_path / "forged.odtdiff"
    _forge_file(path, **{key: value})
    with pytest.raises(ModelDiffError) as info:
        load_diff(path)
    assert str(path) in str(info.value) and key in str(info.value), info.value


def test_load_diff_takes_counts_up_to_2_53(tmp_path):
    path = tmp_path / "big.odtdiff"
    _forge_file(path, num_examples=2**53, num_steps=0)
    assert load_diff(path).num_examples == 2**53
    from odt_ops.export import MAX_COUNT

    assert MAX_COUNT == 2**53 and float(MAX_COUNT) == MAX_COUNT and float(MAX_COUNT - 1) == MAX_COUNT - 1  # exact in float64


@pytest.mark.parametrize("value", FORGED_COUNTS, ids=lambda v: repr(v)[:24])
def test_model_diff_and_save_diff_refuse_a_bad_count(trained, tmp_path, value):
    d, *_ = trained
    with pytest.raises(ModelDiffError, match=r"model_diff: num_examples"):
        model_diff(d / "checkpoint", d / "trained", num_examples=value)
    diff = model_diff(d / "checkpoint", d / "trained", num_examples=3)
    diff.num_examples = value
    with pytest.raises(ModelDiffError, match="num_examples"):
        save_diff(diff, tmp_path / "u.odtdiff")
    assert not (tmp_path / "u.odtdiff").exists()  # nothing written that load_diff would refuse


def test_aggregate_refuses_the_audits_forged_counts():
    # before: builtins.OverflowError: int too large to convert to float
    with pytest.raises(ModelDiffError, match=r"aggregate: difference 0: num_examples is about 10\*\*400"):
        aggregate([_tiny(10**400, 1.0), _tiny(1, 2.0)])
    # before: the weights summed to inf, every weight became 0 and the aggregate came back all zeros, no error
    with pytest.raises(ModelDiffError, match=r"aggregate: difference 1: num_examples"):
        aggregate([_tiny(5, 1.0), _tiny(10**308, 3.0)])
    # each count legal, their sum not: refused, naming the counts
    with pytest.raises(ModelDiffError, match=r"sum to 18014398509481984, more than 2\*\*53"):
        aggregate([_tiny(2**53, 1.0), _tiny(2**53, 3.0)])
    # FedAvg's weighting: a difference with no examples weighs nothing; with no counts at all, all weigh the same
    np.testing.assert_array_equal(aggregate([_tiny(5, 1.0), _tiny(0, 3.0)]).deltas["w"], _tiny(5, 1.0).deltas["w"])
    np.testing.assert_allclose(aggregate([_tiny(0, 1.0), _tiny(0, 3.0)]).deltas["w"], _tiny(0, 2.0).deltas["w"])
    with pytest.raises(ModelDiffError, match=r"aggregate: difference 1: \['w', 'b'\] hold NaN"):
        aggregate([_tiny(5, 1.0), _tiny(5, np.nan)])


def _oracle(diffs, weights):
    """sum_i w_i d_i / sum_i w_i, by hand: exact fractions for the weights, float64 for the sum."""
    from fractions import Fraction

    fw = [Fraction(w) for w in weights]
    total = sum(fw)
    factors = [float(w / total) for w in fw]
    return {n: sum(f * d.deltas[n].astype(np.float64) for f, d in zip(factors, diffs)) for n in diffs[0].deltas}


def test_aggregate_with_huge_legal_counts_equals_the_float64_oracle():
    counts = [2**52, 2**52 - 7, 7]  # sum exactly 2**53
    diffs = [_tiny(n, v) for n, v in zip(counts, (1.0, -3.0, 1000.0))]
    avg = aggregate(diffs)
    assert avg.num_examples == 2**53
    for n, expected in _oracle(diffs, counts).items():
        np.testing.assert_allclose(avg.deltas[n], expected.astype(np.float32), rtol=1e-6, atol=0)
    assert np.all(avg.deltas["w"] != 0)


def test_explicit_weights_near_float64s_limits_equal_the_oracle():
    diffs = [_tiny(1, v) for v in (1.0, 3.0, 5.0)]
    for weights in ([1e308, 1e308, 1e292], [5e-324, 5e-324, 1e-323], [1.7e308, 0, 1.7e308]):
        # before: [1e308, 1e308, ...] summed to inf and the aggregate was all zeros
        avg = aggregate(diffs, weights)
        for n, expected in _oracle(diffs, weights).items():
            np.testing.assert_allclose(avg.deltas[n], expected.astype(np.float32), rtol=1e-6, atol=0)
        assert np.all(avg.deltas["w"] != 0)


@pytest.mark.parametrize("weights, match", [
    ([1, float("nan"), 1], r"weights\[1\] is nan"), ([1, 1, float("inf")], r"weights\[2\] is inf"),
    ([1, -1, 1], r"weights\[1\] is -1"), ([1, 10**400, 1], r"weights\[1\] is 1000"), ([True, 1, 1], r"weights\[0\] is True"),
    (["1", 1, 1], r"weights\[0\] is '1'"), ([0, 0, 0], "sum to 0"), ([1, 1], "must be 3 numbers"), ("abc", "must be 3 numbers"),
])
def test_aggregate_refuses_bad_weights_naming_them(weights, match):
    with pytest.raises(ModelDiffError, match=match):
        aggregate([_tiny(1, v) for v in (1.0, 3.0, 5.0)], weights)
