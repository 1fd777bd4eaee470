"""Models from onnxruntime.quantization.quantize_dynamic (DynamicQuantizeLinear -> MatMulInteger /
ConvInteger -> Cast -> Mul) load as their QDQ equivalent and fine-tune in both modes.

Oracles: onnxruntime running the quantize_dynamic model as written (our forward), torch's
fake quantization with DynamicQuantizeLinear's batch statistics (QAT loss and straight-through
gradients), torch.quantize_per_channel (the re-quantized weights) and onnxruntime again for the
exported models and onnxruntime's own LoRA adapter file.
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
from tests.lora.quantized_models import train_cycling
from tests.lora.torch_models import data, export, make, nn, torch

ort = pytest.importorskip("onnxruntime", reason="the quantize_dynamic models' oracle is onnxruntime")
quantization = pytest.importorskip("onnxruntime.quantization", reason="quantize_dynamic models come from onnxruntime.quantization")


def _quantize_dynamic(proto: onnx.ModelProto, tmp_path, *, per_channel: bool) -> str:
    src, dst = tmp_path / "float.onnx", tmp_path / f"dynamic_{per_channel}.onnx"
    onnx.save(proto, src)
    quantization.quantize_dynamic(str(src), str(dst), per_channel=per_channel)
    assert {"MatMulInteger", "DynamicQuantizeLinear"} <= {n.op_type for n in onnx.load(str(dst)).graph.node}
    return str(dst)


def _ort(path, x):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _train(paths, x, y, steps, lr):
    return train_cycling(paths, x, y, steps=steps, lr=lr, batch=16)


@pytest.mark.parametrize("kind,per_channel", [("cnn", False), ("transformer", True)])
def test_forward_equals_onnxruntime_running_the_quantize_dynamic_model(kind, per_channel, tmp_path):
    x, _ = data(kind, 16)
    path = _quantize_dynamic(export(make(kind), x[:2], folded=True), tmp_path, per_channel=per_channel)
    loaded = load_model(path)
    assert not {"MatMulInteger", "ConvInteger"} & {n.op_type for n in loaded.graph.node}, "rewritten into DequantizeLinear + MatMul/Conv"
    theirs = _ort(path, x)
    # the integer sums are exact in onnxruntime, ours sum dequantized float32 values: float32 rounding apart
    np.testing.assert_allclose(InferenceSession(path).run(None, {"x": x})[0], theirs, rtol=1e-5, atol=1e-5 * float(np.abs(theirs).max()))


class _Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _dynamic_fake_quant(t):
    """DynamicQuantizeLinear's statistics (the spec's function body), then torch's fake quantization,
    its observer's statistics being constants to the gradient as in torch's QAT."""
    lo, hi = torch.clamp(t.detach().min(), max=0.0), torch.clamp(t.detach().max(), min=0.0)
    scale = (hi - lo) / 255.0
    zero_point = torch.round(torch.clamp(-lo / scale, 0.0, 255.0))
    return torch.fake_quantize_per_tensor_affine(t, float(scale), int(zero_point), 0, 255)


def test_qat_loss_and_straight_through_gradients_equal_torch_fake_quant_with_batch_statistics(tmp_path):
    torch.manual_seed(3)
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((16, 6)).astype(np.float32), rng.integers(0, 4, 16)
    path = _quantize_dynamic(export(_Mlp(), x[:2], folded=True), tmp_path, per_channel=True)
    source = onnx.load(path)
    inits = {t.name: numpy_helper.to_array(t) for t in source.graph.initializer}
    integer = [n for n in source.graph.node if n.op_type == "MatMulInteger"]
    biases = sorted(n for n in inits if n.endswith(".bias"))  # fc1's, fc2's
    paths = artifacts.generate_artifacts(path, requires_grad=biases, loss=artifacts.LossType.CrossEntropyLoss,
                                         artifact_directory=tmp_path / "art", qat=True)
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    masters = state.checkpoint.trainable_names()[:2]
    assert masters == [n.input[1].removesuffix("_quantized") for n in integer], "a float master copy of each quantized weight, in order"
    weights = []
    for name, node in zip(masters, integer, strict=True):
        q, s, zp = inits[node.input[1]], inits[node.input[1].removesuffix("_quantized") + "_scale"], inits[node.input[3]]
        assert s.shape == (q.shape[1],), "per-channel: one scale per output column"
        np.testing.assert_array_equal(state.parameters[name].data, (q.astype(np.float32) - zp.astype(np.float32)) * s)
        master = state.parameters[name].data + rng.uniform(-0.6, 0.6, q.shape).astype(np.float32) * s  # off the int8 grid
        master[0] = (130 - zp.astype(np.float32)) * s  # past int8's 127: the STE's zero region
        state.parameters[name].data = master
        weights.append((torch.tensor(master, requires_grad=True), torch.from_numpy(s), torch.from_numpy(zp.astype(np.int32))))
    module = Module(paths["training_model"], state, paths["eval_model"])
    module.train()
    loss = module(x, y)

    b1, b2 = (torch.tensor(inits[b], requires_grad=True) for b in biases)
    (w1, s1, z1), (w2, s2, z2) = weights
    h = torch.relu(_dynamic_fake_quant(torch.from_numpy(x)) @ torch.fake_quantize_per_channel_affine(w1, s1, z1, 1, -128, 127) + b1)
    logits = _dynamic_fake_quant(h) @ torch.fake_quantize_per_channel_affine(w2, s2, z2, 1, -128, 127) + b2
    want = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    for name, t in ((masters[0], w1), (masters[1], w2), (biases[0], b1), (biases[1], b2)):
        np.testing.assert_allclose(state.parameters[name].grad, t.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    assert (state.parameters[masters[1]].grad[0] == 0).all(), "clipped weights get no gradient"
    assert np.abs(state.parameters[masters[0]].grad).max() > 0, "the hidden activation's STE passes the gradient back to fc1"


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # torch's quantized tensors are the oracle, deprecated or not
def test_qat_fine_tunes_and_exports_weights_requantized_as_torch_quantizes_and_onnxruntime_runs(tmp_path):
    x, y = data("transformer", 32)
    path = _quantize_dynamic(export(make("transformer"), x[:2], folded=True), tmp_path, per_channel=True)
    paths = artifacts.generate_artifacts(path, loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                         artifact_directory=tmp_path / "art", qat=True)
    state, module, losses = _train(paths, x, y, steps=8, lr=0.01)
    assert losses[-1] < losses[0]
    module.export_model_for_inferencing(tmp_path / "engine.onnx")
    engine = InferenceSession(str(tmp_path / "engine.onnx")).run(None, {"x": x})[0]
    out = export_quantized(paths["eval_model"], state.checkpoint, tmp_path / "qat.onnx")
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    requantized = [n for n in out.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    assert len(requantized) == 8, "every projection's weight is stored int8 again"
    for node in requantized:
        q, s, zp = (inits[i] for i in node.input)
        master = state.parameters[node.input[0].removesuffix("_quantized")].data
        want = torch.quantize_per_channel(torch.from_numpy(master), torch.from_numpy(s).double(), torch.from_numpy(zp.astype(np.int64)),
                                          1, torch.qint8).int_repr().numpy()
        np.testing.assert_array_equal(q, want, node.input[0])
    assert not [n.name for n in out.graph.node if "/ste_" in n.name], "no straight-through node is left"
    np.testing.assert_allclose(_ort(tmp_path / "qat.onnx", x), engine, rtol=1e-5, atol=1e-5 * float(np.abs(engine).max()))


def test_frozen_quantize_dynamic_base_with_lora_adapters_merged_and_as_onnxruntime_adapter(tmp_path):
    x, y = data("cnn", 32)
    path = _quantize_dynamic(export(make("cnn"), x[:2], folded=True), tmp_path, per_channel=False)
    paths = artifacts.generate_artifacts(path, loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                         artifact_directory=tmp_path / "art", lora=LoraConfig(rank=2, alpha=4, targets=["MatMul", "Conv"]))
    training = onnx.load(str(paths["training_model"]))
    assert len([t for t in training.graph.initializer if t.data_type == TensorProto.INT8 and len(t.dims) >= 2]) == 3, "weights stay int8"
    state, module, losses = _train(paths, x, y, steps=10, lr=0.01)  # small steps: the merged weights stay in their int8 range
    assert all(".lora_" in n for n in state.checkpoint.trainable_names())
    assert len(state.checkpoint.trainable_names()) == 6
    assert losses[-1] < losses[0]
    module.export_model_for_inferencing(tmp_path / "engine.onnx")
    engine = InferenceSession(str(tmp_path / "engine.onnx")).run(None, {"x": x})[0]
    export_merged(paths["eval_model"], state.checkpoint, tmp_path / "merged.onnx")
    merged, base = _ort(tmp_path / "merged.onnx", x), _ort(path, x)
    # merged weights are re-quantized to int8 with their own scale (up to half a step each): near the engine, not equal
    assert np.abs(merged - engine).max() < 0.25 * np.abs(base - engine).max(), "the merge carries the adapters' change"
    assert (merged.argmax(1) == engine.argmax(1)).mean() >= 0.9
    export_adapter_base(paths["eval_model"], state.checkpoint, tmp_path / "base.onnx")
    export_adapter(paths["eval_model"], state.checkpoint, tmp_path / "a.onnx_adapter")
    adapter = ort.LoraAdapter()
    adapter.Load(str(tmp_path / "a.onnx_adapter"))
    run = ort.RunOptions()
    run.add_active_adapter(adapter)
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the adapter inputs are overridable initializers: that is the point
    server = ort.InferenceSession(str(tmp_path / "base.onnx"), options, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(server.run(None, {"x": x}, run)[0], engine, rtol=1e-4, atol=1e-5 * float(np.abs(engine).max()))
    np.testing.assert_allclose(server.run(None, {"x": x})[0], base, rtol=1e-4, atol=1e-5 * float(np.abs(engine).max()))


def test_an_integer_op_outside_quantize_dynamics_pattern_is_a_typed_error_naming_it():
    """MatMulInteger whose int32 output is the model's output (no Cast, no scales): nothing to rewrite into."""
    graph = helper.make_graph(
        [helper.make_node("DynamicQuantizeLinear", ["x"], ["x_q", "x_s", "x_zp"], name="dql"),
         helper.make_node("MatMulInteger", ["x_q", "w_q", "x_zp"], ["y"], name="mmi")],
        "integer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["batch", 2])],
        [numpy_helper.from_array(np.ones((3, 2), np.uint8), "w_q")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    with pytest.raises(QuantizationError, match="MatMulInteger node 'mmi'.*not quantize_dynamic's pattern"):
        load_model(model)
