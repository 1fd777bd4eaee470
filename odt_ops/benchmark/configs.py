"""The benchmark's configurations: one layer list per model, from which both the forward
ONNX model (for odt and ONNX Runtime) and the torch.nn model are built, with the same
initial weights, so every peer trains the same function on the same data.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# ONNX Runtime training 1.19.2 reads opset 21 and IR version 10 (onnx 1.17's newest)
OPSET = 21
IR_VERSION = 10


@dataclass(frozen=True)
class Config:
    name: str
    description: str
    layers: tuple[dict, ...]  # {"op": "linear"|"conv"|"relu"|"maxpool"|"flatten", ...}
    input_shape: tuple[int, ...]  # one sample, without the batch dimension
    optimizer: str  # "AdamW" (onnxruntime's defaults: eps 1e-6, no weight decay) or "SGD" (plain)
    lr: float
    frozen: tuple[str, ...] = ()  # parameter names kept fixed; every other one is trained
    classes: int = 10
    seed: int = 0
    default: bool = True  # part of the default run

    def to_json(self) -> dict:
        return asdict(self)


def linear(name: str, fan_in: int, fan_out: int) -> dict:
    return {"op": "linear", "name": name, "in": fan_in, "out": fan_out}


def conv(name: str, c_in: int, c_out: int, k: int = 3, pad: int = 1) -> dict:
    return {"op": "conv", "name": name, "in": c_in, "out": c_out, "k": k, "pad": pad}


RELU, FLATTEN = {"op": "relu"}, {"op": "flatten"}
POOL2 = {"op": "maxpool", "k": 2}

_MLP = (linear("fc0", 784, 128), RELU, linear("fc1", 128, 10))
_CNN = (conv("conv1", 1, 8), RELU, POOL2, conv("conv2", 8, 16), RELU, POOL2, FLATTEN, linear("fc", 16 * 7 * 7, 10))
_PERSONAL = (linear("fc0", 784, 256), RELU, linear("fc1", 256, 128), RELU, linear("head", 128, 10))

CONFIGS: dict[str, Config] = {c.name: c for c in (
    Config("mlp-adamw", "MLP 784-128-10, AdamW", _MLP, (784,), "AdamW", 1e-3),
    Config("mlp-sgd", "MLP 784-128-10, SGD", _MLP, (784,), "SGD", 1e-2),
    Config("cnn-adamw", "CNN conv8-pool-conv16-pool-fc10 on 1x28x28, AdamW", _CNN, (1, 28, 28), "AdamW", 1e-3),
    Config("personal-adamw", "784-256-128 frozen (ReLU), Gemm 10 head trained, AdamW", _PERSONAL, (784,), "AdamW", 1e-3,
           frozen=("fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias")),
)}


def parameter_names(config: Config) -> list[str]:
    return [f"{layer['name']}.{p}" for layer in config.layers if "name" in layer for p in ("weight", "bias")]


def trainable(config: Config) -> list[str]:
    return [n for n in parameter_names(config) if n not in config.frozen]


def initial_weights(config: Config) -> dict[str, np.ndarray]:
    """He-initialized weights, small random biases, seeded: the same for every peer."""
    rng = np.random.default_rng(config.seed)
    weights = {}
    for layer in config.layers:
        if layer["op"] == "linear":
            shape = (layer["out"], layer["in"])
        elif layer["op"] == "conv":
            shape = (layer["out"], layer["in"], layer["k"], layer["k"])
        else:
            continue
        fan_in = int(np.prod(shape[1:]))
        weights[f"{layer['name']}.weight"] = (rng.standard_normal(shape) * np.sqrt(2 / fan_in)).astype(np.float32)
        weights[f"{layer['name']}.bias"] = (rng.standard_normal(shape[0]) * 0.01).astype(np.float32)
    return weights


def forward_model(config: Config, weights: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """The forward-only ONNX model ('input' -> 'output' logits), as a user would export it."""
    weights = initial_weights(config) if weights is None else weights
    nodes, x = [], "input"
    for i, layer in enumerate(config.layers):
        y = "output" if i == len(config.layers) - 1 else f"t{i}"
        op, name = layer["op"], layer.get("name", f"{layer['op']}{i}")
        if op == "linear":
            nodes.append(helper.make_node("Gemm", [x, f"{name}.weight", f"{name}.bias"], [y], transB=1, name=name))
        elif op == "conv":
            pads = [layer["pad"]] * 4
            nodes.append(helper.make_node("Conv", [x, f"{name}.weight", f"{name}.bias"], [y], pads=pads,
                                          kernel_shape=[layer["k"]] * 2, name=name))
        elif op == "relu":
            nodes.append(helper.make_node("Relu", [x], [y], name=name))
        elif op == "maxpool":
            k = [layer["k"]] * 2
            nodes.append(helper.make_node("MaxPool", [x], [y], kernel_shape=k, strides=k, name=name))
        elif op == "flatten":
            nodes.append(helper.make_node("Flatten", [x], [y], axis=1, name=name))
        else:
            raise ValueError(f"config {config.name}: unknown layer op {op!r}")
        x = y
    inits = [numpy_helper.from_array(weights[n], n) for n in parameter_names(config)]
    graph = helper.make_graph(
        nodes, config.name,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", *config.input_shape])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", config.classes])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION,
                              producer_name="odt_ops.benchmark")
    onnx.checker.check_model(model, full_check=True)
    return model


def resolve(names: list[str] | None) -> list[Config]:
    if not names:
        return [c for c in CONFIGS.values() if c.default]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {sorted(CONFIGS)}")
    return [CONFIGS[n] for n in names]
