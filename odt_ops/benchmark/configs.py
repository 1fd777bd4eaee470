"""The benchmark's configurations: one layer list per model, from which both the forward
ONNX model (for odt and ONNX Runtime) and the torch.nn model are built, with the same
initial weights, so every peer trains the same function on the same data.

A zoo configuration takes one of the networks the onnx wheel ships instead (normalized
by odt_ops, seeded weights, logits instead of the final Softmax, any batch); PyTorch
then runs the same ONNX graph node by node with torch.nn.functional.

A torch configuration names a network defined in torch.nn (workers/torch_graph.py,
NETWORKS): seeded, exported as a user would for on-device training (the TorchScript
exporter, training mode, no constant folding, a dynamic batch axis); odt and ONNX Runtime
train that export, PyTorch the network itself with the exported weights. Preparing one
needs torch in the driver's environment.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# ONNX Runtime training 1.19.2 reads opset 21 and IR version 10 (onnx 1.17's newest)
OPSET = 21
IR_VERSION = 10
TORCH_EXPORT_OPSET = 17  # a torch configuration's export (the TorchScript exporter's usual opset)


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
    zoo: str | None = None  # one of the onnx wheel's light zoo models, instead of layers
    batches: tuple[int, ...] | None = None  # its own batches, used unless --batches is given
    torch: str | None = None  # a network of workers/torch_graph.py's NETWORKS, instead of layers

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
    Config("resnet50", "ResNet-50 (the onnx wheel's zoo model, seeded weights) on 3x224x224, AdamW", (), (3, 224, 224),
           "AdamW", 1e-3, classes=1000, zoo="resnet50", batches=(4,), default=False),
    Config("lstm-adamw", "nn.LSTM(16, 64) over 20 steps, last state to 10 classes (torch-defined, exported), AdamW", (),
           (20, 16), "AdamW", 1e-3, torch="lstm", batches=(16, 64), default=False),
    Config("mobilenetv3-adamw", "MobileNetV3-small-like (depthwise, SE, HardSwish, BatchNorm) on 3x32x32 "
           "(torch-defined, exported), AdamW", (), (3, 32, 32), "AdamW", 1e-3, torch="mobilenetv3", batches=(8, 32),
           default=False),
    Config("efficientnet-adamw", "EfficientNet-B0-like, five MBConv blocks (depthwise, SiLU, Sigmoid-gated SE, "
           "BatchNorm) on 3x32x32 (torch-defined, exported), AdamW", (), (3, 32, 32), "AdamW", 1e-3, torch="efficientnet",
           batches=(8, 32), default=False),
    Config("unet-adamw", "small UNet (MaxPool, ConvTranspose, bilinear Resize, GroupNorm, skips) on 1x32x32, "
           "averaged into 10 classes (torch-defined, exported), AdamW", (), (1, 32, 32), "AdamW", 1e-3, torch="unet",
           batches=(8, 32), default=False),
    Config("transformer-adamw", "2 x nn.TransformerEncoderLayer(64, 4 heads, ff 128) over 16 frames of 32 features "
           "(torch-defined, exported), AdamW", (), (16, 32), "AdamW", 1e-3, torch="transformer", batches=(16, 64),
           default=False),
)}


def parameter_names(config: Config, model: onnx.ModelProto | None = None) -> list[str]:
    """Every trainable or frozen parameter: float initializers, less BatchNormalization statistics."""
    if config.zoo is None and config.torch is None:
        return [f"{layer['name']}.{p}" for layer in config.layers if "name" in layer for p in ("weight", "bias")]
    model = forward_model(config) if model is None else model
    stats = {n.input[i] for n in model.graph.node if n.op_type == "BatchNormalization" for i in (3, 4)}
    return [t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and t.name not in stats]


def trainable(config: Config, model: onnx.ModelProto | None = None) -> list[str]:
    return [n for n in parameter_names(config, model) if n not in config.frozen]


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
    if config.zoo is not None:
        return zoo_model(config)
    if config.torch is not None:
        return torch_model(config)
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


def zoo_model(config: Config) -> onnx.ModelProto:
    """The zoo network normalized by odt_ops (opset 21, weights folded into initializers),
    re-initialized with seeded weights (the shipped ones are one constant each), ending
    in logits (its final Softmax removed: the loss applies its own), for any batch size
    (its Reshape to [1, N] becomes Flatten); two-input Sum is written as Add and an
    AveragePool over the whole map as GlobalAveragePool, the same function in ops whose
    gradients ORT training 1.19.2 has and survives."""
    from pathlib import Path

    from odt_ops.ir.load import load_model

    path = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{config.zoo}.onnx"
    model = onnx.ModelProto()
    model.CopyFrom(load_model(str(path)).proto)
    graph = model.graph
    last = graph.node[-1]
    if last.op_type == "Softmax" and list(last.output) == [graph.output[0].name]:
        graph.node.remove(last)
        graph.output[0].name = last.input[0]
    del graph.value_info[:]  # inferred for batch 1
    inferred = onnx.shape_inference.infer_shapes(model).graph.value_info
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred}
    for i, node in enumerate(graph.node):  # each rewrite keeps the function
        if node.op_type == "Sum" and len(node.input) == 2:  # ORT training has no gradient for Sum
            node.op_type = "Add"
        elif node.op_type == "Reshape" and _is_batch1_flatten(graph, node):  # Flatten keeps any batch
            graph.node[i].CopyFrom(helper.make_node("Flatten", node.input[:1], node.output, axis=1, name=node.name))
        elif (node.op_type == "AveragePool" and shapes.get(node.input[0], [])[2:] == _ints(node, "kernel_shape")
              and not any(_ints(node, "pads"))):  # over the whole map (ORT training 1.19.2 crashes in its gradient)
            graph.node[i].CopyFrom(helper.make_node("GlobalAveragePool", node.input, node.output, name=node.name))
    graph.output[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    used = {name for n in graph.node for name in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    roles = _weight_roles(graph)
    rng = np.random.default_rng(config.seed)
    for t in graph.initializer:
        array = numpy_helper.to_array(t)
        if array.dtype == np.float32:
            t.CopyFrom(numpy_helper.from_array(_seeded(rng, array.shape, roles.get(t.name, "positive")), t.name))
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    return model


def torch_model(config: Config) -> onnx.ModelProto:
    """The torch configuration's network, seeded, exported as ONNX Runtime's training docs
    export (TrainingMode.TRAINING, do_constant_folding=False: every parameter and BatchNorm
    statistic stays an initializer under its state_dict name), batch axis dynamic."""
    import io
    import warnings

    import torch

    from odt_ops.benchmark.workers.torch_graph import torch_network

    torch.manual_seed(config.seed)
    module = torch_network(config.torch)
    x = torch.randn(2, *config.input_shape)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), buffer, dynamo=False, opset_version=TORCH_EXPORT_OPSET, input_names=["input"],
                          output_names=["output"], dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    model = onnx.load_from_string(buffer.getvalue())
    model.graph.name = config.name
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    state = {k: tuple(v.shape) for k, v in module.state_dict().items() if v.is_floating_point()}
    wrong = sorted(k for k, shape in state.items() if shapes.get(k) != shape)
    if wrong:  # the torch worker loads the initializers as the network's state_dict
        raise ValueError(f"config {config.name}: the export does not keep {wrong} as initializers of their shape")
    onnx.checker.check_model(model, full_check=True)
    return model


def _is_batch1_flatten(graph: onnx.GraphProto, node: onnx.NodeProto) -> bool:
    shape = next((numpy_helper.to_array(t) for t in graph.initializer if t.name == node.input[1]), None)
    return shape is not None and shape.shape == (2,) and shape[0] == 1


def _ints(node: onnx.NodeProto, name: str) -> list[int]:
    return next((list(a.ints) for a in node.attribute if a.name == name), [])


def _weight_roles(graph: onnx.GraphProto) -> dict[str, str]:
    roles = {}
    for node in graph.node:
        if node.op_type in ("Conv", "Gemm") and len(node.input) > 1:
            roles[node.input[1]] = "weight"
            if len(node.input) > 2:
                roles[node.input[2]] = "shift"
        elif node.op_type == "BatchNormalization":
            roles.update({node.input[1]: "positive", node.input[2]: "shift", node.input[3]: "shift", node.input[4]: "positive"})
    return roles


def _seeded(rng: np.random.Generator, shape, role: str) -> np.ndarray:
    """He-normal weights (fan-in: every axis but the first), small shifts, scales and variances near 1."""
    if role == "weight":
        return (rng.standard_normal(shape) * np.sqrt(2 / np.prod(shape[1:]))).astype(np.float32)
    if role == "shift":
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)
    return rng.uniform(0.5, 1.5, shape).astype(np.float32)


def resolve(names: list[str] | None) -> list[Config]:
    if not names:
        return [c for c in CONFIGS.values() if c.default]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {sorted(CONFIGS)}")
    return [CONFIGS[n] for n in names]
