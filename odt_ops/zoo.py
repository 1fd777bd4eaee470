"""The model-zoo networks the onnx wheel ships (its backend test data, opset 9), for ``odt demo``
and the tests: their weights are made by ConstantOfShape, all one constant, so every output is
uniform and a comparison on them can hardly fail; ``randomize_weights`` gives them seeded weights
of a sensible scale, which make it able to."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ZOO_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def zoo_models() -> list[str]:
    """The names ``zoo_path`` takes (squeezenet, resnet50, ...)."""
    return sorted(p.stem.removeprefix("light_") for p in ZOO_DIR.glob("light_*.onnx"))


def zoo_path(name: str) -> Path:
    return ZOO_DIR / f"light_{name}.onnx"


def randomize_weights(proto: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """``proto`` (a normalized model: its weights are initializers) with seeded weights of a
    sensible scale: He-normal Conv/Gemm weights, positive BatchNormalization scales and
    variances, small biases and shifts."""
    rng = np.random.default_rng(seed)
    roles: dict[str, str] = {}
    for node in proto.graph.node:
        if node.op_type in ("Conv", "Gemm", "MatMul", "ConvTranspose") and len(node.input) > 1:
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            roles[node.input[1]] = "conv_weight" if node.op_type.startswith("Conv") else ("gemm_weight_t" if trans_b else "gemm_weight")
            if len(node.input) > 2:
                roles[node.input[2]] = "shift"
        if node.op_type == "BatchNormalization":
            roles[node.input[1]] = "positive"
            roles[node.input[2]] = "shift"
            roles[node.input[3]] = "shift"
            roles[node.input[4]] = "positive"
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for tensor in out.graph.initializer:
        array = numpy_helper.to_array(tensor)
        if array.dtype.kind != "f" or array.size == 1:  # scalars (Dropout ratios, ...) are not weights
            continue
        role = roles.get(tensor.name, "positive")
        if role == "conv_weight":
            fan_in = int(np.prod(array.shape[1:]))
            new = rng.standard_normal(array.shape, dtype=np.float32) * np.float32(np.sqrt(2.0 / fan_in))
        elif role in ("gemm_weight", "gemm_weight_t"):
            fan_in = array.shape[-1] if role == "gemm_weight_t" else array.shape[-2]
            new = rng.standard_normal(array.shape, dtype=np.float32) * np.float32(np.sqrt(2.0 / fan_in))
        elif role == "shift":
            new = rng.standard_normal(array.shape, dtype=np.float32) * np.float32(0.1)
        else:
            new = rng.uniform(0.5, 1.5, array.shape).astype(np.float32)
        tensor.CopyFrom(numpy_helper.from_array(new.astype(array.dtype), tensor.name))
    return out
