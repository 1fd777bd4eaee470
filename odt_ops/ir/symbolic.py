"""Symbolic dims that onnx's shape inference gives up on.

onnx's data propagation follows a shape through Shape, Gather, Unsqueeze and Concat, but
a ConstantOfShape, Expand or Reshape fed by such a computed shape gets fresh ``unk__N``
dims, and every value downstream inherits them. PyTorch writes exactly that: an LSTM's
initial state is ``ConstantOfShape(Concat(1, Shape(x)[0], hidden))``, attention reshapes to
``Concat(Shape(x)[0] * heads, ...)``. The gradient builder then cannot tell that two
operands share the batch dim and emits a run-time unbroadcast (Shape, Equal, Compress,
ReduceSum) for every elementwise input downstream: four nodes each, hundreds in an
unrolled recurrence.

``refine_shapes`` follows the shape values itself, with each dim a product of an integer
and symbols (``batch``, ``4*batch``: enough for what exporters compute), writes the dims
it learns onto those outputs, drops the ``unk__`` guesses downstream and lets onnx infer
again. It only ever replaces a dim onnx left unknown.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import onnx
from onnx import numpy_helper

from odt_ops.domain import is_default

Dim = int | str | None
# a dim as coefficient * product of symbols (sorted, with repeats); None: unknown
Monomial = tuple[int, tuple[str, ...]]

_SHAPE_LIMIT = 64  # int tensors up to this size can be shapes
_ROUNDS = 16  # each round may resolve shapes that the next round's inference propagates (one per Reshape in a chain)


def refine_shapes(proto: onnx.ModelProto, infer: Callable[[onnx.ModelProto], onnx.ModelProto]) -> onnx.ModelProto:
    """``proto`` (already inferred) with the symbolic dims onnx could not follow, re-inferred by ``infer``."""
    for _ in range(_ROUNDS):
        learned = _learn(proto.graph)
        if not learned:
            break
        _apply(proto.graph, learned)
        proto = infer(proto)
    return proto


def is_unknown(dim: Dim) -> bool:
    return dim is None or (isinstance(dim, str) and dim.startswith("unk__"))


# ---------------------------------------------------------------------------- dims as monomials


def _parse(dim: Dim) -> Monomial | None:
    if isinstance(dim, int):
        return (dim, ())
    if dim is None or is_unknown(dim):
        return None
    coef, syms = 1, []
    for factor in dim.split("*"):
        if factor.lstrip("-").isdigit():
            coef *= int(factor)
        else:
            syms.append(factor)
    return (coef, tuple(sorted(syms)))


def _format(m: Monomial | None) -> Dim:
    if m is None:
        return None
    coef, syms = m
    if not syms:
        return coef
    return "*".join(([str(coef)] if coef != 1 else []) + list(syms))


def _mul(a: Monomial | None, b: Monomial | None) -> Monomial | None:
    if a is None or b is None:
        return None
    return (a[0] * b[0], tuple(sorted(a[1] + b[1])))


def _div(a: Monomial | None, b: Monomial | None) -> Monomial | None:
    """a / b when it is exact (b's symbols among a's, coefficients dividing), else None."""
    if a is None or b is None or b[0] == 0 or a[0] % b[0]:
        return None
    rest = Counter(a[1])
    rest.subtract(b[1])
    if any(v < 0 for v in rest.values()):
        return None
    return (a[0] // b[0], tuple(sorted(rest.elements())))


def _ints_only(fn) -> Callable[[Monomial | None, Monomial | None], Monomial | None]:
    def apply(a, b):
        if a is None or b is None or a[1] or b[1]:
            return None
        return (int(fn(a[0], b[0])), ())
    return apply


_ARITHMETIC = {"Mul": _mul, "Div": _div, "Add": _ints_only(lambda x, y: x + y),
               "Sub": _ints_only(lambda x, y: x - y), "Max": _ints_only(max), "Min": _ints_only(min)}


# ---------------------------------------------------------------------------- learning


class _Value:
    """A small int tensor's elements as monomials; ``scalar`` for rank 0."""

    __slots__ = ("items", "scalar")

    def __init__(self, items: Sequence[Monomial | None], scalar: bool = False):
        self.items, self.scalar = list(items), scalar


def _learn(graph: onnx.GraphProto) -> dict[str, list[Dim]]:
    """Output name -> the dims the symbolic values give, where they improve on the inferred ones."""
    shapes = {v.name: _dims(v.type) for v in (*graph.input, *graph.value_info, *graph.output)}
    values: dict[str, _Value] = {}
    for t in graph.initializer:
        shapes[t.name] = list(t.dims)
        if t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) and math.prod(t.dims) <= _SHAPE_LIMIT:
            array = numpy_helper.to_array(t)
            values[t.name] = _Value([(int(v), ()) for v in array.reshape(-1)], scalar=array.ndim == 0)
    learned: dict[str, list[Dim]] = {}
    for node in graph.node:
        if not is_default(node.domain):
            continue
        value = _propagate(node, values, shapes)
        if value is not None and node.output:
            values[node.output[0]] = value
        for out, dims in _output_dims(node, values, shapes):
            known = shapes.get(out)
            if known is None or len(known) != len(dims):
                better = known is None and not any(d is None for d in dims)
            else:
                dims = [k if not is_unknown(k) else d for k, d in zip(known, dims)]
                better = any(is_unknown(k) and not is_unknown(d) for k, d in zip(known, dims))
            if better:
                learned[out] = dims
                shapes[out] = dims
    return learned


def _dims(tp: onnx.TypeProto) -> list[Dim] | None:
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tp.tensor_type.shape.dim]


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _consts(values: dict[str, _Value], name: str) -> list[int] | None:
    v = values.get(name)
    if v is None:
        return None
    known = [m for m in v.items if m is not None and not m[1]]
    return [m[0] for m in known] if len(known) == len(v.items) else None


def _propagate(node: onnx.NodeProto, values: dict[str, _Value], shapes: dict[str, list[Dim] | None]) -> _Value | None:
    """The symbolic value of a shape computation's output, when it is one."""
    op, ins = node.op_type, list(node.input)
    if op == "Shape":
        dims = shapes.get(ins[0])
        if dims is None:
            return None
        rank = len(dims)
        start, end = _attr(node, "start", 0), _attr(node, "end", rank)
        start, end = (max(0, min(rank, i + rank if i < 0 else i)) for i in (start, end))
        return _Value([_parse(d) for d in dims[start:end]])
    if op == "Constant":
        t = _attr(node, "value")
        if isinstance(t, onnx.TensorProto) and t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32) \
                and math.prod(t.dims) <= _SHAPE_LIMIT:
            array = numpy_helper.to_array(t)
            return _Value([(int(v), ()) for v in array.reshape(-1)], scalar=array.ndim == 0)
        return None
    source = values.get(ins[0]) if ins else None
    if source is None:
        return None
    if op in ("Identity", "Cast"):
        return _Value(source.items, source.scalar)
    if op == "Gather" and _attr(node, "axis", 0) == 0:
        idx = values.get(ins[1])
        picks = _consts(values, ins[1])
        if idx is None or picks is None or not all(-len(source.items) <= i < len(source.items) for i in picks):
            return None
        return _Value([source.items[i] for i in picks], scalar=idx.scalar)
    if op == "Unsqueeze" and source.scalar:
        return _Value(source.items)
    if op == "Squeeze" and len(source.items) == 1:
        return _Value(source.items, scalar=True)
    if op == "Concat":
        parts = [values[i] for i in ins if i in values]
        if len(parts) != len(ins):
            return None
        return _Value([m for p in parts for m in p.items])
    if op == "Slice" and len(ins) >= 3:
        starts, ends = _consts(values, ins[1]), _consts(values, ins[2])
        axes = _consts(values, ins[3]) if len(ins) > 3 and ins[3] else [0]
        steps = _consts(values, ins[4]) if len(ins) > 4 and ins[4] else [1]
        if starts is None or ends is None or steps is None or axes != [0] or len(starts) != 1:
            return None
        return _Value(source.items[slice(starts[0], ends[0], steps[0])])
    if op in _ARITHMETIC and len(ins) == 2:
        other = values.get(ins[1])
        if other is None:
            return None
        a, b = source.items, other.items
        if len(a) != len(b):
            if len(a) == 1:
                a = a * len(b)
            elif len(b) == 1:
                b = b * len(a)
            else:
                return None
        fn = _ARITHMETIC[op]
        return _Value([fn(x, y) for x, y in zip(a, b)], scalar=source.scalar and other.scalar)
    return None


def _output_dims(node: onnx.NodeProto, values: dict[str, _Value], shapes: dict[str, list[Dim] | None]) -> list[tuple[str, list[Dim]]]:
    """(output, shape) for the outputs the symbolic values decide: a node that takes a computed
    shape, and an even Split of a symbolic axis (onnx gives its parts fresh dims)."""
    if node.op_type == "Split":
        return _even_split(node, values, shapes)
    if node.op_type == "Concat":
        return _concat(node, shapes)
    dims = _shape_taking_output(node, values, shapes)
    return [] if dims is None or not node.output else [(node.output[0], dims)]


def _concat(node: onnx.NodeProto, shapes: dict[str, list[Dim] | None]) -> list[tuple[str, list[Dim]]]:
    """Concat of parts whose axis dims share their symbols (an unrolled recurrence joins T
    [batch, H] steps into [T*batch, H]; onnx gives the sum a fresh dim)."""
    parts = [p for p in (shapes.get(i) for i in node.input) if p]
    if not parts or len(parts) != len(node.input) or any(len(p) != len(parts[0]) for p in parts):
        return []
    axis = _attr(node, "axis", 0) % len(parts[0])
    terms = [t for t in (_parse(p[axis]) for p in parts) if t is not None]
    if len(terms) != len(parts) or len({t[1] for t in terms}) != 1 or not terms[0][1]:
        return []  # numbers onnx sums itself; mixed symbols have no monomial sum
    total = (sum(t[0] for t in terms), terms[0][1])
    return [(node.output[0], [_format(total) if i == axis else d for i, d in enumerate(parts[0])])]


def _even_split(node: onnx.NodeProto, values: dict[str, _Value], shapes: dict[str, list[Dim] | None]) -> list[tuple[str, list[Dim]]]:
    data = shapes.get(node.input[0])
    if data is None or (len(node.input) > 1 and node.input[1]) or _attr(node, "split") is not None:
        return []  # explicit sizes: onnx's inference already gives their dims
    axis = _attr(node, "axis", 0) % max(len(data), 1)
    part = _format(_div(_parse(data[axis]), (len(node.output), ())))
    if part is None:
        return []
    return [(out, [part if i == axis else d for i, d in enumerate(data)]) for out in node.output if out]


def _shape_taking_output(node: onnx.NodeProto, values: dict[str, _Value], shapes: dict[str, list[Dim] | None]) -> list[Dim] | None:
    op, ins = node.op_type, list(node.input)
    if op == "Resize":  # by sizes, Concat(Shape(x)[:2], H, W) as interpolate(x, size=...) exports
        target = values.get(ins[3]) if len(ins) > 3 and ins[3] else None
        if target is None or target.scalar or _attr(node, "axes") is not None:
            return None
        data = shapes.get(ins[0])
        return [_format(m) for m in target.items] if data is not None and len(data) == len(target.items) else None
    if op == "Tile" and len(ins) > 1:  # x.repeat(n, ...): each dim times its repeat count
        repeats, data = values.get(ins[1]), shapes.get(ins[0])
        if repeats is None or repeats.scalar or data is None or len(data) != len(repeats.items):
            return None
        return [_format(_mul(_parse(d), m)) for d, m in zip(data, repeats.items)]
    if op not in ("ConstantOfShape", "Expand", "Reshape") or len(ins) < 1:
        return None
    target = values.get(ins[0] if op == "ConstantOfShape" else ins[1]) if len(ins) > (op != "ConstantOfShape") else None
    if target is None or target.scalar:
        return None
    if op == "ConstantOfShape":
        return [_format(m) for m in target.items]
    data = shapes.get(ins[0])
    if data is None:
        return None
    if op == "Expand":
        return _broadcast(data, [_format(m) for m in target.items])
    return _reshape(data, target.items, allowzero=_attr(node, "allowzero", 0))


def _broadcast(a: list[Dim], b: list[Dim]) -> list[Dim]:
    rank = max(len(a), len(b))
    ones: list[Dim] = [1] * rank
    a, b = ones[: rank - len(a)] + list(a), ones[: rank - len(b)] + list(b)
    out: list[Dim] = []
    for x, y in zip(a, b):
        if x == 1:
            out.append(y)
        elif y == 1 or x == y:
            out.append(x)
        elif isinstance(x, int) and not isinstance(y, int):
            out.append(x)  # a symbol broadcast against n > 1 must be n (or 1, which gives n too)
        elif isinstance(y, int) and not isinstance(x, int):
            out.append(y)
        else:
            out.append(None)
    return out


def _reshape(data: list[Dim], target: list[Monomial | None], *, allowzero: int) -> list[Dim]:
    dims = [_parse(data[i]) if m == (0, ()) and not allowzero and i < len(data) else m for i, m in enumerate(target)]
    if (-1, ()) in dims:
        k = dims.index((-1, ()))
        total: Monomial | None = (1, ())
        for d in data:
            total = _mul(total, _parse(d))
        known: Monomial | None = (1, ())
        for i, m in enumerate(dims):
            if i != k:
                known = _mul(known, m)
        dims[k] = _div(total, known)
    return [_format(m) for m in dims]


def _apply(graph: onnx.GraphProto, learned: dict[str, list[Dim]]) -> None:
    """Write the learned dims and forget every inferred shape that holds an ``unk__`` guess, so the
    next inference derives those from the learned ones instead of keeping the guesses."""
    kept = [v for v in graph.value_info if v.name in learned or not any(is_unknown(d) for d in (_dims(v.type) or []))]
    del graph.value_info[:]
    graph.value_info.extend(kept)  # copies: look the values up afterwards
    by_name = {v.name: v for v in (*graph.value_info, *graph.output)}
    for name, dims in learned.items():
        v = by_name.get(name)
        if v is None:
            continue  # a value whose element type inference did not give: leave it
        shape = v.type.tensor_type.shape
        del shape.dim[:]
        for d in dims:
            dim = shape.dim.add()
            if isinstance(d, int):
                dim.dim_value = d
            elif d is not None:
                dim.dim_param = d


# for the passes that read symbolic shapes (odt_ops/ir/static_batch.py)
parse_dim = _parse  # a dim as (coefficient, symbols)
type_dims = _dims  # a value's dims: numbers, symbols, None where unknown; None without a shape
attribute = _attr

__all__ = ["attribute", "is_unknown", "parse_dim", "refine_shapes", "type_dims"]
