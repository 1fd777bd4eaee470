"""A static-batch export made to run at any batch.

An export without a dynamic batch axis bakes the batch it was traced with (``B``) into
constants: Expand's, Tile's and ConstantOfShape's shape inputs (``x.expand(B, ...)``,
``x.repeat(B, 1)``, ``torch.zeros(B, ...)``, an LSTM's default state), float constants our own
folding made of those, and Reshape targets (``[T, B*heads, d]``). Once the inputs' batch is
symbolic these would keep computing for ``B``. A constant that equals ``B`` is not always the
batch, though: 3 heads at a batch of 3 look the same. So the role of each is read from the data
flow, never from its value alone:

- Each shape element equal to ``B`` (and each axis of length ``B`` of a folded float constant,
  uniform along it) is first made a fresh symbol, a *probe*, by rewriting its constant into a
  Concat around ``Shape(probe input)``. Shape inference carries the probes; then every node that
  requires two dims to be equal (broadcasting elementwise ops, Expand itself, Concat's other
  axes, MatMul's and Gemm's contraction and batch axes) unifies them: a probe meeting the batch
  symbol is the batch, one meeting a number is that number. Probes meeting each other share
  their fate. A probe that meets neither cannot be decided, and the load stops with
  StaticBatchError naming its node. Batch probes then read ``Shape(input)[batch axis]``, number
  probes become their constant again (folding restores the original node).
- Reshape targets are matched against their input's symbolic shape by row-major blocks (the
  runs of dims whose products agree): the one target element in the block that holds the batch
  becomes -1 (0 where it copies the same axis), the others their numbers; a block where two
  elements could hold it stops the load, naming the node.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from odt_ops.domain import is_default
from odt_ops.errors import StaticBatchError
from odt_ops.ir import symbolic
from odt_ops.ir.model import Model
from odt_ops.ir.passes import replace_nodes

PROBE = "odt_batch_probe_"
_SHAPE_INPUT = {"Expand": 1, "Tile": 1, "ConstantOfShape": 0}  # op -> its shape-valued input
_BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Where", "Equal", "Less", "Greater", "LessOrEqual",
                           "GreaterOrEqual", "And", "Or", "Xor", "Max", "Min", "Sum", "Mean", "PRelu"})
_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})

Infer = Callable[[Model], None]


def export_batch(model: Model) -> int | None:
    """The static batch every data input (rank >= 2) was exported with, when they agree and it is
    above 1 (at 1, a baked batch cannot be told from a broadcast dim); None otherwise."""
    dims = []
    for value in model.graph.input:
        tt = value.type.tensor_type
        if not tt.HasField("shape") or len(tt.shape.dim) < 2:
            continue
        dim = tt.shape.dim[model.batch_axes.get(value.name, 0)]
        if not dim.HasField("dim_value"):
            return None
        dims.append(dim.dim_value)
    return dims[0] if dims and len(set(dims)) == 1 and dims[0] > 1 else None


def free_baked_batch(model: Model, batch: int, infer: Infer, name: str = "batch") -> bool:
    """Rewrite the constants that hold the export's ``batch`` so that the model runs at any batch
    (``name`` is the inputs' symbolic batch dim, already set). ``infer`` re-infers shapes in place."""
    source = _batch_source(model)
    if source is None:
        return False
    declared = [onnx.ValueInfoProto.FromString(o.SerializeToString()) for o in model.graph.output]
    probes = _probe_row_inputs(model, batch) + _place_probes(model, batch)
    changed = bool(probes)
    done: set[str] = set()  # Reshapes re-targeted (or found right) already
    while probes:  # each round's decisions give the next round's inference the batch where a probe was
        infer(model)
        decided = _decide(model, probes, name, weak=False)
        if not decided and _fix_reshapes(model, batch, infer, name, done):
            changed = True
            continue  # the re-targeted Reshapes may carry the batch to more probes
        if not decided:
            infer(model)  # _fix_reshapes leaves no inferred shapes behind
            weakly = _decide(model, probes, name, weak=True)
            # one at a time, the first in the graph: its number may have come from a later constant
            # not yet re-targeted, and deciding the first may give the rest strong evidence
            decided = dict(list(weakly.items())[:1])
        if not decided and any(p.is_input for p in probes):
            decided = {p.dim: False for p in probes if p.is_input}  # a rank-1 input nothing ties to the batch: as exported
        if not decided:
            probe = probes[0]
            raise StaticBatchError(
                f"node {probe.node!r} holds {batch}, the batch this model was exported with, in a constant shape, and "
                "nothing downstream tells whether it is the batch or a model size that equals it; export the model with "
                "a dynamic batch axis (torch.onnx.export(..., dynamic_axes={input: {0: 'batch'}}))")
        _settle(model, [p for p in probes if p.dim in decided], decided, source, batch, name)
        probes = [p for p in probes if p.dim not in decided]
    changed = _fix_reshapes(model, batch, infer, name, done) or changed
    del model.graph.value_info[:]  # the load's inference writes the dims in their usual form
    del model.graph.output[:]  # as symbolic_batch_dim left them: the rounds above inferred some from the old constants
    model.graph.output.extend(declared)
    return changed


# ---------------------------------------------------------------------------- probes


class _Probe:
    """One constant element (or constant axis) that equals the export batch."""

    __slots__ = ("node", "dim", "value", "data", "position", "length", "is_input")

    def __init__(self, node: str, dim: str, value: str, data: str | None, position: int, length: int, is_input: bool = False):
        # value: the probe's 1-element int64 tensor; for a rank-1 graph input of the batch's length
        # (per-row lengths), the input itself, whose dim is the probe
        self.node, self.dim, self.value, self.is_input = node, dim, value, is_input
        # Expand's data input, and the probe's index in a target of ``length`` dims: the Expand's
        # own broadcast of its data decides too
        self.data, self.position, self.length = data, position, length


def _probe_row_inputs(model: Model, batch: int) -> list[_Probe]:
    """Rank-1 graph inputs as long as the batch (an RNN's per-row lengths) get a probe dim: the
    load gives a symbolic batch to inputs of rank >= 2 only."""
    probes: list[_Probe] = []
    for value in model.graph.input:
        tt = value.type.tensor_type
        if tt.HasField("shape") and len(tt.shape.dim) == 1 and tt.shape.dim[0].dim_value == batch:
            dim = f"{PROBE}input_{len(probes)}"
            tt.shape.dim[0].Clear()
            tt.shape.dim[0].dim_param = dim
            probes.append(_Probe(value.name, dim, value.name, None, 0, 1, is_input=True))
    return probes


def _batch_source(model: Model) -> tuple[str, int] | None:
    for value in model.graph.input:
        tt = value.type.tensor_type
        if tt.HasField("shape") and len(tt.shape.dim) >= 2:
            return value.name, model.batch_axes.get(value.name, 0)
    return None


def _place_probes(model: Model, batch: int) -> list[_Probe]:
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    taken = {t.name for t in graph.initializer} | {v.name for v in graph.input} | {o for n in graph.node for o in n.output}
    taken |= {n.name for n in graph.node}
    probes: list[_Probe] = []
    added_nodes: list[tuple[int, onnx.NodeProto]] = []  # (insert before this node index, node)

    def fresh(hint: str) -> str:
        name, k = hint, 0
        while name in taken:
            k += 1
            name = f"{hint}_{k}"
        taken.add(name)
        return name

    def probe_dim(where: str, at: int, data: str | None, position: int, length: int) -> str:
        """A 1-element int64 value holding a fresh probe symbol: Shape of a new graph input."""
        k = len(probes)
        graph.input.append(onnx.helper.make_tensor_value_info(f"{PROBE}{k}", onnx.TensorProto.FLOAT, [f"{PROBE}{k}"]))
        out = fresh(f"{where}/batch_dim_{k}")
        node = onnx.helper.make_node("Shape", [f"{PROBE}{k}"], [out], name=fresh(f"{where}/BatchShape_{k}"))
        added_nodes.append((at, node))
        probes.append(_Probe(where, f"{PROBE}{k}", out, data, position, length))
        return out

    def concat_of(values: np.ndarray, picks: list[int], where: str, at: int, data: str | None) -> str:
        """Concat of ``values`` with a probe at each index in ``picks``."""
        parts: list[str] = []
        run: list[int] = []
        for i, v in enumerate(values.tolist()):
            if i in picks:
                if run:
                    parts.append(_const(graph, fresh(f"{where}/dims"), run))
                    run = []
                parts.append(probe_dim(where, at, data, i, len(values)))
            else:
                run.append(int(v))
        if run:
            parts.append(_const(graph, fresh(f"{where}/dims"), run))
        out = fresh(f"{where}/shape_with_batch")
        added_nodes.append((at, onnx.helper.make_node("Concat", parts, [out], name=fresh(f"{where}/ConcatBatch"), axis=0)))
        return out

    for index, node in enumerate(graph.node):
        slot = _SHAPE_INPUT.get(node.op_type)
        if slot is None or not is_default(node.domain) or len(node.input) <= slot or node.input[slot] not in initializers:
            continue
        values = numpy_helper.to_array(initializers[node.input[slot]])
        if values.ndim != 1 or values.dtype.kind not in "iu":
            continue
        picks = [i for i, v in enumerate(values.tolist()) if v == batch]
        if picks:
            data = node.input[0] if node.op_type == "Expand" else None
            node.input[slot] = concat_of(values, picks, node.name, index, data)

    used = {n for node in graph.node for n in node.input}
    folded = [t for t in graph.initializer if t.name in model.derived and t.data_type in _FLOATS and batch in t.dims
              and t.name in used and t.data_location != onnx.TensorProto.EXTERNAL]
    for tensor in folded:  # torch.zeros(B, ...), folded by our load: Expand of one slice
        array = numpy_helper.to_array(tensor)
        axes = [a for a, d in enumerate(array.shape) if d == batch and _uniform_along(array, a)]
        if not axes:
            continue
        one = array[tuple(slice(0, 1) if a in axes else slice(None) for a in range(array.ndim))]
        where = tensor.name
        slice_name = fresh(f"{where}/one_per_batch")
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(one), slice_name))
        model.derived.add(slice_name)
        shape = concat_of(np.array(array.shape, dtype=np.int64), axes, where, 0, None)
        added_nodes.append((0, onnx.helper.make_node("Expand", [slice_name, shape], [tensor.name], name=fresh(f"{where}/ExpandBatch"))))
        graph.initializer.remove(tensor)
    if not probes:
        return probes
    replace_nodes(model, _stable_insert(list(graph.node), added_nodes))
    del model.graph.value_info[:]
    return probes


def _stable_insert(nodes: list[onnx.NodeProto], added: list[tuple[int, onnx.NodeProto]]) -> list[onnx.NodeProto]:
    before: dict[int, list[onnx.NodeProto]] = {}
    for at, node in added:
        before.setdefault(at, []).append(node)
    out: list[onnx.NodeProto] = []
    for i, node in enumerate(nodes):
        out.extend(before.pop(i, []))
        out.append(node)
    for rest in before.values():
        out.extend(rest)
    return out


def _const(graph: onnx.GraphProto, name: str, values: list[int]) -> str:
    graph.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.int64), name))
    return name


def _uniform_along(array: np.ndarray, axis: int) -> bool:
    return bool(np.all(array == np.take(array, [0], axis=axis)))


# ---------------------------------------------------------------------------- deciding


class _Roles:
    """Union-find over probes, with what each class of probes met: the batch symbol (strong: an
    op that needs two dims equal at every batch), or a number (weak: it may come from a Reshape
    target not yet re-targeted, which still holds the export batch)."""

    def __init__(self, probes: list[_Probe]):
        self.parent = {p.dim: p.dim for p in probes}
        self.met: dict[str, set[bool]] = {p.dim: set() for p in probes}  # True: the batch, False: a number

    def root(self, dim: str) -> str:
        while self.parent[dim] != dim:
            self.parent[dim] = self.parent[self.parent[dim]]
            dim = self.parent[dim]
        return dim

    def set(self, dim: str, role: bool) -> None:
        self.met[self.root(dim)].add(role)

    def join(self, a: str, b: str) -> None:
        ra, rb = self.root(a), self.root(b)
        if ra != rb:
            self.parent[rb] = ra
            self.met[ra] |= self.met.pop(rb)

    def role(self, dim: str, *, weak: bool) -> bool | None:
        met = self.met[self.root(dim)]
        if True in met:
            return True
        return False if weak and False in met else None


def _decide(model: Model, probes: list[_Probe], name: str, *, weak: bool) -> dict[str, bool]:
    """Probe -> is it the batch, for the probes the data flow decides (numbers only when ``weak``)."""
    graph = model.graph
    shapes = {v.name: symbolic.type_dims(v.type) for v in (*graph.input, *graph.value_info, *graph.output)}
    shapes.update({t.name: list(t.dims) for t in graph.initializer})
    roles = _Roles(probes)

    def unify(a, b, node: onnx.NodeProto) -> None:
        """Two dims an op needs equal; either may be k*probe (a Reshape followed the probe)."""
        ma, mb = symbolic.parse_dim(a), symbolic.parse_dim(b)
        if ma is None or mb is None:
            return
        for (cx, sx), (cy, sy) in ((ma, mb), (mb, ma)):
            if len(sx) == 1 and sx[0] in roles.parent:
                if len(sy) == 1 and sy[0] in roles.parent and cx == cy:
                    roles.join(sx[0], sy[0])
                elif sy == (name,) and cx == cy:
                    roles.set(sx[0], True)
                elif not sy and cy != 1:
                    roles.set(sx[0], False)
                return

    for probe in probes:  # Expand(data, shape): a probe facing a data dim other than 1 is that dim
        data = shapes.get(probe.data) if probe.data else None
        if data is not None:
            at = probe.position + len(data) - probe.length  # right-aligned, as broadcasting aligns
            if 0 <= at < len(data) and data[at] != 1:
                unify(probe.dim, data[at], _node_making(graph, probe.value))
    for node in graph.node:
        if not is_default(node.domain):
            continue
        ins = [shapes.get(n) if n else None for n in node.input]
        op = node.op_type
        if op in _BROADCASTING:
            known = [s for s in ins if s is not None]
            for other in known[1:]:
                _broadcast_pairs(known[0], other, lambda x, y, at=node: unify(x, y, at))
        elif op == "Concat" and ins and all(s is not None for s in ins):
            joined = [s for s in ins if s is not None]
            rank = len(joined[0])
            axis = symbolic.attribute(node, "axis", 0) % max(rank, 1)
            for other in joined[1:]:
                if len(other) == rank:
                    for i in range(rank):
                        if i != axis:
                            unify(joined[0][i], other[i], node)
        elif op == "MatMul" and len(ins) == 2:
            left, right = ins
            if left is not None and right is not None and len(left) >= 2 and len(right) >= 2:
                unify(left[-1], right[-2], node)
                _broadcast_pairs(left[:-2], right[:-2], lambda x, y, at=node: unify(x, y, at))
        elif op in ("InstanceNormalization", "BatchNormalization") and ins and ins[0] is not None and len(ins[0]) >= 2:
            for stat in ins[1:]:  # scale, bias (, mean, var): one per channel
                if stat is not None and len(stat) == 1:
                    unify(stat[0], ins[0][1], node)
        elif op == "LayerNormalization" and ins and ins[0] is not None:
            for stat in ins[1:]:
                if stat is not None:
                    _broadcast_pairs(ins[0], stat, lambda x, y, at=node: unify(x, y, at))
        elif op == "Reshape" and ins and ins[0] is not None and name in ins[0]:
            for d in ins[0]:  # its input holds the batch already: a probe beside it is a size (weak)
                if isinstance(d, str) and d in roles.parent:
                    roles.set(d, False)
        elif op == "Gemm":
            left, right = ins[0], ins[1]
            if left is not None and right is not None and len(left) == 2 and len(right) == 2:
                unify(left[0] if symbolic.attribute(node, "transA", 0) else left[1], right[1] if symbolic.attribute(node, "transB", 0) else right[0], node)
    roles_of = {p.dim: roles.role(p.dim, weak=weak) for p in probes}
    return {dim: role for dim, role in roles_of.items() if role is not None}


def _node_making(graph: onnx.GraphProto, value: str) -> onnx.NodeProto:
    return next(n for n in graph.node if value in n.output)


def _broadcast_pairs(a: list, b: list, pair: Callable) -> None:
    for x, y in zip(reversed(a), reversed(b)):
        if x != 1 and y != 1:
            pair(x, y)


def _settle(model: Model, probes: list[_Probe], decided: dict[str, bool], source: tuple[str, int], batch: int,
            name: str) -> None:
    """Batch probes read the input's batch; the others become their number again."""
    graph = model.graph
    for value in graph.input:  # rank-1 inputs: their dim is the batch, or the number it was
        probe = next((p for p in probes if p.is_input and p.value == value.name), None)
        if probe is not None:
            dim = value.type.tensor_type.shape.dim[0]
            dim.Clear()
            if decided[probe.dim]:
                dim.dim_param = name
            else:
                dim.dim_value = batch
    probes = [p for p in probes if not p.is_input]
    data, axis = source
    batch_value = f"{data}/odt_batch_dim"
    needed = False
    constants = {p.value for p in probes if not decided[p.dim]}
    for probe in probes:
        if decided[probe.dim]:
            node = _node_making(graph, probe.value)
            node.op_type = "Identity"
            node.input[:] = [batch_value]
            needed = True
    nodes = [n for n in graph.node if n.output[0] not in constants]
    if needed and not any(batch_value in n.output for n in nodes):
        shape, index = f"{data}/shape", f"{data}/batch_axis"
        graph.initializer.append(numpy_helper.from_array(np.array([axis], dtype=np.int64), index))
        nodes[:0] = [onnx.helper.make_node("Shape", [data], [shape], name=f"{data}/Shape_for_batch"),
                     onnx.helper.make_node("Gather", [shape, index], [batch_value], name=f"{data}/Gather_batch", axis=0)]
    for name in constants:
        graph.initializer.append(numpy_helper.from_array(np.array([batch], dtype=np.int64), name))
    replace_nodes(model, nodes)
    graph = model.graph
    settled = {p.dim for p in probes}
    inputs = [v for v in graph.input if v.name not in settled]
    del graph.input[:]
    graph.input.extend(inputs)
    del graph.value_info[:]
    model.forget_arrays()


# ---------------------------------------------------------------------------- Reshape targets


def _fix_reshapes(model: Model, batch: int, infer: Infer, name: str, done: set[str]) -> bool:
    """Reshape targets that hold the batch, made to follow it; one round per chain of Reshapes
    (each round's inference gives the next Reshape its input's symbolic shape). A merged dim's
    output is written as ``major*batch*minor``, so that a later split of it knows where in the
    dim the batch lies (a monomial ``k*batch`` does not say)."""
    written: dict[str, tuple[int, list]] = {}  # Reshape output -> (element type, dims)
    changed = False
    for _ in range(sum(n.op_type in ("Reshape", "Concat") for n in model.graph.node) + 1):
        graph = model.graph
        for out, (elem, dims) in written.items():
            graph.value_info.append(onnx.helper.make_tensor_value_info(out, elem, dims))
        infer(model)
        graph = model.graph
        types = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
        shapes = {k: d for k, t in types.items() if (d := symbolic.type_dims(t)) is not None}
        initializers = {t.name: t for t in graph.initializer}
        progress = False
        for node in graph.node:  # an unrolled recurrence's T steps of [batch, H] joined: T*batch, batch minor
            if node.op_type != "Concat" or node.output[0] in written or not all(i in shapes for i in node.input):
                continue
            parts = [shapes[i] for i in node.input]
            axis = symbolic.attribute(node, "axis", 0) % max(len(parts[0]), 1)
            if len(parts) > 1 and all(len(p) == len(parts[0]) and p[axis] == name for p in parts):
                dims = list(parts[0])
                dims[axis] = f"{len(parts)}*{name}*1"
                written[node.output[0]] = (types[node.input[0]].tensor_type.elem_type, dims)
                progress = True
        follow = {n.name: sym for n in graph.node if n.op_type == "Reshape" and n.name not in done and n.input[1] in initializers
                  and n.input[0] in shapes and (sym := _followed(shapes[n.input[0]], name)) is not None}
        ready = [n for n in graph.node if n.name in follow]
        # a k*batch dim that says nothing of its order may be one a Reshape of this round writes: wait a round
        known = [n for n in ready
                 if all(f is None or f[1] is not None for f in (_batch_factor(d, follow[n.name]) for d in shapes[n.input[0]]))]
        for node in known or ([] if progress else ready):
            dims = shapes[node.input[0]]
            target = numpy_helper.to_array(initializers[node.input[1]]).astype(np.int64)
            fixed = _reshape_target(node, dims, target.tolist(), batch, follow[node.name],
                                    allowzero=bool(symbolic.attribute(node, "allowzero", 0)))
            if fixed is None:
                continue
            done.add(node.name)
            values, out_dims = fixed
            written[node.output[0]] = (types[node.input[0]].tensor_type.elem_type, out_dims)
            if values != target.tolist():
                new = f"{node.input[1]}/{node.name}/follows_batch"
                graph.initializer.append(numpy_helper.from_array(np.array(values, dtype=np.int64), new))
                node.input[1] = new
                changed = True
            progress = True
        del graph.value_info[:]
        model.forget_arrays()
        if not progress:
            break
    return changed


def _followed(dims: list, name: str) -> str | None:
    """The symbol a Reshape of ``dims`` re-targets for: the batch, else a probe (undecided yet:
    a -1 in its place is right whether it turns out the batch or the number), else None."""
    symbols = {s for d in dims if (m := symbolic.parse_dim(d)) is not None for s in m[1]}
    if name in symbols:
        return name
    probes = [s for s in symbols if s.startswith(PROBE)]
    return probes[0] if len(probes) == 1 else None


def _batch_factor(dim, name: str) -> tuple[int, int | None] | None:
    """(coefficient, major) of a dim that holds the batch once: major is the product of the
    factors before the batch in it (``3*batch*2``: 3), None when the dim does not say."""
    if dim == name:
        return 1, 1
    if isinstance(dim, str):
        parts = dim.split("*")
        if len(parts) == 3 and parts[1] == name and parts[0].isdigit() and parts[2].isdigit():
            return int(parts[0]) * int(parts[2]), int(parts[0])
    m = symbolic.parse_dim(dim)
    return (m[0], None) if m is not None and m[1] == (name,) else None


def _reshape_target(node: onnx.NodeProto, dims: list, target: list[int], batch: int, name: str, *,
                    allowzero: bool) -> tuple[list[int], list] | None:
    """(the target that follows the batch, the output's dims), or None to leave the node be."""
    values, carry, major = [], None, None
    for i, d in enumerate(dims):
        factor = _batch_factor(d, name)
        m = symbolic.parse_dim(d)
        if factor is not None and carry is None:
            values.append(factor[0] * batch)
            carry, major = i, factor[1]
        elif m is not None and m[1] == ():
            values.append(m[0])
        else:
            return None  # unknown, the batch twice, or another symbol: leave it to run time
    if carry is None:
        return None
    copied = [i for i, v in enumerate(target) if v == 0 and not allowzero]
    export = [values[i] if i in copied and i < len(values) else v for i, v in enumerate(target)]
    if -1 in export:
        k = export.index(-1)
        rest = math.prod(v for i, v in enumerate(export) if i != k)
        if not rest:
            return None
        export[k] = math.prod(values) // rest
    if math.prod(export) != math.prod(values):
        return None
    before = math.prod(values[:carry])
    bounds = [math.prod(export[:j]) for j in range(len(export) + 1)]
    if major is not None:  # row-major: the batch spans [start, start * batch) of the flat index's strides
        start = before * major
        holders = [j for j in range(len(export)) if bounds[j] <= start and bounds[j + 1] >= start * batch
                   and start % bounds[j] == 0 and bounds[j + 1] % (start * batch) == 0]
    else:  # where in a k*batch dim the batch lies is unknown: a unique size divisible by it, in its block
        after = before * values[carry]
        common = {math.prod(values[:i]) for i in range(len(values) + 1)} & set(bounds)
        low, high = max(b for b in common if b <= before), min(b for b in common if b >= after)
        holders = [j for j in range(len(export)) if low <= bounds[j] and bounds[j + 1] <= high and export[j] % batch == 0]
    if len(holders) != 1:
        raise StaticBatchError(
            f"Reshape node {node.name!r} reshapes {dims} to the constant {target}, made for the export's batch {batch}: "
            f"{'several' if holders else 'none'} of its sizes could hold the batch; export the model with a dynamic batch "
            "axis (dynamic_axes={input: {0: 'batch'}})")
    j = holders[0]
    fixed = list(export)
    same_axis = j == carry and bounds[j] == before and export[j] == values[carry] and not allowzero
    fixed[j] = 0 if same_axis else -1
    out: list = list(export)
    if same_axis:
        out[j] = dims[carry]
    else:
        outer = (before * major) // bounds[j] if major is not None else None
        inner = export[j] // (batch * outer) if outer else None
        out[j] = None if not outer else name if outer == inner == 1 else f"{outer}*{name}*{inner}"
    for i in copied:  # the other copies keep copying (their numbers are the same)
        if i != j and not allowzero:
            fixed[i] = 0
    return fixed, out


__all__ = ["PROBE", "export_batch", "free_baked_batch"]
