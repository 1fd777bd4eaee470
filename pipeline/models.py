"""Built-in architectures as forward-only ONNX graphs (onnx.helper), for the convert stage.

Both take ``input`` float32 [batch, *input_shape] and return ``logits`` [batch,
num_classes], at opset 21 with a symbolic batch dimension. Parameters are named like
PyTorch's (``fc1.weight`` [out, in] with Gemm transB=1, ``conv1.weight`` [out, in, k, k]),
the last layer is always ``head``. Weights are He-normal (LeCun-normal for the head),
biases zero, drawn from ``np.random.default_rng(seed)``.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 21
IR_VERSION = 10
INPUT = "input"
OUTPUT = "logits"


class _Graph:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def param(self, name: str, shape: tuple[int, ...], fan_in: int, gain: float) -> str:
        w = self.rng.standard_normal(shape) * math.sqrt(gain / fan_in)
        self.inits.append(numpy_helper.from_array(w.astype(np.float32), name))
        return name

    def zeros(self, name: str, shape: tuple[int, ...]) -> str:
        self.inits.append(numpy_helper.from_array(np.zeros(shape, np.float32), name))
        return name

    def node(self, op: str, inputs: list[str], name: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [name], name=name, **attrs))
        return name

    def dense(self, x: str, name: str, n_in: int, n_out: int, *, relu: bool, out: str | None = None) -> str:
        w = self.param(f"{name}.weight", (n_out, n_in), n_in, 2.0 if relu else 1.0)
        b = self.zeros(f"{name}.bias", (n_out,))
        y = self.node("Gemm", [x, w, b], out or name, transB=1)
        return self.node("Relu", [y], f"{name}.relu") if relu else y

    def model(self, input_shape: list[int], num_classes: int, doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            "odt_builtin",
            [helper.make_tensor_value_info(INPUT, TensorProto.FLOAT, ["batch", *input_shape])],
            [helper.make_tensor_value_info(OUTPUT, TensorProto.FLOAT, ["batch", num_classes])],
            initializer=self.inits,
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION, producer_name="odt.pipeline", doc_string=doc
        )
        onnx.checker.check_model(model, full_check=True)
        return model


def mlp(input_shape: list[int], num_classes: int, hidden: list[int], seed: int) -> onnx.ModelProto:
    """Flatten -> [Gemm -> Relu] per hidden width -> Gemm (head)."""
    g = _Graph(seed)
    x = g.node("Flatten", [INPUT], "flatten", axis=1)
    width = math.prod(input_shape)
    for i, h in enumerate(hidden, start=1):
        x = g.dense(x, f"fc{i}", width, h, relu=True)
        width = h
    g.dense(x, "head", width, num_classes, relu=False, out=OUTPUT)
    return g.model(list(input_shape), num_classes, f"MLP {list(input_shape)} -> {list(hidden)} -> {num_classes}")


def cnn(input_shape: list[int], num_classes: int, channels: list[int], kernel_size: int, hidden: list[int], seed: int) -> onnx.ModelProto:
    """[Conv kxk (same padding) -> Relu -> MaxPool 2x2] per channel count, then the MLP part."""
    if len(input_shape) != 3:
        raise ValueError(f"a CNN needs data.input_shape [channels, height, width], got {list(input_shape)}")
    g = _Graph(seed)
    c, h, w = input_shape
    x = INPUT
    pad = kernel_size // 2
    for i, out_c in enumerate(channels, start=1):
        fan_in = c * kernel_size * kernel_size
        wt = g.param(f"conv{i}.weight", (out_c, c, kernel_size, kernel_size), fan_in, 2.0)
        b = g.zeros(f"conv{i}.bias", (out_c,))
        x = g.node("Conv", [x, wt, b], f"conv{i}", kernel_shape=[kernel_size, kernel_size], pads=[pad] * 4)
        x = g.node("Relu", [x], f"conv{i}.relu")
        if h >= 2 and w >= 2:
            x = g.node("MaxPool", [x], f"pool{i}", kernel_shape=[2, 2], strides=[2, 2])
            h, w = h // 2, w // 2
        c = out_c
    x = g.node("Flatten", [x], "flatten", axis=1)
    width = c * h * w
    for i, n in enumerate(hidden, start=1):
        x = g.dense(x, f"fc{i}", width, n, relu=True)
        width = n
    g.dense(x, "head", width, num_classes, relu=False, out=OUTPUT)
    return g.model(
        list(input_shape), num_classes, f"CNN {list(input_shape)} -> conv {list(channels)} k{kernel_size} -> {list(hidden)} -> {num_classes}"
    )
