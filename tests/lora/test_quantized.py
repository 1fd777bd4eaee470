"""Fine-tuning quantized (QDQ) models.

Oracles: torch.fake_quantize_per_tensor_affine / per_channel_affine for the fake-quantized
forward and its straight-through gradients (zero outside the clip range), on int8, uint8
and blocked int4 weights; onnxruntime for the QDQ models it quantizes (quantize_static,
per-tensor and per-channel, int8 and uint8), the re-quantized export and the LoRA adapter
on a frozen quantized base.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from odt_ops import InferenceSession, artifacts, load_model
from odt_ops.api import CheckpointState, Module
from odt_ops.errors import QuantizationError
from odt_ops.lora import LoraConfig, export_adapter, export_adapter_base, export_merged
from odt_ops.quant.export import export_quantized
from tests.lora.quantized_models import int4_weight_only, quantize_static, train_cycling
from tests.lora.torch_models import data, export, make, torch

ort = pytest.importorskip("onnxruntime", reason="the quantized models' oracle is onnxruntime")
RANGES = {"int8": (-128, 127, TensorProto.INT8, np.int8), "uint8": (0, 255, TensorProto.UINT8, np.uint8)}


def _qdq_mlp(dtype: str, per_channel: bool, rng) -> tuple[onnx.ModelProto, dict]:
    """x -> Gemm(W1 float, trainable) -> Q/DQ (per-tensor, activation) -> MatMul(DQ(W2 quantized)) -> logits."""
    qmin, qmax, elem, np_type = RANGES[dtype]
    w1 = rng.standard_normal((6, 8)).astype(np.float32)
    w2 = rng.standard_normal((8, 4)).astype(np.float32)
    s_a, zp_a = np.float32(0.02), np_type(3 if dtype == "int8" else 128)  # a narrow range: some activations clip
    s_w = (np.abs(w2).max(axis=0) / 100).astype(np.float32) if per_channel else np.float32(np.abs(w2).max() / 100)
    zp_w = np.zeros(s_w.shape, np_type) if dtype == "int8" else np.full(s_w.shape, 120, np_type)
    q_w = np.clip(np.rint(w2 / s_w) + zp_w.astype(np.float32), qmin, qmax).astype(np_type)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
         helper.make_node("QuantizeLinear", ["h", "s_a", "zp_a"], ["h_q"], name="q_h"),
         helper.make_node("DequantizeLinear", ["h_q", "s_a", "zp_a"], ["h_dq"], name="dq_h"),
         helper.make_node("DequantizeLinear", ["w2_quantized", "s_w", "zp_w"], ["w2"], axis=1, name="dq_w2"),
         helper.make_node("MatMul", ["h_dq", "w2"], ["logits"], name="fc2")],
        "qdq_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(np.array(s_a), "s_a"), numpy_helper.from_array(np.array(zp_a), "zp_a"),
         numpy_helper.from_array(q_w, "w2_quantized"), numpy_helper.from_array(np.asarray(s_w), "s_w"), numpy_helper.from_array(np.asarray(zp_w), "zp_w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    return model, {"w1": w1, "q_w": q_w, "s_w": s_w, "zp_w": zp_w, "s_a": s_a, "zp_a": zp_a, "qmin": qmin, "qmax": qmax}


def _torch_fake_quant(p: dict, x: np.ndarray, y: np.ndarray, w2_master: np.ndarray):
    w1 = torch.tensor(p["w1"], requires_grad=True)
    w2 = torch.tensor(w2_master, requires_grad=True)
    h = torch.from_numpy(x) @ w1
    h_fq = torch.fake_quantize_per_tensor_affine(h, float(p["s_a"]), int(p["zp_a"]), p["qmin"], p["qmax"])
    if np.ndim(p["s_w"]):
        w_fq = torch.fake_quantize_per_channel_affine(w2, torch.from_numpy(p["s_w"]), torch.from_numpy(p["zp_w"].astype(np.int32)), 1,
                                                      p["qmin"], p["qmax"])
    else:
        w_fq = torch.fake_quantize_per_tensor_affine(w2, float(p["s_w"]), int(p["zp_w"]), p["qmin"], p["qmax"])
    loss = torch.nn.functional.cross_entropy(h_fq @ w_fq, torch.from_numpy(y))
    loss.backward()
    return loss.item(), w1.grad.numpy(), w2.grad.numpy(), h.detach().numpy(), w2_master


@pytest.mark.parametrize("dtype,per_channel", [("int8", False), ("int8", True), ("uint8", False), ("uint8", True)])
def test_qat_forward_and_straight_through_gradients_equal_torch_fake_quant(dtype, per_channel, tmp_path):
    rng = np.random.default_rng(len(dtype) + per_channel)
    model, p = _qdq_mlp(dtype, per_channel, rng)
    paths = artifacts.generate_artifacts(model, requires_grad=["w1"], loss=artifacts.LossType.CrossEntropyLoss,
                                         optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path, qat=True)
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    w2, w1 = state.checkpoint.trainable_names()  # the masters first, then requires_grad
    assert w1 == "w1", "the float master copy of w2_quantized trains beside w1"
    assert w2.startswith("w2"), "the float master copy of w2_quantized trains beside w1"
    module = Module(paths["training_model"], state, paths["eval_model"])
    x, y = rng.standard_normal((16, 6)).astype(np.float32), rng.integers(0, 4, 16)
    np.testing.assert_array_equal(state.parameters[w2].data, (p["q_w"].astype(np.float32) - p["zp_w"].astype(np.float32)) * p["s_w"])
    master = state.parameters[w2].data.copy()
    # move the master off the grid and past the clip range in places: the STE's zero region
    master += rng.uniform(-0.6, 0.6, master.shape).astype(np.float32) * (np.asarray(p["s_w"]))
    master[0, :] = (p["qmax"] + 3 - p["zp_w"].astype(np.float32)) * p["s_w"]
    state.parameters[w2].data = master
    module.train()
    loss = module(x, y)
    want_loss, g1, g2, h, _ = _torch_fake_quant(p, x, y, master)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(state.parameters[w2].grad, g2, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(state.parameters["w1"].grad, g1, rtol=1e-4, atol=1e-6)
    assert (g2[0] == 0).all(), "clipped weights get no gradient"
    assert (state.parameters[w2].grad[0] == 0).all(), "clipped weights get no gradient"
    clipped = (np.rint(h / p["s_a"]) + float(p["zp_a"]) > p["qmax"]) | (np.rint(h / p["s_a"]) + float(p["zp_a"]) < p["qmin"])
    assert 0 < clipped.mean() < 1, "some activations fall outside the clip range, so the STE's zero region is exercised"


def test_int4_blocked_weight_fake_quant_equals_torch_per_block(tmp_path):
    rng = np.random.default_rng(4)
    model, scale = int4_weight_only(rng.standard_normal((8, 4)).astype(np.float32), block_size=4)
    paths = artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path, qat=True)
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    (name,) = state.checkpoint.trainable_names()
    master = state.parameters[name].data + rng.uniform(-0.4, 0.4, (8, 4)).astype(np.float32) * np.repeat(scale, 4, axis=0)
    master[0, 0] = 9.5 * scale[0, 0]  # past int4's 7: clipped
    state.parameters[name].data = master
    module = Module(paths["training_model"], state, paths["eval_model"])
    x, y = rng.standard_normal((5, 8)).astype(np.float32), rng.integers(0, 4, 5)
    module.train()
    loss = module(x, y)
    w = torch.tensor(master, requires_grad=True)  # blocks of 4 along axis 0 as torch's channels: [2, 4, 4] -> [2*4 cols, 4]
    blocks = w.reshape(2, 4, 4).permute(0, 2, 1).reshape(8, 4)
    s = torch.from_numpy(scale.reshape(-1).copy())
    fq = torch.fake_quantize_per_channel_affine(blocks, s, torch.zeros(8, dtype=torch.int32), 0, -8, 7)
    w_fq = fq.reshape(2, 4, 4).permute(0, 2, 1).reshape(8, 4)
    want = torch.nn.functional.cross_entropy(torch.from_numpy(x) @ w_fq, torch.from_numpy(y))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    np.testing.assert_allclose(state.parameters[name].grad, w.grad.numpy(), rtol=1e-4, atol=1e-6)
    assert state.parameters[name].grad[0, 0] == 0


def _ort(proto_or_path, x, optimized: bool = False):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    if not optimized:  # run the Q/DQ nodes as written (the optimizer swaps in integer kernels that round differently)
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = proto_or_path.SerializeToString() if isinstance(proto_or_path, onnx.ModelProto) else str(proto_or_path)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _train(paths, x, y, steps=6, lr=0.02):
    return train_cycling(paths, x, y, steps=steps, lr=lr, batch=8)


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # torch's quantized tensors are the oracle, deprecated or not
@pytest.mark.parametrize("per_channel,dtype", [(False, "uint8"), (True, "int8")])
def test_onnxruntime_qdq_model_fine_tunes_with_qat_and_exports_the_same_qdq_layout(per_channel, dtype, tmp_path):
    x, y = data("cnn", 32)
    qdq = quantize_static(export(make("cnn"), x[:2]), x, tmp_path, per_channel=per_channel, dtype=dtype)
    np.testing.assert_array_equal(InferenceSession(qdq).run(None, {"x": x})[0], _ort(qdq, x), "our Q/DQ kernels are onnxruntime's")
    paths = artifacts.generate_artifacts(qdq, loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                         artifact_directory=tmp_path / "art", qat=True)
    state, module, losses = _train(paths, x, y, steps=12)
    assert losses[-1] < losses[0]
    masters = state.checkpoint.trainable_names()
    assert len(masters) == 3
    assert all(state.parameters[n].data.dtype == np.float32 for n in masters)
    module.export_model_for_inferencing(tmp_path / "engine.onnx")
    engine = InferenceSession(str(tmp_path / "engine.onnx")).run(None, {"x": x})[0]
    out = export_quantized(paths["eval_model"], state.checkpoint, tmp_path / "qat.onnx")
    assert sorted(n.op_type for n in out.graph.node) == sorted(n.op_type for n in qdq.graph.node), "the QDQ layout it came in"
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    original = {t.name: numpy_helper.to_array(t) for t in qdq.graph.initializer}
    for node in (n for n in out.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in original and original[n.input[0]].dtype != np.int32):
        q, s = inits[node.input[0]], inits[node.input[1]]
        zp = inits[node.input[2]]
        master = state.parameters[next(m for m in masters if node.input[0].startswith(m))].data
        t = torch.from_numpy(master)
        want = (torch.quantize_per_channel(t, torch.from_numpy(s).double(), torch.from_numpy(zp.astype(np.int64)), 0,
                                           torch.qint8 if dtype == "int8" else torch.quint8) if s.ndim
                else torch.quantize_per_tensor(t, float(s), int(zp), torch.qint8 if dtype == "int8" else torch.quint8)).int_repr().numpy()
        np.testing.assert_array_equal(q, want, f"{node.input[0]} re-quantized as torch quantizes")
        assert q.dtype == original[node.input[0]].dtype
        assert not np.array_equal(q, original[node.input[0]])
    theirs = _ort(tmp_path / "qat.onnx", x)
    np.testing.assert_allclose(theirs, engine, atol=2 * float(np.abs(engine).max()) * 1e-2)
    assert (theirs.argmax(1) == engine.argmax(1)).mean() >= 0.95


def test_frozen_quantized_base_with_lora_adapters(tmp_path):
    """QLoRA's shape: the int8 weights stay int8 and frozen, the adapters train beside them."""
    x, y = data("transformer", 32)
    qdq = quantize_static(export(make("transformer"), x[:2], folded=True), x, tmp_path, per_channel=True, dtype="int8")
    paths = artifacts.generate_artifacts(qdq, loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                         artifact_directory=tmp_path / "art", lora=LoraConfig(rank=2, alpha=4, targets=["MatMul", "Gemm"]))
    training = onnx.load(str(paths["training_model"]))
    int8 = [t.name for t in training.graph.initializer if t.data_type == TensorProto.INT8 and len(t.dims) == 2]
    assert len(int8) == 8, "every projection's weight stays int8 in the training model"
    state, module, losses = _train(paths, x, y, steps=12, lr=0.05)
    assert all(".lora_" in n for n in state.checkpoint.trainable_names())
    assert losses[-1] < losses[0]
    module.export_model_for_inferencing(tmp_path / "engine.onnx")
    engine = InferenceSession(str(tmp_path / "engine.onnx")).run(None, {"x": x})[0]
    export_adapter_base(paths["eval_model"], state.checkpoint, tmp_path / "base.onnx")
    export_adapter(paths["eval_model"], state.checkpoint, tmp_path / "a.onnx_adapter")
    adapter = ort.LoraAdapter()
    adapter.Load(str(tmp_path / "a.onnx_adapter"))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3  # the adapter inputs are overridable initializers: that is the point, no warning wanted
    run = ort.RunOptions()
    run.add_active_adapter(adapter)
    server = ort.InferenceSession(str(tmp_path / "base.onnx"), options, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(server.run(None, {"x": x}, run)[0], engine, atol=1e-2 * float(np.abs(engine).max()))
    np.testing.assert_allclose(server.run(None, {"x": x})[0], _ort(qdq, x), atol=1e-2 * float(np.abs(engine).max()))
    merged = export_merged(paths["eval_model"], state.checkpoint, tmp_path / "merged.onnx")
    assert sorted(n.op_type for n in merged.graph.node) == sorted(n.op_type for n in load_model(qdq).graph.node), "merged: the QDQ layout"
    assert (_ort(tmp_path / "merged.onnx", x).argmax(1) == engine.argmax(1)).mean() >= 0.9


def test_qat_on_a_float_model_is_a_typed_error(tmp_path):
    x, _ = data("cnn", 2)
    with pytest.raises(QuantizationError, match="no DequantizeLinear"):
        artifacts.generate_artifacts(export(make("cnn"), x), loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path, qat=True)


@pytest.mark.parametrize("dtype,per_channel", [("int8", True), ("uint8", False)])
def test_learned_scales_get_lsq_gradients_as_torch_learnable_fake_quant(dtype, per_channel, tmp_path):
    """qat="lsq": every scale trains, with the gradient of torch._fake_quantize_learnable_per_*_affine
    (round(x/s) - x/s inside the clip range, qmin - zp or qmax - zp outside); the zero points stay."""
    rng = np.random.default_rng(7 + per_channel)
    model, p = _qdq_mlp(dtype, per_channel, rng)
    paths = artifacts.generate_artifacts(model, requires_grad=["w1"], loss=artifacts.LossType.CrossEntropyLoss,
                                         artifact_directory=tmp_path, qat="lsq")
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    names = state.checkpoint.trainable_names()
    assert {"s_a", "s_w", "w1"} <= set(names)
    assert len(names) == 4
    (w2,) = [n for n in names if n.startswith("w2")]
    # off the grid (on it, round(x/s) - x/s is 0 and both sides compare rounding noise), some past the clip range
    master = state.parameters[w2].data + rng.uniform(-0.5, 0.5, (8, 4)).astype(np.float32) * np.asarray(p["s_w"])
    master[0, :] = (p["qmax"] + 3 - p["zp_w"].astype(np.float32)) * p["s_w"]
    state.parameters[w2].data = master
    module = Module(paths["training_model"], state, paths["eval_model"])
    x, y = rng.standard_normal((16, 6)).astype(np.float32), rng.integers(0, 4, 16)
    module.train()
    loss = module(x, y)
    w1, w2t = torch.tensor(p["w1"], requires_grad=True), torch.tensor(state.parameters[w2].data, requires_grad=True)
    s_a = torch.tensor([float(p["s_a"])], requires_grad=True)
    s_w = torch.tensor(np.atleast_1d(p["s_w"]).astype(np.float32), requires_grad=True)
    h = torch.from_numpy(x) @ w1
    h_fq = torch._fake_quantize_learnable_per_tensor_affine(h, s_a, torch.tensor([float(p["zp_a"])]), p["qmin"], p["qmax"], 1.0)
    zp_w = torch.from_numpy(np.atleast_1d(p["zp_w"]).astype(np.float32))
    w_fq = (torch._fake_quantize_learnable_per_channel_affine(w2t, s_w, zp_w, 1, p["qmin"], p["qmax"], 1.0) if per_channel
            else torch._fake_quantize_learnable_per_tensor_affine(w2t, s_w, zp_w, p["qmin"], p["qmax"], 1.0))
    want = torch.nn.functional.cross_entropy(h_fq @ w_fq, torch.from_numpy(y))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    for name, t in (("s_a", s_a), ("s_w", s_w), ("w1", w1), (w2, w2t)):
        got, want_grad = np.asarray(state.parameters[name].grad).reshape(t.grad.shape), t.grad.numpy()
        # a scale's gradient sums (q - zp) and -x/s terms separately: float32 rounding relative to their size
        np.testing.assert_allclose(got, want_grad, rtol=1e-3, atol=1e-4 * float(np.abs(want_grad).max()) + 1e-7, err_msg=name)
    assert abs(float(s_a.grad)) > 0
    assert np.abs(s_w.grad.numpy()).min() > 0


def test_learned_scales_are_what_the_requantized_export_uses(tmp_path):
    rng = np.random.default_rng(11)
    model, p = _qdq_mlp("int8", True, rng)
    paths = artifacts.generate_artifacts(model, requires_grad=["w1"], loss=artifacts.LossType.CrossEntropyLoss,
                                         artifact_directory=tmp_path, qat="lsq")
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    state.parameters["s_a"].data = np.asarray(state.parameters["s_a"].data * 1.3, np.float32)  # as if learned
    state.parameters["s_w"].data = np.asarray(state.parameters["s_w"].data * 0.8, np.float32)
    module = Module(paths["training_model"], state, paths["eval_model"])
    module.eval()
    module.export_model_for_inferencing(tmp_path / "engine.onnx")
    x = rng.standard_normal((16, 6)).astype(np.float32)
    engine = InferenceSession(str(tmp_path / "engine.onnx")).run(None, {"x": x})[0]
    out = export_quantized(paths["eval_model"], state.checkpoint, tmp_path / "lsq.onnx")
    assert sorted(n.op_type for n in out.graph.node) == sorted(n.op_type for n in model.graph.node)
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    np.testing.assert_array_equal(inits["s_w"], state.parameters["s_w"].data)
    np.testing.assert_allclose(_ort(tmp_path / "lsq.onnx", x), engine, rtol=1e-5, atol=1e-5)


def test_the_float32_stop_gradient_is_the_identity_bit_for_bit_on_every_exponent():
    """The STE's stop-gradient (odt_ops.quant.qat._Emitter.stop_gradient) in float32 ops returns its
    input exactly: subnormals, +-0 and every binade up to its documented 2**107 bound."""
    from odt_ops.ir.builder import unique_name
    from odt_ops.quant.qat import _Emitter

    graph = helper.make_graph([], "sg", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])])
    taken = {"x", "y"}
    e = _Emitter(graph, lambda hint: unique_name(hint, taken), "t")
    out = e.stop_gradient("x", "x")
    graph.node.extend([*e.nodes, helper.make_node("Identity", [out], ["y"], name="out")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    rng = np.random.default_rng(0)
    exponents = rng.integers(-149, 107, 20000)
    x = (rng.uniform(1, 2, exponents.size) * np.exp2(exponents.astype(np.float64)) * rng.choice([-1, 1], exponents.size)).astype(np.float32)
    x = np.concatenate([x, np.array([0.0, -0.0, 2.0 ** -149, -(2.0 ** -149), 2.0 ** -126, 1.5, 2.5, -0.5], np.float32)])
    y = InferenceSession(model).run(None, {"x": x})[0]
    np.testing.assert_array_equal(y.view(np.uint32)[np.abs(x) > 0], x.view(np.uint32)[np.abs(x) > 0])
    assert (y[x == 0] == 0).all()
