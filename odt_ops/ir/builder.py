"""GraphBuilder: a recording builder that emits ONNX nodes, in the shape of onnx-ir's Tape.

    b = GraphBuilder(taken=existing_names, opset=21)
    with b.scope("grad/Gemm_0"):
        dA = b.Gemm(dY, B, transB=1)           # one output: its name
        lo, hi = b.op_multi("Split", [x], 2, axis=0)
        one = b.constant(np.array(1.0))        # an initializer; small ones are shared
    graph.node.extend(b.nodes); graph.initializer.extend(b.initializers)

Every emitted value and node gets a unique, readable name under the current scope.
The builder also tracks the type (dtype and shape, symbolic dims included) of every
value it knows, by running ONNX shape inference on each node as it is emitted, so
callers can ask ``b.shape(name)`` about the values they just made.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

Dim = int | str | None  # int: static; str: symbolic; None: unknown

_SMALL = 16  # constants up to this many elements are deduplicated
_DATA_LIMIT = 4096  # constants up to this size are shown to shape inference


class GraphBuilder:
    """Records nodes and initializers; ``op`` returns output names, never values."""

    def __init__(
        self,
        *,
        taken: Iterable[str] = (),
        opset: int = 21,
        types: Mapping[str, onnx.TypeProto] | None = None,
        constants: Mapping[str, onnx.TensorProto] | None = None,
        prefix: str = "",
    ):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.opset = opset
        self.types: dict[str, onnx.TypeProto] = dict(types or {})
        self.constants: dict[str, onnx.TensorProto] = dict(constants or {})  # known constant values
        self._taken: set[str] = set(taken) | set(self.types) | set(self.constants)
        self._prefix = prefix
        self._shared: dict[tuple, str] = {}
        self._opsets = [helper.make_opsetid("", opset)]

    # ---- names -------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self, prefix: str) -> Iterator[None]:
        """Names made inside start with ``prefix/``."""
        outer = self._prefix
        self._prefix = f"{outer}/{prefix}" if outer else prefix
        try:
            yield
        finally:
            self._prefix = outer

    def fresh(self, hint: str, *, scoped: bool = True) -> str:
        """A name nothing else in the graph uses: ``<scope>/<hint>`` (or ``hint`` when not
        ``scoped``) if that is free, else with a numeric suffix."""
        return unique_name(f"{self._prefix}/{hint}" if self._prefix and scoped else hint, self._taken)

    def taken(self, name: str) -> bool:
        return name in self._taken

    # ---- nodes -------------------------------------------------------------------
    def op(self, op_type: str, inputs: Sequence[str | None], **attrs) -> str:
        """Emit one node; returns the name of its (first) output."""
        return self.op_multi(op_type, inputs, 1, **attrs)[0]

    def op_multi(self, op_type: str, inputs: Sequence[str | None], n_outputs: int, **attrs) -> list[str]:
        """Emit one node with ``n_outputs`` outputs; returns their names."""
        name = self.fresh(op_type)
        outputs = [name] + [self.fresh(f"{op_type}_out{i}") for i in range(1, n_outputs)]
        attrs = {k: _attr(v) for k, v in attrs.items() if v is not None}
        node = helper.make_node(op_type, [i or "" for i in inputs], outputs, name=name, **attrs)
        self.nodes.append(node)
        self.infer(node)
        return outputs

    def __getattr__(self, op_type: str):
        """``b.Gemm(a, c, transA=1)`` is ``b.op("Gemm", [a, c], transA=1)``."""
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attrs: self.op(op_type, inputs, **attrs)

    def constant(self, value: np.ndarray | float | int, dtype: np.dtype | type | None = None, hint: str = "const") -> str:
        """An initializer holding ``value``; small constants are created once and shared."""
        array = np.asarray(value, dtype=dtype)
        key = None
        if array.size <= _SMALL:
            key = (array.dtype.str, array.shape, array.tobytes())
            if key in self._shared:
                return self._shared[key]
        name = self.fresh(hint)
        tensor = numpy_helper.from_array(array, name)
        self.initializers.append(tensor)
        self.constants[name] = tensor
        self.types[name] = helper.make_tensor_type_proto(tensor.data_type, array.shape)
        if key is not None:
            self._shared[key] = name
        return name

    def rename(self, old: str, new: str, *, read: set[str] | None = None) -> bool:
        """Give the value ``old`` (produced by an emitted node, read by none) the name ``new``.
        ``read`` may pass the names emitted nodes read, when renaming many values."""
        if read is None:
            read = {i for n in self.nodes for i in n.input}
        if new in self._taken or old in read:
            return False
        for node in reversed(self.nodes):
            if old in node.output:
                node.output[list(node.output).index(old)] = new
                self._taken.add(new)
                if old in self.types:
                    self.types[new] = self.types.pop(old)
                return True
        return False

    # ---- types -------------------------------------------------------------------
    def infer(self, node: onnx.NodeProto) -> None:
        """Record the output types of ``node`` (emitted or forward) by ONNX shape inference."""
        try:
            schema = onnx.defs.get_schema(node.op_type, self.opset, node.domain)
            known = {n: self.types[n] for n in node.input if n in self.types}
            data = {n: self.constants[n] for n in node.input if n in self.constants and _size(self.constants[n]) <= _DATA_LIMIT}
            out = onnx.shape_inference.infer_node_outputs(schema, node, known, data, opset_imports=self._opsets)
        except Exception:  # inference is a convenience; unknown types are allowed
            return
        for name, tp in out.items():
            if name and tp.HasField("tensor_type"):
                self.types[name] = tp

    def dtype(self, name: str) -> np.dtype | None:
        tp = self.types.get(name)
        if tp is None or not tp.tensor_type.elem_type:
            return None
        return helper.tensor_dtype_to_np_dtype(tp.tensor_type.elem_type)

    def shape(self, name: str) -> tuple[Dim, ...] | None:
        """Static shape with symbolic dims as strings and unknown ones as None; None if rank unknown."""
        tp = self.types.get(name)
        if tp is None or not tp.tensor_type.HasField("shape"):
            return None
        return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tp.tensor_type.shape.dim)

    def value(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if it is a known constant."""
        tensor = self.constants.get(name)
        return None if tensor is None else numpy_helper.to_array(tensor)


def unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base_1``, ``base_2``, ... whichever is not in ``taken``; it is then taken."""
    name, k = base, 1
    while name in taken:
        name = f"{base}_{k}"
        k += 1
    taken.add(name)
    return name


def _size(tensor: onnx.TensorProto) -> int:
    return int(np.prod(tensor.dims, dtype=np.int64))


def _attr(value):
    """numpy arrays become tensor attributes; numpy scalars plain Python values."""
    if isinstance(value, np.ndarray):
        return numpy_helper.from_array(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [v.item() if isinstance(v, np.generic) else v for v in value]
    return value


__all__ = ["Dim", "GraphBuilder", "unique_name"]
