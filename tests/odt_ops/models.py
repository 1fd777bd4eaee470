"""Small forward models built with onnx.helper, shared by the engine's tests."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _model(nodes, inputs, outputs, inits, opset: int = 21) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "model", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def mlp(sizes=(784, 32, 10), seed: int = 0, dropout: float = 0.0, dtype=np.float32) -> onnx.ModelProto:
    """Gemm layers with ReLU between (names fc{i}.weight / fc{i}.bias), input 'input', output 'output'."""
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, inits, x = [], [], "input"
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        w, b = f"fc{i}.weight", f"fc{i}.bias"
        inits += [numpy_helper.from_array((rng.standard_normal((fan_out, fan_in)) * np.sqrt(2 / fan_in)).astype(dtype), w),
                  numpy_helper.from_array((rng.standard_normal(fan_out) * 0.1).astype(dtype), b)]
        y = "output" if i == len(sizes) - 2 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [x, w, b], [y if i == len(sizes) - 2 else f"z{i}"], transB=1, name=f"fc{i}"))
        if i < len(sizes) - 2:
            nodes.append(helper.make_node("Relu", [f"z{i}"], [y], name=f"relu{i}"))
            if dropout:
                ratio = numpy_helper.from_array(np.array(dropout, dtype=dtype), f"drop{i}.ratio")
                inits.append(ratio)
                nodes.append(helper.make_node("Dropout", [y, f"drop{i}.ratio"], [f"d{i}"], name=f"dropout{i}"))
                y = f"d{i}"
        x = y
    return _model(nodes, [helper.make_tensor_value_info("input", elem, ["batch", sizes[0]])],
                  [helper.make_tensor_value_info("output", elem, ["batch", sizes[-1]])], inits)


def cnn(seed: int = 0, batchnorm: bool = True) -> onnx.ModelProto:
    """Conv 8 3x3 pad 1, [BatchNormalization], Relu, MaxPool 2, Conv 16 3x3 pad 1, Relu, MaxPool 2, Flatten, Gemm 10 on 1x28x28."""
    rng = np.random.default_rng(seed)

    def he(*shape):
        return (rng.standard_normal(shape) * np.sqrt(2 / np.prod(shape[1:]))).astype(np.float32)

    inits = [numpy_helper.from_array(he(8, 1, 3, 3), "conv1.weight"), numpy_helper.from_array(np.zeros(8, np.float32), "conv1.bias"),
             numpy_helper.from_array(he(16, 8, 3, 3), "conv2.weight"), numpy_helper.from_array(np.zeros(16, np.float32), "conv2.bias"),
             numpy_helper.from_array(he(10, 16 * 7 * 7), "fc.weight"), numpy_helper.from_array(np.zeros(10, np.float32), "fc.bias")]
    nodes = [helper.make_node("Conv", ["input", "conv1.weight", "conv1.bias"], ["c1"], pads=[1, 1, 1, 1], name="conv1")]
    x = "c1"
    if batchnorm:
        inits += [numpy_helper.from_array(np.ones(8, np.float32), "bn1.weight"), numpy_helper.from_array(np.zeros(8, np.float32), "bn1.bias"),
                  numpy_helper.from_array(np.zeros(8, np.float32), "bn1.running_mean"), numpy_helper.from_array(np.ones(8, np.float32), "bn1.running_var")]
        nodes.append(helper.make_node("BatchNormalization", ["c1", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var"], ["b1"], name="bn1"))
        x = "b1"
    nodes += [
        helper.make_node("Relu", [x], ["r1"], name="relu1"),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
        helper.make_node("Conv", ["p1", "conv2.weight", "conv2.bias"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[2, 2], strides=[2, 2], name="pool2"),
        helper.make_node("Flatten", ["p2"], ["f"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["output"], transB=1, name="fc"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 28, 28])],
                  [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 10])], inits)


def classification_data(n: int, features: int = 784, classes: int = 10, seed: int = 0):
    """Linearly separable-ish random data: class centroids plus noise."""
    rng = np.random.default_rng(seed)
    centroids = rng.standard_normal((classes, features)).astype(np.float32)
    y = rng.integers(0, classes, n)
    x = centroids[y] + 0.5 * rng.standard_normal((n, features)).astype(np.float32)
    return x.astype(np.float32), y.astype(np.int64)
