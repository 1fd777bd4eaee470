"""Fusions: node groups of the training graphs rewritten, when a plan is compiled, into
fewer nodes that compute the same values.

Each fusion is a named pass over the node list (registered with ``@fusion``) that says
whether it changed anything. A fused node is an ordinary NodeProto in the engine's own
domain, so plans, profiles and error messages treat it like any other node; its
implementation is registered with ``@fused_op`` and bound when the plan is compiled.
The artifacts never contain these nodes: ``Plan(..., fuse=False)`` runs the graphs as
written, and the tests hold both ways equal.

A pass only removes a value that nothing else reads and that the caller does not need
(graph outputs, checked values), and only rewrites what it can prove equal from the
node attributes and constants; anything else is left for the node-by-node path.
"""
from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx

from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels import lookup
from odt_ops.kernels.channels import per_channel
from odt_ops.kernels.conv import keeps_rows, row_windows, zero_wrapped
from odt_ops.kernels.elementwise import relu_in_place
from odt_ops.kernels.geometry import WindowGeometry
from odt_ops.kernels.loss import label_positions

DOMAIN = "odt_ops.fused"
STANDARD = ("", "ai.onnx")

Pass = Callable[["Graph"], bool]
Factory = Callable[[dict, int], Callable[..., tuple]]  # (fused node attributes, ai.onnx opset) -> kernel

FUSIONS: dict[str, Pass] = {}
_OPS: dict[str, Factory] = {}


def fusion(name: str) -> Callable[[Pass], Pass]:
    def register(fn: Pass) -> Pass:
        assert name not in FUSIONS, f"fusion {name} registered twice"
        FUSIONS[name] = fn
        return fn
    return register


def fused_op(op_type: str) -> Callable[[Factory], Factory]:
    def register(fn: Factory) -> Factory:
        assert op_type not in _OPS, f"fused op {op_type} registered twice"
        _OPS[op_type] = fn
        return fn
    return register


def bind(node: onnx.NodeProto, opset: int) -> Callable[..., tuple]:
    """The implementation of a fused node; ``opset`` is the graph's ai.onnx opset."""
    return _OPS[node.op_type](node_attributes(node), opset)


def fuse(nodes: Sequence[onnx.NodeProto], constants: Mapping[str, np.ndarray], keep: Iterable[str],
         only: Iterable[str] | None = None) -> list[onnx.NodeProto]:
    """The nodes with every fusion (or those named in ``only``) applied; ``keep`` must survive."""
    unknown = set(only or ()) - set(FUSIONS)
    if unknown:
        raise ValueError(f"unknown fusion(s) {sorted(unknown)}; the fusions are {list(FUSIONS)}")
    graph = Graph(nodes, constants, set(keep))
    for name, run in FUSIONS.items():
        if only is None or name in only:
            run(graph)
    return graph.nodes


class Graph:
    """The node list a fusion rewrites, with producer/consumer lookups and its constants."""

    def __init__(self, nodes: Sequence[onnx.NodeProto], constants: Mapping[str, np.ndarray], keep: set[str]):
        self.nodes = list(nodes)
        self.constants = constants
        self.keep = keep
        self._index()

    def _index(self) -> None:
        self._producer: dict[str, onnx.NodeProto] = {}
        self._consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in self.nodes:
            for name in node.output:
                self._producer[name] = node
            for name in node.input:
                self._consumers.setdefault(name, []).append(node)

    def producer(self, name: str, op_type: str, domains: tuple[str, ...] = STANDARD) -> onnx.NodeProto | None:
        node = self._producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in domains else None

    def consumers(self, name: str) -> list[onnx.NodeProto]:
        return self._consumers.get(name, [])

    def sole_reader(self, name: str, op_type: str, position: int | None = None,
                    domains: tuple[str, ...] = STANDARD) -> onnx.NodeProto | None:
        """The one node reading ``name``, if it is an ``op_type`` (reading it at ``position``) and
        nothing else needs the value."""
        readers = self.consumers(name)
        if name in self.keep or len(readers) != 1:
            return None
        node = readers[0]
        if node.op_type != op_type or node.domain not in domains or list(node.input).count(name) != 1:
            return None
        return node if position is None or node.input[position] == name else None

    def constant(self, name: str) -> np.ndarray | None:
        return self.constants.get(name) if name else None

    def scalar(self, name: str):
        """The value of a one-element constant that broadcasts without adding axes (0-d or [1]), else None."""
        value = self.constant(name)
        return value.reshape(-1)[0] if value is not None and value.size == 1 and value.ndim <= 1 else None

    def is_zero(self, name: str) -> bool:
        """Whether ``name`` is a constant +0 that broadcasts without adding axes."""
        value = self.scalar(name)
        return value is not None and value == 0 and not np.signbit(value)

    def is_one(self, name: str) -> bool:
        """Whether ``name`` is a floating-point constant 1 that broadcasts without adding axes."""
        value = self.scalar(name)
        return value is not None and np.asarray(value).dtype.kind == "f" and value == 1

    def ints(self, node: onnx.NodeProto, position: int, attribute: str) -> list[int] | None:
        """A constant int list given as input ``position`` (newer opsets) or as an attribute."""
        if len(node.input) > position and node.input[position]:
            value = self.constant(node.input[position])
            return None if value is None or value.dtype.kind not in "iu" else [int(v) for v in value.reshape(-1)]
        value = node_attributes(node).get(attribute)
        return None if value is None else [int(v) for v in np.atleast_1d(value)]

    def replace(self, old: Sequence[onnx.NodeProto], new: onnx.NodeProto) -> bool:
        """Put ``new`` where the last of ``old`` was (the plan sorts again afterwards); False, and
        nothing changed, when an input of ``new`` is computed from an output of ``old`` (a cycle)
        or when ``new`` drops a value of ``old`` that another node or the caller needs."""
        produced = {name for n in old for name in n.output if name}
        spent = {id(n) for n in old}
        needed = [name for name in produced - set(new.output)
                  if name in self.keep or any(id(r) not in spent for r in self.consumers(name))]
        if needed or self._reaches(new.input, produced):
            return False
        drop = {id(n) for n in old}
        at = max(i for i, n in enumerate(self.nodes) if id(n) in drop)
        self.nodes = [new if i == at else n for i, n in enumerate(self.nodes) if id(n) not in drop or i == at]
        self._index()
        return True

    def _reaches(self, names: Iterable[str], targets: set[str]) -> bool:
        """Whether any of ``names`` is, or is computed from, one of ``targets``."""
        seen: set[str] = set()
        stack = [n for n in names if n]
        while stack:
            name = stack.pop()
            if name in targets:
                return True
            if name in seen:
                continue
            seen.add(name)
            node = self._producer.get(name)
            if node is not None:
                stack.extend(n for n in node.input if n)
        return False


def _fused_node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], name: str, **attrs) -> onnx.NodeProto:
    return onnx.helper.make_node(op_type, list(inputs), list(outputs), name=name, domain=DOMAIN,
                                 **{k: v for k, v in attrs.items() if v is not None})


def _kernel(op_type: str, opset: int, **attrs) -> Callable[..., tuple]:
    entry = lookup("", op_type, opset)
    if entry is None:
        raise AssertionError(f"fused op needs a kernel for {op_type} at opset {opset}")
    return lambda *args: entry.fn(*args, **attrs)


# ---------------------------------------------------------------- softmax cross-entropy


@fusion("softmax_cross_entropy_grad")
def _softmax_cross_entropy_grad(g: Graph) -> bool:
    """SoftmaxCrossEntropyLoss and its gradient rule's (Exp(log_prob) - OneHot(labels)) * coefficient
    -> one node returning loss, log_prob and dscores: the one-hot subtraction becomes a 1
    taken off the labels' entries, in place."""
    changed = False
    for sce in [n for n in g.nodes if n.op_type == "SoftmaxCrossEntropyLoss" and n.domain in STANDARD]:
        if len(sce.output) != 2 or not sce.output[1]:
            continue
        log_prob = sce.output[1]
        for exp in [n for n in g.consumers(log_prob) if n.op_type == "Exp" and n.domain in STANDARD]:
            sub = g.sole_reader(exp.output[0], "Sub", 0)
            one_hot = sub and g.producer(sub.input[1], "OneHot")
            mul = sub and g.sole_reader(sub.output[0], "Mul", 0)
            if not (one_hot and mul and g.sole_reader(one_hot.output[0], "Sub") is sub):
                continue
            values = g.constant(one_hot.input[2])
            if node_attributes(one_hot).get("axis", -1) != 1 or values is None or values.tolist() != [0, 1]:
                continue
            others = [n for n in g.consumers(log_prob) if n is not exp]
            attrs = node_attributes(sce)
            # the loss kernel has checked its labels lie in [0, C): a one-hot of them needs no check
            checked = one_hot.input[0] == sce.input[1] and "ignore_index" not in attrs
            fused = _fused_node(
                "SoftmaxCrossEntropyLossGrad",
                [sce.input[0], sce.input[1], sce.input[2] if len(sce.input) > 2 else "", *one_hot.input[:3], mul.input[1]],
                [sce.output[0], log_prob if others or log_prob in g.keep else "", mul.output[0]],
                f"fused/{sce.name or sce.output[0]}", reduction=attrs.get("reduction"), ignore_index=attrs.get("ignore_index"),
                labels_checked=int(checked))
            if g.replace([sce, exp, one_hot, sub, mul], fused):
                changed = True
                break
    return changed


@fused_op("SoftmaxCrossEntropyLossGrad")
def _softmax_cross_entropy_loss_grad(attrs: dict, opset: int) -> Callable[..., tuple]:
    checked = attrs.pop("labels_checked", 0)
    sce = _kernel("SoftmaxCrossEntropyLoss", opset, _num_outputs=2, **attrs)
    one_hot = _kernel("OneHot", opset, axis=1)

    def run(scores, labels, weights, indices, depth, values, coefficient):
        loss, log_prob = sce(scores, labels, weights)[:2]
        grad = np.exp(log_prob)
        if not _take_one_at(grad, indices, depth, checked):
            grad = np.subtract(grad, one_hot(indices, depth, values)[0])
        if coefficient.dtype == grad.dtype and _broadcasts_into(coefficient.shape, grad.shape):
            grad *= coefficient
        else:
            grad = np.multiply(grad, coefficient)
        return loss, log_prob, grad

    return run


def _broadcasts_into(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    return len(small) <= len(big) and all(s in (1, b) for s, b in zip(reversed(small), reversed(big)))


def _take_one_at(grad: np.ndarray, indices: np.ndarray, depth: np.ndarray, checked: bool) -> bool:
    """grad - OneHot(indices, depth, [0, 1], axis=1), in place, where the one-hot is simply the
    indices' entries (integers in [0, depth), depth = grad.shape[1]); False otherwise."""
    if grad.ndim < 2 or indices.dtype.kind not in "iu" or indices.shape != (grad.shape[0], *grad.shape[2:]):
        return False
    if int(depth.reshape(-1)[0]) != grad.shape[1]:
        return False
    if indices.size == 0:
        return True
    if not checked and (indices.min() < 0 or indices.max() >= grad.shape[1]):
        return False
    one = grad.dtype.type(1)
    if grad.ndim == 2 and grad.flags.c_contiguous:
        flat, at = grad.reshape(-1), label_positions(grad, indices)
        flat[at] = flat.take(at) - one
    else:
        at = np.expand_dims(indices, 1)
        np.put_along_axis(grad, at, np.take_along_axis(grad, at, 1) - one, 1)
    return True


# ---------------------------------------------------------------- reduce then squeeze

_REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
           "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")


@fusion("reduce_squeeze")
def _reduce_squeeze(g: Graph) -> bool:
    """Reduce*(keepdims=1) whose only reader squeezes exactly the reduced axes -> Reduce*(keepdims=0)
    (the gradient walker's unbroadcast emits this for every bias)."""
    changed = False
    for reduce in [n for n in g.nodes if n.op_type in _REDUCE and n.domain in STANDARD]:
        attrs = node_attributes(reduce)
        squeeze = g.sole_reader(reduce.output[0], "Squeeze", 0)
        if squeeze is None or attrs.get("keepdims", 1) != 1 or attrs.get("noop_with_empty_axes", 0):
            continue
        axes, squeezed = g.ints(reduce, 1, "axes"), g.ints(squeeze, 1, "axes")
        if not axes or squeezed is None or sorted(axes) != sorted(squeezed):
            continue
        rewritten = onnx.NodeProto()
        rewritten.CopyFrom(reduce)
        rewritten.output[0] = squeeze.output[0]
        del rewritten.attribute[:]
        rewritten.attribute.extend(a for a in reduce.attribute if a.name != "keepdims")
        rewritten.attribute.append(onnx.helper.make_attribute("keepdims", 0))
        changed = g.replace([reduce, squeeze], rewritten) or changed
    return changed


# ---------------------------------------------------------------- stacked slices


@fusion("stacked_slices")
def _stacked_slices(g: Graph) -> bool:
    """Concat(axis=a) of Unsqueeze(Slice(x, constant starts/ends/axes/steps > 0), [a]) over one x
    -> one node stacking the slices (the Conv weight gradient's kernel taps)."""
    changed = False
    for concat in [n for n in g.nodes if n.op_type == "Concat" and n.domain in STANDARD and len(n.input) > 1]:
        axis = node_attributes(concat).get("axis")
        taps = [_tap(g, name, concat, axis) for name in concat.input]
        if axis is None or any(t is None for t in taps) or len({t[0].input[0] for t in taps}) != 1:
            continue
        regions = [region for _, _, region in taps]
        fused = _fused_node("StackedSlices", [taps[0][0].input[0]], [concat.output[0]], f"fused/{concat.name or concat.output[0]}",
                            axis=axis, rank=len(regions[0]), regions=[v for region in regions for item in region for v in item])
        changed = g.replace([n for slice_, unsqueeze, _ in taps for n in (slice_, unsqueeze)] + [concat], fused) or changed
    return changed


def _tap(g: Graph, name: str, concat: onnx.NodeProto, axis: int):
    """(Slice, Unsqueeze, [(axis, start, end, step) per sliced axis]) for one Concat input, or None."""
    unsqueeze = g.producer(name, "Unsqueeze")
    if unsqueeze is None or g.sole_reader(name, "Concat") is not concat or g.ints(unsqueeze, 1, "axes") != [axis]:
        return None
    slice_ = g.producer(unsqueeze.input[0], "Slice")
    if slice_ is None or g.sole_reader(slice_.output[0], "Unsqueeze") is not unsqueeze:
        return None
    starts, ends = g.ints(slice_, 1, "starts"), g.ints(slice_, 2, "ends")
    axes, steps = g.ints(slice_, 3, "axes"), g.ints(slice_, 4, "steps")
    given = [len(slice_.input) > i and bool(slice_.input[i]) for i in (3, 4)]
    if starts is None or ends is None or (axes is None and given[0]) or (steps is None and given[1]):
        return None  # a non-constant input
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps) or min(steps, default=1) < 1:
        return None
    return slice_, unsqueeze, [(a, s, e, st) for a, s, e, st in zip(axes, starts, ends, steps)]


@fused_op("StackedSlices")
def _stack_slices(attrs: dict, opset: int) -> Callable[..., tuple]:
    axis, rank, flat = attrs["axis"], attrs["rank"], attrs["regions"]
    regions = [[tuple(flat[i + 4 * j: i + 4 * j + 4]) for j in range(rank)] for i in range(0, len(flat), 4 * rank)]

    def run(x):
        parts = []
        for region in regions:
            index = [slice(None)] * x.ndim
            for a, start, end, step in region:
                if not -x.ndim <= a < x.ndim or index[a % x.ndim] != slice(None):
                    raise ValueError(f"Slice axes {[r[0] for r in region]} do not fit a tensor of rank {x.ndim}")
                # positive steps: Python's clamping of start and end is the Slice spec's
                index[a % x.ndim] = slice(start, end, step)
            parts.append(x[tuple(index)])
        return (np.stack(parts, axis=axis),)

    return run


@fusion("window_columns")
def _window_columns(g: Graph) -> bool:
    """StackedSlices of a zero-Padded input whose slices are a stride-1 window's taps (a Conv weight
    gradient's columns) -> one node that reads the taps from the unpadded planes, one flat offset
    per tap (kernels/conv.py's row windows, as the forward Conv's im2col does) when the output
    rows are as long as the input's: whole-plane copies instead of a copy per short row. The
    values are the same copies and zeros."""
    changed = False
    for stack in [n for n in g.nodes if n.op_type == "StackedSlices" and n.domain == DOMAIN]:
        pad = g.producer(stack.input[0], "Pad")
        attrs = node_attributes(stack)
        window = pad and g.sole_reader(pad.output[0], "StackedSlices", 0, domains=(DOMAIN,)) is stack and \
            _stride_one_window(g, pad, attrs)
        if window:
            kernel, dilations, pads = window
            fused = _fused_node("WindowColumns", [pad.input[0], *pad.input[1:]], stack.output, f"fused/{stack.name}",
                                kernel=kernel, dilations=dilations, pads=pads, **attrs)
            changed = g.replace([pad, stack], fused) or changed
    return changed


def _stride_one_window(g: Graph, pad: onnx.NodeProto, attrs: dict):
    """(kernel, dilations, spatial pads) if ``pad`` zero-pads only axes 2.. and the stack's slices,
    in order, are every tap of a stride-1 window over those axes (at axis 1), else None."""
    pads = g.ints(pad, 1, "pads")
    mode = node_attributes(pad).get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    value = g.constant(pad.input[2]) if len(pad.input) > 2 and pad.input[2] else np.zeros(1)
    if pads is None or mode != "constant" or value is None or value.size != 1 or value.reshape(-1)[0] != 0 \
            or (len(pad.input) > 3 and pad.input[3]) or attrs["axis"] != 1 or min(pads) < 0:
        return None
    rank, full = attrs["rank"], len(pads) // 2
    if full != rank + 2 or pads[0] or pads[1] or pads[full] or pads[full + 1]:
        return None
    flat = attrs["regions"]
    taps = [flat[i: i + 4 * rank] for i in range(0, len(flat), 4 * rank)]
    starts = [[t[4 * j + 1] for j in range(rank)] for t in taps]
    if any([t[4 * j] for j in range(rank)] != list(range(2, 2 + rank)) or any(t[4 * j + 3] != 1 for j in range(rank)) for t in taps):
        return None
    kernel = [len({s[j] for s in starts}) for j in range(rank)]
    dilations = [(max(s[j] for s in starts) // (k - 1)) if k > 1 else 1 for j, k in enumerate(kernel)]
    expected = [[k * d for k, d in zip(offset, dilations)] for offset in np.ndindex(*kernel)]
    lengths = {tuple(t[4 * j + 2] - t[4 * j + 1] for j in range(rank)) for t in taps}
    if starts != expected or len(lengths) != 1:
        return None
    return kernel, dilations, [*pads[2:full], *pads[full + 2:]]


@fused_op("WindowColumns")
def _window_columns_op(attrs: dict, opset: int) -> Callable[..., tuple]:
    kernel, dilations, pads = tuple(attrs["kernel"]), tuple(attrs["dilations"]), attrs["pads"]
    rank = len(kernel)
    pad, stack = _kernel("Pad", opset), _stack_slices(attrs, opset)
    first = attrs["regions"][:4 * rank]
    out = tuple(first[4 * j + 2] - first[4 * j + 1] for j in range(rank))
    geo = WindowGeometry(kernel, (1,) * rank, dilations, tuple(pads[:rank]), tuple(pads[rank:]), out)

    def run(x, *pad_inputs):
        if x.ndim != rank + 2 or not keeps_rows(x, geo) or any(r > n + b + e for r, n, b, e in
                                                                 zip(geo.reach, x.shape[2:], geo.begin, geo.end)):
            return stack(pad(x, *pad_inputs)[0])  # the two nodes as written
        C, N = x.shape[:2]
        columns = np.empty((C, *kernel, N, math.prod(out)), dtype=x.dtype)
        windows = row_windows(x, geo)  # (C, N, *kernel, positions)
        np.copyto(columns, np.moveaxis(windows, 1, 1 + rank))
        zero_wrapped(np.moveaxis(columns.reshape(C, *kernel, N, *out), 1 + rank, 1), geo)
        return (columns.reshape(C, math.prod(kernel), N, *out),)

    return run


# ---------------------------------------------------------------- scatter into zeros


@fusion("scatter_into_zeros")
def _scatter_into_zeros(g: Graph) -> bool:
    """ScatterElements (none or add) into a fresh 1-D ConstantOfShape of zeros -> one node that
    scatters into np.zeros (the zeros are not filled, then copied again; MaxPool's gradient)."""
    changed = False
    for scatter in [n for n in g.nodes if n.op_type == "ScatterElements" and n.domain in STANDARD]:
        attrs = node_attributes(scatter)
        fill = g.producer(scatter.input[0], "ConstantOfShape")
        if fill is None or g.sole_reader(fill.output[0], "ScatterElements", 0) is not scatter:
            continue
        value = node_attributes(fill).get("value")
        value = np.zeros(1, np.float32) if value is None else np.asarray(value).reshape(-1)
        zero = value.size == 1 and value[0] == 0 and not np.signbit(value[0])
        if not zero or attrs.get("axis", 0) not in (0, -1) or attrs.get("reduction", "none") not in ("none", "add") \
                or not _one_long(g, fill.input[0]):
            continue
        fused = _fused_node("ScatterIntoZeros", [fill.input[0], scatter.input[1], scatter.input[2]], [scatter.output[0]],
                            f"fused/{scatter.name or scatter.output[0]}", reduction=attrs.get("reduction", "none"),
                            dtype=onnx.helper.np_dtype_to_tensor_dtype(value.dtype))
        changed = g.replace([fill, scatter], fused) or changed
    return changed


def _one_long(g: Graph, shape: str) -> bool:
    """Whether the shape tensor ``shape`` has one element (the data is 1-D)."""
    value = g.constant(shape)
    if value is not None:
        return value.shape == (1,)
    reshape = g.producer(shape, "Reshape")
    target = reshape and g.constant(reshape.input[1])
    return target is not None and target.tolist() == [1]


@fusion("relu_masked_scatter")
def _relu_masked_scatter(g: Graph) -> bool:
    """Where(Greater(Y, 0), Reshape(ScatterIntoZeros(...), Shape(Y)), 0) -> the scatter keeps only the
    updates whose target in Y is positive (ReLU's gradient through MaxPool's, at the pooled size
    instead of the input's)."""
    changed = False
    for where in [n for n in g.nodes if n.op_type == "Where" and n.domain in STANDARD]:
        greater = g.producer(where.input[0], "Greater")
        reshape = g.producer(where.input[1], "Reshape")
        if not (greater and reshape and g.is_zero(greater.input[1]) and g.is_zero(where.input[2])):
            continue
        y = greater.input[0]
        shape = g.producer(reshape.input[1], "Shape")
        scatter = g.producer(reshape.input[0], "ScatterIntoZeros", (DOMAIN,))
        if not (shape and scatter and shape.input[0] == y and not node_attributes(shape) and len(scatter.input) == 3
                and g.sole_reader(reshape.output[0], "Where", 1) is where
                and g.sole_reader(scatter.output[0], "Reshape", 0) is reshape):
            continue
        fused = _fused_node("ScatterIntoZeros", [*scatter.input, y], [where.output[0]], f"fused/{where.name or where.output[0]}",
                            **node_attributes(scatter))
        # the mask and the shape go too unless something else reads them
        spent = [n for n, reader in ((greater, "Where"), (shape, "Reshape")) if g.sole_reader(n.output[0], reader)]
        changed = g.replace([where, reshape, scatter, *spent], fused) or changed
    return changed


@fused_op("ScatterIntoZeros")
def _scatter_into_zeros_op(attrs: dict, opset: int) -> Callable[..., tuple]:
    reduction, dtype = attrs["reduction"], onnx.helper.tensor_dtype_to_np_dtype(attrs["dtype"])

    def run(shape, indices, updates, masked_by=None):
        n = int(shape.reshape(-1)[0])
        if indices.ndim != 1 or updates.shape != indices.shape or updates.dtype != dtype:
            raise ValueError(f"ScatterElements into {n} zeros of {dtype}: indices {indices.shape} and updates "
                             f"{updates.dtype}{updates.shape} must be 1-D of one shape and the zeros' dtype")
        out = np.zeros(n, dtype)
        if masked_by is not None:
            if masked_by.size != n:
                raise ValueError(f"cannot reshape {n} scattered values to {masked_by.shape}")
            # Where(Y > 0, scattered, 0) decided at the scattered positions only: elsewhere both are 0
            updates = _zero_unless(np.take(masked_by.reshape(-1), indices) > masked_by.dtype.type(0), updates)
        if reduction == "none":
            out[indices] = updates
        else:
            np.add.at(out, indices, updates)
        return (out if masked_by is None else out.reshape(masked_by.shape),)

    return run


_BITS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _zero_unless(keep: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Where(keep, values, +0) as one AND of the raw bits with 0 / all-ones: np.where branches
    per element, ten times slower on an unpredictable mask."""
    bits = _BITS.get(values.dtype.itemsize)
    if bits is None or values.dtype.kind == "c":
        return np.where(keep, values, values.dtype.type(0))
    mask = np.negative(keep.view(np.int8), dtype=bits)  # True (1) -> -1: every bit set
    return np.bitwise_and(mask, values.view(bits), out=mask).view(values.dtype)


# ---------------------------------------------------------------- ReLU of a product


_FRESH_PRODUCTS = ("Gemm", "MatMul")  # their kernels always return a new array


@fusion("relu_in_place")
def _relu_of_product(g: Graph) -> bool:
    """Relu whose input is a Gemm or MatMul product nothing else reads -> one node that applies the
    ReLU over the product in place (no second array of the layer's size, no pass into fresh memory)."""
    changed = False
    for relu in [n for n in g.nodes if n.op_type == "Relu" and n.domain in STANDARD]:
        product = next((p for op in _FRESH_PRODUCTS if (p := g.producer(relu.input[0], op))), None)
        if product is None or g.sole_reader(product.output[0], "Relu") is not relu:
            continue
        fused = _fused_node(f"{product.op_type}Relu", product.input, relu.output, f"fused/{product.name or product.output[0]}",
                            **node_attributes(product))
        changed = g.replace([product, relu], fused) or changed
    return changed


def _then_relu(op_type: str) -> Factory:
    def factory(attrs: dict, opset: int) -> Callable[..., tuple]:
        product, relu = _kernel(op_type, opset, **attrs), _kernel("Relu", opset)

        def run(*args):
            y = product(*args)[0]
            # a product of two vectors comes back from numpy as a scalar, which has no memory to reuse
            return (relu_in_place(y),) if isinstance(y, np.ndarray) else relu(y)

        return run
    return factory


for _op in _FRESH_PRODUCTS:
    fused_op(f"{_op}Relu")(_then_relu(_op))


# ---------------------------------------------------------------- sigmoid and tanh gradients


@fusion("activation_grad")
def _activation_grad(g: Graph) -> bool:
    """The Sigmoid and Tanh gradient rules' three nodes -> one, which runs the same three ufuncs
    into one fresh array instead of three (an LSTM step has five such gradients, a SiLU one):
    Mul(dY, Mul(Y, Sub(1, Y))) -> SigmoidGrad(dY, Y, 1); Mul(dY, Sub(1, Mul(Y, Y))) -> TanhGrad(dY, Y, 1)."""
    changed = False
    for outer in [n for n in g.nodes if n.op_type == "Mul" and n.domain in STANDARD]:
        match = _activation_grad_match(g, outer)
        if match is not None:
            op_type, inner, y, one = match
            fused = _fused_node(op_type, [outer.input[0], y, one], outer.output, f"fused/{outer.name or outer.output[0]}")
            changed = g.replace([*inner, outer], fused) or changed
    return changed


# fused op -> (the op producing the outer Mul's second input, the op producing that one's second input)
_ACTIVATION_GRADS = {"SigmoidGrad": ("Mul", "Sub"), "TanhGrad": ("Sub", "Mul")}


def _activation_grad_match(g: Graph, outer: onnx.NodeProto):
    """(fused op, the two inner nodes, Y, the constant 1) if ``outer`` ends one of the two rules."""
    for op_type, (first_op, second_op) in _ACTIVATION_GRADS.items():
        first = g.producer(outer.input[1], first_op)
        second = first and g.producer(first.input[1], second_op)
        if not (second and g.sole_reader(first.output[0], "Mul", 1) is outer
                and g.sole_reader(second.output[0], first_op, 1) is first):
            continue
        minus, product = (first, second) if first_op == "Sub" else (second, first)
        y = product.input[0]
        # Sigmoid: Mul(Y, Sub(1, Y)); Tanh: Sub(1, Mul(Y, Y))
        tail = minus.input[1] if op_type == "SigmoidGrad" else product.input[1]
        if tail == y and g.is_one(minus.input[0]):
            return op_type, [second, first], y, minus.input[0]
    return None


def _activation_grad_op(first_with_y: bool) -> Factory:
    """SigmoidGrad: t = 1 - Y; t = Y * t; dY * t. TanhGrad: t = Y * Y; t = 1 - t; dY * t. The same
    ufuncs on the same operands as the three nodes (a product or sum written into one of its
    own operands is the same product), so the same bits."""
    def factory(attrs: dict, opset: int) -> Callable[..., tuple]:
        mul, sub = _kernel("Mul", opset), _kernel("Sub", opset)

        def run(dY, Y, one):
            if dY.shape != Y.shape or dY.dtype != Y.dtype or Y.dtype not in (np.float32, np.float64) or one.dtype != Y.dtype:
                t = mul(Y, sub(one, Y)[0])[0] if first_with_y else sub(one, mul(Y, Y)[0])[0]
                return mul(dY, t)
            if first_with_y:
                t = np.subtract(one, Y)
                np.multiply(Y, t, out=t)
            else:
                t = np.multiply(Y, Y)
                np.subtract(one, t, out=t)
            np.multiply(dY, t, out=t)
            return (t,)

        return run
    return factory


fused_op("SigmoidGrad")(_activation_grad_op(first_with_y=True))
fused_op("TanhGrad")(_activation_grad_op(first_with_y=False))


# ---------------------------------------------------------------- dividing by a tensor's size


@fusion("divide_by_size")
def _divide_by_size(g: Graph) -> bool:
    """Div(a, CastLike(Size(x), like)) -> one node: the count is converted as a scalar instead of
    passing through two 0-d kernels (the mean loss's gradient scale, every step)."""
    changed = False
    for div in [n for n in g.nodes if n.op_type == "Div" and n.domain in STANDARD]:
        cast = g.producer(div.input[1], "CastLike")
        size = cast and g.producer(cast.input[0], "Size")
        if not (size and g.sole_reader(cast.output[0], "Div", 1) is div and g.sole_reader(size.output[0], "CastLike", 0) is cast):
            continue
        fused = _fused_node("DivideBySize", [div.input[0], size.input[0], cast.input[1]], div.output, f"fused/{div.name or div.output[0]}")
        changed = g.replace([size, cast, div], fused) or changed
    return changed


@fused_op("DivideBySize")
def _divide_by_size_op(attrs: dict, opset: int) -> Callable[..., tuple]:
    divide = _kernel("Div", opset)

    def run(a, x, like):
        # CastLike(Size(x)) is the int64 count rounded once to like's type: the same scalar
        return divide(a, np.asarray(x.size, dtype=like.dtype))

    return run


# ---------------------------------------------------------------- normalizations' training gradient


@fusion("normalization_grad")
def _normalization_grad(g: Graph) -> bool:
    """The training-mode gradient of BatchNormalization (grad/rules/nn.py, _batch_norm_training_grad:
    nine passes over X-sized data, and some fifteen small per-channel nodes), or of
    InstanceNormalization, whose rule has the same shape with statistics per (n, c) instance -> one
    node that runs the same kernels and ufuncs on the same operands, into two arrays of X's size
    instead of six."""
    changed = False
    for sub in [n for n in g.nodes if n.op_type == "Sub" and n.domain in STANDARD]:
        match = _match_normalization_grad(g, sub)
        if match is not None:
            nodes, inputs, outputs, attrs = match
            fused = _fused_node("NormalizationTrainingGrad", inputs, outputs, f"fused/{sub.name or sub.output[0]}", **attrs)
            changed = g.replace(nodes, fused) or changed
    return changed


class _Chain:
    """Walks producers from a node, remembering every node it passes, for one pattern match."""

    def __init__(self, g: Graph):
        self.g, self.nodes = g, []

    def __call__(self, name: str, op_type: str) -> onnx.NodeProto:
        node = self.g.producer(name, op_type)
        if node is None:
            raise LookupError(name)
        if all(node is not n for n in self.nodes):
            self.nodes.append(node)
        return node


def _match_normalization_grad(g: Graph, sub: onnx.NodeProto):
    """(nodes, inputs, outputs, attributes) if ``sub`` ends the rule's training gradient, else None.
    Every value inside stays inside, but d scale and sum(dY)."""
    walk = _Chain(g)
    try:
        p0, corr = walk(sub.input[0], "Mul"), walk(sub.input[1], "Add")
        ua, p1 = walk(p0.input[1], "Unsqueeze"), walk(corr.input[0], "Mul")
        ut, us = walk(p1.input[1], "Unsqueeze"), walk(corr.input[1], "Unsqueeze")
        tilt, shift = walk(ut.input[0], "Mul"), walk(us.input[0], "Mul")
        t2, t3 = walk(tilt.input[0], "Mul"), walk(shift.input[0], "Mul")
        a, t1 = walk(ua.input[0], "Mul"), walk(t2.input[1], "Mul")
        sum_dy, dscale = walk(t3.input[1], "ReduceSum"), walk(t1.input[1], "Mul")
        inv, e2 = walk(a.input[1], "Reciprocal"), walk(dscale.input[0], "Einsum")
        root = walk(inv.input[0], "Sqrt")
        shifted = walk(root.input[0], "Add")
        var = walk(shifted.input[0], "Mul")
        e1 = walk(var.input[0], "Einsum")
        centered = walk(e1.input[0], "Sub")
        mean = walk(centered.input[1], "ReduceMean")
    except LookupError:
        return None
    X, dY, c, count = centered.input[0], p0.input[0], centered.output[0], var.input[1]
    equation = node_attributes(e1).get("equation")
    same = [list(e1.input) == [c, c], list(e2.input) == [dY, c], node_attributes(e2).get("equation") == equation,
            list(p1.input) == [c, ut.output[0]], t2.input[0] == a.output[0], t3.input[0] == a.output[0],
            list(t1.input) == [inv.output[0], dscale.output[0]], dscale.input[1] == inv.output[0],
            tilt.input[1] == count and shift.input[1] == count, mean.input[0] == X, sum_dy.input[0] == dY,
            g.constant(shifted.input[1]) is not None, not _is_computed_inside(walk.nodes, count)]
    axes, reduced = g.ints(mean, 1, "axes"), g.ints(sum_dy, 1, "axes")
    spread = [g.ints(u, 1, "axes") for u in (ua, ut, us)]
    if not all(same) or not equation or axes is None or axes != reduced or spread[0] is None or any(s != spread[0] for s in spread) \
            or node_attributes(mean).get("keepdims", 1) != 1 or node_attributes(sum_dy).get("keepdims", 1) != 0 \
            or any(node_attributes(r).get("noop_with_empty_axes", 0) for r in (mean, sum_dy)):
        return None
    nodes = [*walk.nodes, sub]
    inside = {id(n) for n in nodes}
    leaving = (sub.output[0], dscale.output[0], sum_dy.output[0])
    if any(o not in leaving and (o in g.keep or any(id(r) not in inside for r in g.consumers(o))) for n in nodes for o in n.output):
        return None
    inputs = [X, dY, a.input[0], count, shifted.input[1]]
    return nodes, inputs, list(leaving), {"axes": axes, "equation": equation, "spread": spread[0]}


def _is_computed_inside(nodes: Sequence[onnx.NodeProto], name: str) -> bool:
    return any(name in n.output for n in nodes)


def _reducer(op_type: str, opset: int, axes: list[int], keepdims: int) -> Callable[[np.ndarray], np.ndarray]:
    """The ``op_type`` kernel in force at ``opset`` over ``axes``, however that version takes its
    axes (an input from ReduceSum-13 and ReduceMean-18 on, an attribute before)."""
    entry = lookup("", op_type, opset)
    if entry is None:
        raise AssertionError(f"fused op needs a kernel for {op_type} at opset {opset}")
    param = inspect.signature(entry.fn).parameters.get("axes")
    if param is not None and param.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
        as_input = np.asarray(axes, dtype=np.int64)
        return lambda x: entry.fn(x, as_input, keepdims=keepdims)[0]
    return lambda x: entry.fn(x, axes=list(axes), keepdims=keepdims)[0]


@fused_op("NormalizationTrainingGrad")
def _normalization_training_grad(attrs: dict, opset: int) -> Callable[..., tuple]:
    mean, total = _reducer("ReduceMean", opset, attrs["axes"], 1), _reducer("ReduceSum", opset, attrs["axes"], 0)
    einsum = _kernel("Einsum", opset, equation=attrs["equation"])
    sqrt, reciprocal = _kernel("Sqrt", opset), _kernel("Reciprocal", opset)
    spread = attrs["spread"]

    def along_channels(ufunc, x, v, out=None, *, kept=False):
        """ufunc(x, Unsqueeze(v, spread)), or ufunc(x, v) for a ``kept`` (keepdims) statistic."""
        if list(spread) == [0, *range(2, x.ndim)]:  # BatchNormalization's: one value per channel
            return per_channel(ufunc, x, v, out=out)
        # InstanceNormalization's rule has the same shape, with one value per (n, c) instance
        return ufunc(x, v if kept else np.expand_dims(v, tuple(spread)), out=out)

    def run(X, dY, scale, count, eps):
        if dY.shape != X.shape or dY.dtype != X.dtype:
            raise AssertionError("NormalizationTrainingGrad: dY does not have X's shape and type")
        # one line per node of the rule, in its order; the two arrays of X's size are c and out
        c = along_channels(np.subtract, X, mean(X), kept=True)
        inv = reciprocal(sqrt(np.add(np.multiply(einsum(c, c)[0], count), eps))[0])[0]
        sum_dy = total(dY)
        dscale = np.multiply(einsum(dY, c)[0], inv)
        a = np.multiply(scale, inv)
        tilt = np.multiply(np.multiply(a, np.multiply(inv, dscale)), count)
        shift = np.multiply(np.multiply(a, sum_dy), count)
        correction = along_channels(np.multiply, c, tilt, out=c)
        along_channels(np.add, correction, shift, out=correction)
        out = along_channels(np.multiply, dY, a)
        return np.subtract(out, correction, out=out), dscale, sum_dy

    return run
