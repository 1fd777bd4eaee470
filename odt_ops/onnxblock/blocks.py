"""Building blocks: one ONNX node each (or a graph input), composed into losses."""
from __future__ import annotations

import numpy as np
import onnx

from odt_ops.errors import ArtifactError
from odt_ops.onnxblock.base import Block, current, current_builder


def value_info(name: str) -> onnx.ValueInfoProto:
    """Type and shape of a value of the open model (a graph input, output or inferred value)."""
    graph = current()[0].graph
    for v in (*graph.input, *graph.output, *graph.value_info):
        if v.name == name:
            return v
    raise ArtifactError(f"value {name!r} is not an input or output of the model; the model's outputs are {[o.name for o in graph.output]}")


def add_input(name: str, elem_type: int, shape) -> str:
    """Declare a new graph input (labels, targets), unless it exists with that type."""
    graph = current()[0].graph
    for v in graph.input:
        if v.name == name:
            if v.type.tensor_type.elem_type != elem_type:
                raise ArtifactError(f"graph input {name!r} exists with another element type")
            return name
    graph.input.append(onnx.helper.make_tensor_value_info(name, elem_type, shape))
    return name


class _Op(Block):
    op_type = ""

    def __init__(self, **attrs):
        self.attrs = attrs

    def build(self, *inputs: str) -> str:
        return current_builder().op(self.op_type, list(inputs), **self.attrs)


def _op_block(op_type: str, doc: str) -> type[_Op]:
    return type(op_type, (_Op,), {"op_type": op_type, "__doc__": doc})


Add = _op_block("Add", "a + b")
Sub = _op_block("Sub", "a - b")
Mul = _op_block("Mul", "a * b")
Div = _op_block("Div", "a / b")
Sigmoid = _op_block("Sigmoid", "1 / (1 + exp(-x))")
Log = _op_block("Log", "log(x)")
Exp = _op_block("Exp", "exp(x)")
Neg = _op_block("Neg", "-x")
Abs = _op_block("Abs", "|x|")
Sqrt = _op_block("Sqrt", "sqrt(x)")
Relu = _op_block("Relu", "max(x, 0)")
Softplus = _op_block("Softplus", "log(1 + exp(x))")


class _Reduce(Block):
    op_type = ""

    def __init__(self, axes: list[int] | None = None, keepdims: bool = False):
        self.axes, self.keepdims = axes, keepdims

    def build(self, x: str) -> str:
        b = current_builder()
        inputs = [x] if self.axes is None else [x, b.constant(np.array(self.axes, np.int64))]
        return b.op(self.op_type, inputs, keepdims=int(self.keepdims))


class ReduceMean(_Reduce):
    """mean over ``axes`` (all by default)"""

    op_type = "ReduceMean"


class ReduceSum(_Reduce):
    """sum over ``axes`` (all by default)"""

    op_type = "ReduceSum"


class Constant(Block):
    """A float32 constant (or any array) as a value."""

    def __init__(self, value):
        self.value = np.asarray(value, dtype=np.float32) if np.isscalar(value) else np.asarray(value)

    def build(self) -> str:
        return current_builder().constant(self.value)


class Pow(Block):
    """x ** exponent"""

    def __init__(self, exponent: float):
        self.exponent = float(exponent)

    def build(self, x: str) -> str:
        b = current_builder()
        return b.op("Pow", [x, b.constant(np.float32(self.exponent))])


class Clip(Block):
    """min(max(x, clip_min), clip_max)"""

    def __init__(self, clip_min: float | None = None, clip_max: float | None = None):
        self.clip_min, self.clip_max = clip_min, clip_max

    def build(self, x: str) -> str:
        b = current_builder()
        lo = b.constant(np.float32(self.clip_min)) if self.clip_min is not None else ""
        hi = b.constant(np.float32(self.clip_max)) if self.clip_max is not None else ""
        return b.op("Clip", [x, lo, hi])


class Cast(Block):
    """x as another element type (an onnx.TensorProto type number)"""

    def __init__(self, to: int):
        self.to = to

    def build(self, x: str) -> str:
        return current_builder().op("Cast", [x], to=self.to)


class PassThrough(Block):
    """The model output is already the loss."""

    takes_all_outputs = False

    def build(self, x: str) -> str:
        return x


class InputLike(Block):
    """A new graph input shaped and typed like ``like`` (a target for a regression loss)."""

    def __init__(self, like: str):
        self.like = like

    def build(self, name: str | None = None) -> str:
        name = name or current_builder().fresh("user_input")
        tt = value_info(self.like).type.tensor_type
        shape = [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in tt.shape.dim] if tt.HasField("shape") else None
        return add_input(name, tt.elem_type, shape)


class SequenceConstruct(_Op):
    """A tensor sequence of the inputs."""

    op_type = "SequenceConstruct"


class ReduceAllL2(Block):
    """sqrt(sum of squares of every element of every input), in standard ops (ONNX Runtime's
    block of this name emits a com.microsoft node)."""

    def build(self, *inputs: str) -> str:
        b = current_builder()
        squares = [b.op("ReduceSumSquare", [x], keepdims=0) for x in inputs]
        total = squares[0] if len(squares) == 1 else b.op("Sum", squares)
        return b.op("Sqrt", [total])


class Linear(Block):
    """x @ W^T + b (a Gemm), with new trainable initializers drawn as torch.nn.Linear draws them
    (uniform in +-1/sqrt(in_features)), from a generator seeded by ``seed``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, alpha: float = 1.0, beta: float = 1.0,
                 seed: int = 0):
        self.in_features, self.out_features, self.bias = int(in_features), int(out_features), bool(bias)
        self.alpha, self.beta, self.seed = float(alpha), float(beta), seed

    def build(self, x: str) -> str:
        b = current_builder()
        rng = np.random.default_rng(self.seed)
        bound = 1.0 / np.sqrt(self.in_features)
        weight = _initializer(b, "linear.weight", rng.uniform(-bound, bound, (self.out_features, self.in_features)))
        inputs = [x, weight]
        if self.bias:
            inputs.append(_initializer(b, "linear.bias", rng.uniform(-bound, bound, self.out_features)))
        return b.op("Gemm", inputs, alpha=self.alpha, beta=self.beta, transB=1)


def _initializer(b, hint: str, value: np.ndarray) -> str:
    """A new, unshared initializer (a parameter: constants may be shared, parameters never)."""
    name = b.fresh(hint)
    b.initializers.append(onnx.numpy_helper.from_array(value.astype(np.float32), name))
    return name


class LabelEncoder(Block):
    """ai.onnx.ml LabelEncoder: maps keys to values (e.g. class labels to indices)."""

    def __init__(self, default_float: float = 0.0, default_int64: int = -1, default_string: str = "_Unused",
                 keys_floats=None, keys_int64s=None, keys_strings=None, values_floats=None, values_int64s=None,
                 values_strings=None):
        self.attrs = {"default_float": default_float, "default_int64": default_int64, "default_string": default_string,
                      "keys_floats": keys_floats, "keys_int64s": keys_int64s, "keys_strings": keys_strings,
                      "values_floats": values_floats, "values_int64s": values_int64s, "values_strings": values_strings}

    def build(self, x: str) -> str:
        model, b = current()
        if not any(o.domain == "ai.onnx.ml" for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid("ai.onnx.ml", 2))
        out = b.fresh("LabelEncoder")
        attrs = {k: v for k, v in self.attrs.items() if v is not None}
        b.nodes.append(onnx.helper.make_node("LabelEncoder", [x], [out], name=out, domain="ai.onnx.ml", **attrs))
        return out
