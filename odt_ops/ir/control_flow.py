"""Control flow (If, Loop, Scan) lowered at load time where the trip counts and branches are
known, so training sees plain nodes; the graph reads (which outer values a subgraph reads)
are odt_ops/ir/graph.py.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import numpy as np
import onnx
from onnx import helper, numpy_helper

from odt_ops.domain import is_default
from odt_ops.ir import passes
from odt_ops.ir.binding import bind_kernel
from odt_ops.ir.builder import unique_name
from odt_ops.ir.graph import AT, all_nodes, implicit_inputs, node_reads, producers, subgraphs, topological_order
from odt_ops.ir.model import Model

# ---- lowering at load -------------------------------------------------------------------------

CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
MAX_UNROLLED_NODES = 200_000  # a Loop or Scan that would grow the graph beyond this stays a node
_SMALL = 4096  # the constant evaluator deciding a Loop's condition reads values up to this size


def lower_control_flow(model: Model) -> bool:
    """Rewrite control flow into plain ops where that can be decided at load, so every existing
    kernel and gradient rule applies and the artifacts stay standard ONNX:

    - an If whose condition is a constant becomes its taken branch;
    - a Loop whose trip count (M, and a condition that constant evaluation decides at every
      iteration) is static, and a Scan whose sequence length is static, are unrolled: one copy
      of the body per iteration, scan outputs stacked with Unsqueeze and Concat;
    - an If whose condition is computed at run time and whose branches read floating-point
      values runs both branches and selects with Where, when the branches give outputs of the
      same type and shape.

    Rewritten nodes may expose nested control flow, so this repeats until nothing changes.
    What remains runs through the kernels (odt_ops/kernels/control_flow.py). A remaining Scan
    over axis 0 becomes the Loop it means; a remaining Loop has a gradient rule of its own
    (odt_ops/grad/rules/control_flow.py: the body's gradient run backwards over the saved
    iterations); an If or other Scan has none: its reason is put in the node's doc_string
    and warned about. The outer floating-point values a remaining Loop or
    Scan reads become explicit loop-carried inputs, so the gradient walker (which sees node
    inputs only) finds the node on the path to a parameter, and the Loop rule differentiates
    them as carried values.
    """
    if not any(_is_control_flow(n) for n in model.graph.node):
        return False

    changed = False
    while True:
        with _inferred_value_info(model):
            passes.fold_constants(model)  # conditions and trip counts computed from constants and static shapes
        rewriter = _Rewriter(model)
        if not rewriter.sweep():
            break
        passes.inline_constant_nodes(model)  # the bodies' Constant nodes, now top-level
        changed = True
    changed |= _concat_built_sequences(model)
    changed |= _scans_as_loops(model)
    _Rewriter(model).explain_remaining()
    return changed


def _scans_as_loops(model: Model) -> bool:
    """A Scan left after lowering (its length known only at run time) becomes the Loop it
    means, which has a gradient rule: M = the scan inputs' length, and the body gathers each
    x[t] itself (``Gather(xs, i)``). Only Scans over axis 0, forwards, with outputs stacked
    along axis 0 (what the defaults say and exporters write); others stay Scans."""
    if model.opset < 11:  # Loop-11's body may read outer values and its M may be a computed scalar
        return False
    graph = model.graph
    taken = {v.name for v in (*graph.input, *graph.output, *graph.value_info)} | {t.name for t in graph.initializer}
    taken |= {o for n in all_nodes(graph.node) for o in (*n.input, *n.output)} | {n.name for n in all_nodes(graph.node)}
    nodes, changed = [], False
    for node in graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.type != AT.GRAPH}
        m = attrs.get("num_scan_inputs", 0)
        if node.op_type != "Scan" or not is_default(node.domain) or any(
                any(attrs.get(k) or []) for k in ("scan_input_axes", "scan_input_directions", "scan_output_axes",
                                                   "scan_output_directions")):
            nodes.append(node)
            continue
        body = _attr_graph(node, "body")
        n = len(node.input) - m
        xs = list(node.input[n:])
        label = node.name or node.output[0]
        zero = unique_name(f"{label}/axis0", taken)
        graph.initializer.append(numpy_helper.from_array(np.array(0, np.int64), zero))
        shape, length = unique_name(f"{label}/shape", taken), unique_name(f"{label}/length", taken)
        nodes += [helper.make_node("Shape", [xs[0]], [shape], name=shape),
                  helper.make_node("Gather", [shape, zero], [length], name=length)]
        step, go, go_out = (unique_name(f"{label}/{hint}", taken) for hint in ("t", "cond", "cond_out"))
        gathers = [helper.make_node("Gather", [x, step], [formal.name], name=unique_name(f"{label}/{formal.name}/at_t", taken), axis=0)
                   for x, formal in zip(xs, body.input[n:])]
        loop_body = helper.make_graph(
            [*gathers, *body.node, helper.make_node("Identity", [go], [go_out], name=go_out)], body.name or "scan_body",
            [helper.make_tensor_value_info(step, onnx.TensorProto.INT64, []), helper.make_tensor_value_info(go, onnx.TensorProto.BOOL, []),
             *body.input[:n]],
            [helper.make_tensor_value_info(go_out, onnx.TensorProto.BOOL, []), *body.output], list(body.initializer))
        loop_body.value_info.extend(body.value_info)
        nodes.append(helper.make_node("Loop", [length, "", *node.input[:n]], list(node.output), name=node.name, body=loop_body))
        changed = True
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
        model.forget_arrays()
    return changed


def _concat_built_sequences(model: Model) -> bool:
    """ConcatFromSequence of a sequence built tensor by tensor (SequenceEmpty or SequenceConstruct,
    then SequenceInserts that append), as an unrolled loop leaves it (the dynamo exporter's
    EmbeddingBag), becomes a Concat of those tensors; the sequence ops, then unread, are pruned."""
    graph = model.graph
    producer = producers(graph.node)
    changed = False
    for node in graph.node:
        if node.op_type != "ConcatFromSequence" or not is_default(node.domain):
            continue
        parts, seq = [], node.input[0]
        while True:
            src = producer.get(seq)
            if src is None:
                break
            if src.op_type == "Identity":
                seq = src.input[0]
                continue
            if src.op_type == "SequenceInsert" and (len(src.input) < 3 or not src.input[2]):
                parts.append(src.input[1])
                seq = src.input[0]
                continue
            if src.op_type in ("SequenceEmpty", "SequenceConstruct"):
                parts.extend(reversed(src.input))
                seq = None
            break
        if seq is not None or not parts:
            continue
        parts.reverse()
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axis = attrs.get("axis")
        if not isinstance(axis, int):  # required by the spec; onnx.checker refuses a node without it before this pass
            continue
        if attrs.get("new_axis", 0):
            grown, axes = [], None
            if model.opset >= 13:
                axes = numpy_helper.from_array(np.array([axis], np.int64), f"{node.name}/axes")
                while axes.name in {t.name for t in graph.initializer}:
                    axes.name += "_"
                graph.initializer.append(axes)
                model.derived.add(axes.name)
            for i, part in enumerate(parts):
                grown.append(f"{node.name}/{i}/unsqueezed")
                graph.node.append(_unsqueeze(part, axes and axes.name, axis, grown[-1], f"{node.name}/Unsqueeze_{i}"))
            parts = grown
        node.op_type = "Concat"
        del node.input[:]
        node.input.extend(parts)
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("axis", axis))
        changed = True
    if changed:

        passes.replace_nodes(model, topological_order(graph.node, {i.name for i in graph.input} | {t.name for t in graph.initializer}))
    return changed


def _is_control_flow(node: onnx.NodeProto) -> bool:
    return node.op_type in CONTROL_FLOW and is_default(node.domain)


@contextlib.contextmanager
def _inferred_value_info(model: Model) -> Iterator[None]:
    """Within, the graph's value_info holds what shape inference knows (so folding sees static
    shapes of intermediate values); the original value_info comes back afterwards."""
    graph = model.graph
    saved = [onnx.ValueInfoProto() for _ in graph.value_info]
    for dst, src in zip(saved, graph.value_info):
        dst.CopyFrom(src)
    inferred = _infer(model)
    if inferred is not None:
        del model.graph.value_info[:]
        model.graph.value_info.extend(inferred.graph.value_info)
    try:
        yield
    finally:
        del model.graph.value_info[:]
        model.graph.value_info.extend(saved)


def _infer(model: Model) -> onnx.ModelProto | None:
    """Shape inference on a light copy: initializers that are large or external are stood in for
    by typed graph inputs, and inputs of rank >= 2 have a symbolic first dimension, as loading
    later gives them: a shape or trip count that depends on the batch is not taken for a
    constant (folding it would fix the batch size). None when inference fails (the load's own
    inference names the fault)."""
    graph = model.graph
    light = onnx.ModelProto()
    light.ir_version = max(model.proto.ir_version, 4)
    light.opset_import.extend(model.proto.opset_import)
    g = light.graph
    g.name = graph.name
    g.node.extend(graph.node)
    g.input.extend(graph.input)
    g.output.extend(graph.output)  # the exporter's value_info, shaped for its batch, stays out
    for value, rank in [*((v, 2) for v in g.input), *((v, 1) for v in g.output)]:
        tt = value.type.tensor_type
        if tt.HasField("shape") and len(tt.shape.dim) >= rank:
            tt.shape.dim[0].Clear()
            tt.shape.dim[0].dim_param = "batch"
    inputs = {i.name for i in graph.input}
    for t in graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or int(np.prod(t.dims, dtype=np.int64)) > _SMALL:
            if t.name not in inputs:
                g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            g.initializer.append(t)
    try:
        return onnx.shape_inference.infer_shapes(light, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        return None


class _Cannot(Exception):
    """A node that cannot be lowered at load, and why."""


class _Rewriter:
    """One sweep over the top-level nodes, with what inference and the initializers tell."""

    def __init__(self, model: Model):
        self.model = model
        self.graph = model.graph
        self.opset = model.opset
        inferred = _infer(model)
        self.types: dict[str, onnx.TypeProto] = {v.name: v.type for v in self.graph.input}
        self.types.update({t.name: helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in self.graph.initializer})
        self.inferred_nodes: list[onnx.NodeProto] = list(self.graph.node)
        if inferred is not None:
            self.types.update({v.name: v.type for v in (*inferred.graph.value_info, *inferred.graph.output)})
            if len(inferred.graph.node) == len(self.graph.node):
                self.inferred_nodes = list(inferred.graph.node)
        self.initializers = {t.name: t for t in self.graph.initializer}
        self._values: dict[str, np.ndarray] = {}
        self.taken = _all_names(self.graph)
        self.new_initializers: list[onnx.TensorProto] = []

    # ---- facts --------------------------------------------------------------------------------
    def value(self, name: str, *, limit: int | None = None) -> np.ndarray | None:
        """The value of a constant (an initializer), else None."""
        t = self.initializers.get(name)
        if t is None or t.data_location == onnx.TensorProto.EXTERNAL:
            return None
        if limit is not None and int(np.prod(t.dims, dtype=np.int64)) > limit:
            return None
        if name not in self._values:
            self._values[name] = numpy_helper.to_array(t)
        return self._values[name]

    def is_float(self, name: str) -> bool:
        tp = self.types.get(name)
        return tp is None or not tp.HasField("tensor_type") or tp.tensor_type.elem_type in _FLOAT_TYPES

    def fresh(self, hint: str) -> str:
        return unique_name(hint, self.taken)

    def constant(self, value: np.ndarray, hint: str) -> str:
        name = self.fresh(hint)
        self.new_initializers.append(numpy_helper.from_array(np.asarray(value), name))
        self.model.derived.add(name)
        return name

    # ---- the sweep ----------------------------------------------------------------------------
    def sweep(self) -> bool:
        nodes: list[onnx.NodeProto] = []
        changed = False
        for node, inferred in zip(list(self.graph.node), self.inferred_nodes):
            if not _is_control_flow(node):
                nodes.append(node)
                continue
            added = len(self.new_initializers)
            try:
                lowered = getattr(self, f"_lower_{node.op_type.lower()}")(node, inferred)
            except _Cannot:
                lowered = None
                del self.new_initializers[added:]
            if lowered is None:
                nodes.append(node)
            else:
                nodes.extend(lowered)
                changed = True
        if changed:
            self._commit(nodes)
        return changed

    def _commit(self, nodes: list[onnx.NodeProto]) -> None:
        graph = self.graph
        if self.model.proto.ir_version < 4:  # IR 3 types initializers only as graph inputs: constants are nodes
            nodes = [helper.make_node("Constant", [], [t.name], name=self.fresh(f"{t.name}/Constant"), value=t)
                     for t in self.new_initializers] + nodes
        else:
            graph.initializer.extend(self.new_initializers)
        kept = [onnx.NodeProto() for _ in nodes]
        for dst, src in zip(kept, nodes):
            dst.CopyFrom(src)
        del graph.node[:]
        graph.node.extend(kept)
        self.model.forget_arrays()

    # ---- If -----------------------------------------------------------------------------------
    def _lower_if(self, node: onnx.NodeProto, inferred: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        branches = {a.name: a.g for a in node.attribute if a.type == AT.GRAPH}
        cond = self.value(node.input[0], limit=1)
        out: list[onnx.NodeProto] = []
        if cond is not None:
            taken = branches["then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"]
            results = self._inline(taken, {}, f"{node.name}/{taken.name or 'branch'}", out)
            out.extend(self._bind_outputs(node, results))
            return out
        # computed at run time: both branches and a Where, when a gradient may flow through
        if not any(self.is_float(n) for n in implicit_inputs(node)):
            raise _Cannot("its branches read no floating-point value")
        if self.opset < 9:
            raise _Cannot("its condition is computed at run time and opsets before 9 have no Where")
        then_types = _output_types(_attr_graph(inferred, "then_branch"), self.types)
        else_types = _output_types(_attr_graph(inferred, "else_branch"), self.types)
        kinds = [_agreement(a, b) for a, b in zip(then_types, else_types)]
        for i, kind in enumerate(kinds):
            if kind == "differ":
                raise _Cannot(f"its condition is computed at run time and its branches' output {i} differ in type or shape "
                              f"({_describe(then_types[i])} vs {_describe(else_types[i])}), so both cannot be computed and selected")
        unknown = [i for i, kind in enumerate(kinds) if kind == "unknown"]
        if unknown and not any(b.node for b in branches.values()):
            raise _Cannot(f"its condition is computed at run time and the shapes of its branches' outputs {unknown} are unknown")
        then_out = self._inline(branches["then_branch"], {}, f"{node.name}/then", out)
        else_out = self._inline(branches["else_branch"], {}, f"{node.name}/else", out)
        if unknown:  # nested control flow: its branches become top-level nodes; select once their shapes are known
            pick = [helper.make_graph([], f"{node.name}/{side}", [], [helper.make_value_info(o, tp or onnx.TypeProto())
                                                                       for o, tp in zip(outs, types)])
                    for side, outs, types in (("then", then_out, then_types), ("else", else_out, else_types))]
            out.append(helper.make_node("If", [node.input[0]], list(node.output), name=node.name,
                                        then_branch=pick[0], else_branch=pick[1]))
            return out
        c = node.input[0]
        tp = self.types.get(c)
        if tp is None or not tp.tensor_type.HasField("shape") or len(tp.tensor_type.shape.dim) != 0:
            scalar = self.fresh(f"{node.name}/cond_scalar")
            out.append(helper.make_node("Reshape", [c, self.constant(np.zeros((0,), np.int64), f"{node.name}/scalar_shape")],
                                        [scalar], name=self.fresh(f"{node.name}/Reshape")))
            c = scalar
        for name, t, e, kind in zip(node.output, then_out, else_out, kinds):
            if not name:
                continue
            if kind == "equal":
                out.append(helper.make_node("Where", [c, t, e], [name], name=self.fresh(f"{node.name}/Where")))
                continue
            # shapes not proven equal: the result takes the taken branch's shape, so a broadcast the
            # If would not have done fails loudly in the Reshape instead of passing silently
            picked, shapes = self.fresh(f"{name}/picked"), [self.fresh(f"{name}/{side}_shape") for side in ("then", "else")]
            out.append(helper.make_node("Where", [c, t, e], [picked], name=self.fresh(f"{node.name}/Where")))
            out.append(helper.make_node("Shape", [t], [shapes[0]], name=self.fresh(f"{node.name}/Shape")))
            out.append(helper.make_node("Shape", [e], [shapes[1]], name=self.fresh(f"{node.name}/Shape")))
            shape = self.fresh(f"{name}/shape")
            out.append(helper.make_node("Where", [c, *shapes], [shape], name=self.fresh(f"{node.name}/Where")))
            out.append(helper.make_node("Reshape", [picked, shape], [name], name=self.fresh(f"{node.name}/Reshape")))
        return out

    # ---- Loop ---------------------------------------------------------------------------------
    def _lower_loop(self, node: onnx.NodeProto, inferred: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        body = _attr_graph(node, "body")
        m_name = node.input[0] if len(node.input) > 0 else ""
        c_name = node.input[1] if len(node.input) > 1 else ""
        trip = None
        if m_name:
            m = self.value(m_name, limit=1)
            if m is None:
                raise _Cannot(f"its trip count {m_name!r} is computed at run time")
            trip = int(m.reshape(-1)[0])
        go = True
        if c_name:
            c = self.value(c_name, limit=1)
            if c is None:
                raise _Cannot(f"its initial condition {c_name!r} is computed at run time")
            go = bool(c.reshape(-1)[0])
        if trip is None and not c_name:
            raise _Cannot("it has neither a trip count nor a condition (it loops until stopped)")
        carried = list(node.input[2:])
        n = len(carried)
        k = len(body.output) - 1 - n
        known = [self.value(v, limit=_SMALL) for v in carried]  # constant evaluation of the condition
        inner = [i.name for i in body.input]
        out: list[onnx.NodeProto] = []
        shared = self._body_constants(body, node.name)
        scans: list[list[str]] = [[] for _ in range(k)]
        i = 0
        while go and (trip is None or i < trip):
            if len(out) + i > MAX_UNROLLED_NODES:
                raise _Cannot(f"unrolled, it would exceed {MAX_UNROLLED_NODES} nodes after {i} iterations")
            bind = dict(shared)
            bind[inner[0]] = self.constant(np.array(i, np.int64), f"{node.name}/iteration_{i}")
            bind[inner[1]] = self.constant(np.array(go), f"{node.name}/cond_{i}")
            bind.update(zip(inner[2:], carried))
            if c_name:
                values = self._evaluate(body, {inner[0]: np.array(i, np.int64), inner[1]: np.array(go),
                                               **{a: v for a, v in zip(inner[2:], known) if v is not None}})
                cond_out = values.get(body.output[0].name)
                if cond_out is None:
                    raise _Cannot(f"its condition {body.output[0].name!r} is computed at run time")
                known = [values.get(o.name) for o in body.output[1 : 1 + n]]
            results = self._inline(body, bind, f"{node.name}/iter{i}", out)
            if c_name:
                go = bool(np.asarray(cond_out).reshape(-1)[0])
            carried = results[1 : 1 + n]
            for j in range(k):
                scans[j].append(results[1 + n + j])
            i += 1
        out_types = _output_types(_attr_graph(inferred, "body"))
        return out + self._bind_outputs(node, carried) + self._stack(node, node.output[n:], scans, [0] * k, out_types[1 + n:])

    # ---- Scan ---------------------------------------------------------------------------------
    def _lower_scan(self, node: onnx.NodeProto, inferred: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if self.opset < 9:
            raise _Cannot("Scan-8 (batched, with sequence_lens) is not unrolled")
        body = _attr_graph(node, "body")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute if a.type != AT.GRAPH}
        m = attrs["num_scan_inputs"]
        n = len(node.input) - m
        k = len(body.output) - n
        xs = list(node.input[n:])
        in_axes = list(attrs.get("scan_input_axes") or [0] * m)
        in_dirs = list(attrs.get("scan_input_directions") or [0] * m)
        lengths = set()
        for x, a in zip(xs, in_axes):
            shape = _static_dims(self.types.get(x))
            if shape is None or not isinstance(shape[a], int):
                raise _Cannot(f"the sequence length of its scan input {x!r} is not static")
            lengths.add(shape[a])
        if len(lengths) != 1:
            raise _Cannot(f"its scan inputs differ in length {sorted(lengths)}")
        (steps,) = lengths
        inner = [i.name for i in body.input]
        out: list[onnx.NodeProto] = []
        shared = self._body_constants(body, node.name)
        states = list(node.input[:n])
        ys: list[list[str]] = [[] for _ in range(k)]
        for t in range(steps):
            if len(out) > MAX_UNROLLED_NODES:
                raise _Cannot(f"unrolled, it would exceed {MAX_UNROLLED_NODES} nodes after {t} steps")
            bind = dict(shared)
            bind.update(zip(inner[:n], states))
            for j, (x, a, d) in enumerate(zip(xs, in_axes, in_dirs)):
                index = self.constant(np.array(steps - 1 - t if d else t, np.int64), f"{node.name}/step_{t}")
                sliced = self.fresh(f"{node.name}/step{t}/{inner[n + j]}")
                out.append(helper.make_node("Gather", [x, index], [sliced], name=self.fresh(f"{node.name}/step{t}/Gather"), axis=a))
                bind[inner[n + j]] = sliced
            results = self._inline(body, bind, f"{node.name}/step{t}", out)
            states = results[:n]
            for j in range(k):
                ys[j].append(results[n + j])
        out_axes = list(attrs.get("scan_output_axes") or [0] * k)
        out_dirs = list(attrs.get("scan_output_directions") or [0] * k)
        ys = [y[::-1] if d else y for y, d in zip(ys, out_dirs)]
        out_types = _output_types(_attr_graph(inferred, "body"))
        return out + self._bind_outputs(node, states) + self._stack(node, node.output[n:], ys, out_axes, out_types[n:])

    # ---- shared pieces --------------------------------------------------------------------------
    def _body_constants(self, body: onnx.GraphProto, tag: str) -> dict[str, str]:
        """The body's initializers, added once under fresh names (every iteration reads them)."""
        names = {}
        for t in body.initializer:
            copy = onnx.TensorProto()
            copy.CopyFrom(t)
            copy.name = self.fresh(f"{tag}/{t.name}")
            self.new_initializers.append(copy)
            names[t.name] = copy.name
        return names

    def _inline(self, graph: onnx.GraphProto, bind: dict[str, str], tag: str, out: list[onnx.NodeProto]) -> list[str]:
        """Append copies of ``graph``'s nodes to ``out``, every value they define renamed fresh and
        ``bind`` giving the outer names of its inputs; returns the outer names of its outputs."""
        names = dict(bind)
        if graph.initializer and not all(t.name in names for t in graph.initializer):
            names.update(self._body_constants(graph, tag))
        for node in graph.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            for i, name in enumerate(copy.input):
                copy.input[i] = names.get(name, name)
            for sub in subgraphs(copy):
                _rename_reads(sub, names)
            for i, name in enumerate(copy.output):
                if name:
                    names[name] = copy.output[i] = self.fresh(f"{tag}/{name}")
            copy.name = self.fresh(f"{tag}/{node.name or node.op_type}")
            out.append(copy)
        return [names.get(o.name, o.name) for o in graph.output]

    def _bind_outputs(self, node: onnx.NodeProto, values: list[str]) -> list[onnx.NodeProto]:
        return [helper.make_node("Identity", [v], [name], name=self.fresh(f"{node.name}/{name}/Identity"))
                for name, v in zip(node.output, values) if name]

    def _stack(self, node: onnx.NodeProto, names, slices: list[list[str]], axes: list[int],
               types: list[onnx.TypeProto | None]) -> list[onnx.NodeProto]:
        """Scan outputs: the slices of each, stacked along its axis (Unsqueeze, then Concat)."""
        out = []
        for name, parts, axis, tp in zip(names, slices, axes, types):
            if not name:
                continue
            if not parts:  # no iteration: an empty tensor, which needs the body output's static shape
                dims = _static_dims(tp)
                shape = [d for d in dims or () if isinstance(d, int)]
                if tp is None or dims is None or len(shape) != len(dims):
                    raise _Cannot(f"it runs no iteration and the shape of its scan output {name!r} is not static")
                shape.insert(axis + len(dims) + 1 if axis < 0 else axis, 0)
                dtype = helper.tensor_dtype_to_np_dtype(tp.tensor_type.elem_type)
                out.append(helper.make_node("Identity", [self.constant(np.zeros(shape, dtype), f"{name}/empty")], [name],
                                            name=self.fresh(f"{node.name}/{name}/Identity")))
                continue
            axes_name = self.constant(np.array([axis], np.int64), f"{node.name}/axis") if self.opset >= 13 else None
            grown = []
            for part in parts:
                grown.append(self.fresh(f"{part}/unsqueezed"))
                out.append(_unsqueeze(part, axes_name, axis, grown[-1], self.fresh(f"{node.name}/Unsqueeze")))
            out.append(helper.make_node("Concat", grown, [name], name=self.fresh(f"{node.name}/{name}/Concat"), axis=axis))
        return out

    def _evaluate(self, graph: onnx.GraphProto, known: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every value of ``graph`` computable from ``known`` and small outer constants."""

        values = dict(known)
        values.update({t.name: numpy_helper.to_array(t) for t in graph.initializer if int(np.prod(t.dims, dtype=np.int64)) <= _SMALL})
        for node in graph.node:
            if node.op_type in passes.NOT_FOLDABLE or not is_default(node.domain):
                continue
            args = []
            for name in node_reads(node):
                v = values.get(name) if name in values or not name else self.value(name, limit=_SMALL)
                if name and v is None:
                    break
                args.append(v)
            else:
                if any(a is not None and a.size > _SMALL for a in args):
                    continue
                try:
                    result = bind_kernel(node, self.opset)(*args)
                except Exception:
                    continue
                values.update((o, np.asarray(r)) for o, r in zip(node.output, result) if o)
        return values

    # ---- what remains -----------------------------------------------------------------------------
    def explain_remaining(self) -> None:
        changed = False
        for node, inferred in zip(self.graph.node, self.inferred_nodes):
            if not _is_control_flow(node):
                continue
            floats = [n for n in implicit_inputs(node) if self.is_float(n)]
            reads_float = bool(floats) or any(self.is_float(n) for n in node.input[2 if node.op_type == "Loop" else 0:])
            if not reads_float:
                continue
            try:
                getattr(self, f"_lower_{node.op_type.lower()}")(node, inferred)
                reason = "it could not be lowered"
            except _Cannot as exc:
                reason = str(exc)
            self.new_initializers.clear()
            if node.op_type != "Loop":  # a Loop has a gradient as a node (odt_ops/grad/rules/control_flow.py)
                message = (f"{node.op_type} node {node.name!r} stays a node, which runs but has no gradient: {reason}. "
                           "To train through it, export with static shapes and trip counts")
                node.doc_string = message
                warnings.warn(message, stacklevel=3)
            if node.op_type in ("Loop", "Scan") and floats and (node.op_type == "Loop" or self.opset >= 9):
                changed |= self._carry_explicitly(node, floats)
        if changed:
            self.model.forget_arrays()

    def _carry_explicitly(self, node: onnx.NodeProto, names: list[str]) -> bool:
        """Pass outer values the body reads as extra loop-carried values (Loop) or states (Scan),
        unchanged by the body: same results, but the node now lists them as inputs."""
        typed = [n for n in names if n in self.types and self.types[n].HasField("tensor_type")]
        if not typed:
            return False
        body = _attr_graph(node, "body")
        if node.op_type == "Loop":
            n_carried = len(node.input) - 2
            at_input, at_body_in, at_body_out, at_output = len(node.input), len(body.input), 1 + n_carried, n_carried
        else:
            m = next(a.i for a in node.attribute if a.name == "num_scan_inputs")
            n_states = len(node.input) - m
            at_input, at_body_in, at_body_out, at_output = n_states, n_states, n_states, n_states
        formal = {n: self.fresh(f"{n}/carried") for n in typed}
        _rename_reads(body, formal)
        body_in, body_out, node_in, node_out = (list(body.input), list(body.output), list(node.input), list(node.output))
        for j, name in enumerate(typed):
            through = self.fresh(f"{name}/carried_out")
            body.node.append(helper.make_node("Identity", [formal[name]], [through], name=self.fresh(f"{name}/carried/Identity")))
            body_in.insert(at_body_in + j, helper.make_value_info(formal[name], self.types[name]))
            body_out.insert(at_body_out + j, helper.make_value_info(through, self.types[name]))
            node_in.insert(at_input + j, name)
            while len(node_out) < at_output:
                node_out.append("")
            node_out.insert(at_output + j, self.fresh(f"{node.name}/{name}/unused"))
        del body.input[:], body.output[:], node.input[:], node.output[:]
        body.input.extend(body_in)
        body.output.extend(body_out)
        node.input.extend(node_in)
        node.output.extend(node_out)
        return True


def _unsqueeze(x: str, axes: str | None, axis: int, out: str, name: str) -> onnx.NodeProto:
    """Unsqueeze at ``axis``: axes as an input from opset 13 (``axes`` given), an attribute before."""
    if axes is None:
        return helper.make_node("Unsqueeze", [x], [out], name=name, axes=[axis])
    return helper.make_node("Unsqueeze", [x, axes], [out], name=name)


def _attr_graph(node: onnx.NodeProto, name: str) -> onnx.GraphProto:
    return next(a.g for a in node.attribute if a.name == name)


def _output_types(graph: onnx.GraphProto, outer: dict[str, onnx.TypeProto] | None = None) -> list[onnx.TypeProto | None]:
    """Each output's type, with its shape where the graph (or inference, or for an outer value
    ``outer``) records one."""
    known = dict(outer or {})
    known.update({v.name: v.type for v in graph.value_info})
    known.update({t.name: helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in graph.initializer})
    types = []
    for out in graph.output:
        tp = out.type
        if not (tp.HasField("tensor_type") and tp.tensor_type.HasField("shape")):
            tp = known.get(out.name, tp if out.HasField("type") else None)
        types.append(tp)
    return types


def _static_dims(tp: onnx.TypeProto | None) -> list[int | str | None] | None:
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    # inference names the dims it cannot tell unk__<n>: as unknown as an unnamed dim
    return [d.dim_value if d.HasField("dim_value") else None if d.dim_param.startswith("unk__") else (d.dim_param or None)
            for d in tp.tensor_type.shape.dim]


def _agreement(a: onnx.TypeProto | None, b: onnx.TypeProto | None) -> str:
    """equal: same type and static shape; compatible: same type and rank, no known dims in conflict;
    differ: a conflict; unknown: a type or rank inference could not tell."""
    if a is None or b is None or not a.HasField("tensor_type") or not b.HasField("tensor_type"):
        return "unknown"
    ea, eb = a.tensor_type.elem_type, b.tensor_type.elem_type
    da, db = _static_dims(a), _static_dims(b)
    if not ea or not eb or da is None or db is None:
        return "unknown"
    if ea != eb or len(da) != len(db) or any(x is not None and y is not None and x != y for x, y in zip(da, db)):
        return "differ"
    return "equal" if all(x is not None and x == y for x, y in zip(da, db)) else "compatible"


def _fully_known(tp: onnx.TypeProto | None) -> bool:
    dims = _static_dims(tp)
    return tp is not None and dims is not None and all(d is not None for d in dims) and bool(tp.tensor_type.elem_type)


def _same_static_type(a: onnx.TypeProto, b: onnx.TypeProto) -> bool:
    if not (a.HasField("tensor_type") and b.HasField("tensor_type")) or a.tensor_type.elem_type != b.tensor_type.elem_type:
        return False
    da, db = _static_dims(a), _static_dims(b)
    return da is not None and db is not None and len(da) == len(db) and all(x is not None and x == y for x, y in zip(da, db))


def _describe(tp: onnx.TypeProto | None) -> str:
    if tp is None or not tp.HasField("tensor_type"):
        return "unknown"
    dims = _static_dims(tp)
    return f"{helper.tensor_dtype_to_np_dtype(tp.tensor_type.elem_type) if tp.tensor_type.elem_type else '?'}{dims if dims is not None else '[?]'}"


def _rename_reads(graph: onnx.GraphProto, names: dict[str, str]) -> None:
    """In ``graph`` and its subgraphs, read outer values under their new names."""
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in names:
                node.input[i] = names[name]
        for sub in subgraphs(node):
            _rename_reads(sub, names)
    for out in graph.output:
        if out.name in names:
            out.name = names[out.name]


def _all_names(graph: onnx.GraphProto) -> set[str]:
    """Every value and node name in the graph and its subgraphs (fresh names avoid them all)."""
    names = {v.name for v in (*graph.input, *graph.output, *graph.value_info)} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        names.add(node.name)
        for sub in subgraphs(node):
            names |= _all_names(sub)
    return names


_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})
