"""QDQ models made the usual way: onnxruntime.quantization's quantize_static (QDQ format,
per-tensor or per-channel, int8 or uint8), and a weight-only blocked int4 DequantizeLinear."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

quantization = pytest.importorskip("onnxruntime.quantization", reason="QDQ models come from onnxruntime.quantization")


class _Reader(quantization.CalibrationDataReader):
    def __init__(self, x: np.ndarray):
        self.batches = iter([{"x": x[i:i + 4]} for i in range(0, len(x), 4)])

    def get_next(self):
        return next(self.batches, None)


def quantize_static(proto: onnx.ModelProto, calibration: np.ndarray, tmp_path, *, per_channel: bool, dtype: str) -> onnx.ModelProto:
    kind = {"int8": quantization.QuantType.QInt8, "uint8": quantization.QuantType.QUInt8}[dtype]
    src, dst = tmp_path / "float.onnx", tmp_path / f"qdq_{dtype}_{per_channel}.onnx"
    onnx.save(proto, src)
    quantization.quantize_static(str(src), str(dst), _Reader(calibration), quant_format=quantization.QuantFormat.QDQ,
                                 per_channel=per_channel, activation_type=kind, weight_type=kind)
    return onnx.load(str(dst))


def int4_weight_only(w: np.ndarray, block_size: int = 4, classes: int = 4) -> tuple[onnx.ModelProto, np.ndarray]:
    """x[N, in] @ DequantizeLinear(w_int4[in, out], scale[in / block, out], block_size along axis 0) -> logits."""
    n_in, n_out = w.shape
    blocks = w.reshape(n_in // block_size, block_size, n_out)
    scale = (np.abs(blocks).max(axis=1) / 7).astype(np.float32)
    q = np.clip(np.rint(w / np.repeat(scale, block_size, axis=0)), -8, 7).astype(np.int8)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"], axis=0, block_size=block_size, name="dq_w"),
         helper.make_node("MatMul", ["x", "w"], ["logits"], name="fc")],
        "int4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", n_out])],
        [helper.make_tensor("w_q", TensorProto.INT4, [n_in, n_out], q.flatten().tolist()), numpy_helper.from_array(scale, "w_scale")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model, scale


def train_cycling(paths: dict, x: np.ndarray, y: np.ndarray, *, steps: int, lr: float, batch: int):
    """``steps`` AdamW steps of the artifacts in ``paths`` over ``x``'s batches of ``batch`` rows in
    turn; the state, the module (left in eval mode) and each step's loss."""
    from odt_ops.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    module = Module(paths["training_model"], state, paths["eval_model"])
    opt = Optimizer(paths["optimizer_model"], module)
    opt.set_learning_rate(lr)
    module.train()
    losses = []
    for i in range(steps):
        rows = slice(i % (len(x) // batch) * batch, (i % (len(x) // batch) + 1) * batch)
        module.lazy_reset_grad()
        losses.append(float(module(x[rows], y[rows])))
        opt.step()
    module.eval()
    return state, module, losses
