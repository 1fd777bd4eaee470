"""The reverse walk that builds a gradient graph in standard ONNX.

``build_gradients`` visits the nodes between the trainable parameters and the loss in
reverse topological order, seeds d(loss) = 1 and calls each node's rule. The chores
every rule would otherwise repeat live here, once: totalling the gradients of values
read by several nodes (fan-out, grad/accumulate.py), undoing numpy broadcasting for rules registered with
``broadcasting=True``, skipping frozen parameters and everything that does not lead
back to a trainable one, and naming the final gradients ``<param>_grad``.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import onnx
from onnx import helper

from odt_ops.coverage import NOT_DIFFERENTIABLE
from odt_ops.domain import canonical, default_opset, opset_versions
from odt_ops.errors import GradientError, UnsupportedOpError
from odt_ops.grad.accumulate import total
from odt_ops.grad.registry import GradContext, lookup_gradient
from odt_ops.ir.builder import GraphBuilder
from odt_ops.ir.graph import node_reads, topological_order
from odt_ops.ir.model import Model
from odt_ops.ir.passes import SAME_TYPE_AS_INPUT
from odt_ops.kernels import lookup

MIN_OPSET = 18  # rules emit opset-18+ signatures (axes as inputs, Split num_outputs)
FLOAT_TYPES = frozenset(
    {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
)


class Gradients(NamedTuple):
    nodes: list[onnx.NodeProto]
    initializers: list[onnx.TensorProto]
    grads: dict[str, str]  # parameter -> name of its gradient


def build_gradients(
    model: Model | onnx.ModelProto,
    loss_name: str,
    wrt: Sequence[str],
    *,
    grad_names: Mapping[str, str] | None = None,
) -> Gradients:
    """Nodes and initializers computing d(loss)/d(p) for every p in ``wrt``.

    Append them to the model's graph to get the training graph. ``wrt`` are the
    trainable parameters (graph inputs or initializers); frozen ones are simply left
    out. Gradients are named ``<param>_grad`` unless ``grad_names`` says otherwise.
    A parameter the loss does not depend on gets a zero gradient. Rules may ask a
    forward node for an optional output it leaves unnamed (Dropout's mask, ...): the
    node in ``model`` gains that output.

    Raises UnsupportedOpError listing every node on the path that has no rule, and
    GradientError listing every node whose rule cannot handle it, before returning
    anything.
    """
    proto = model.proto if isinstance(model, Model) else model
    walk = _Walk(proto, loss_name, wrt)
    missing = walk.missing_rules()
    if missing:
        raise UnsupportedOpError(missing, what="gradient rule", reasons=NOT_DIFFERENTIABLE)
    return walk.run(grad_names or {})


def missing_gradients(
    model: Model | onnx.ModelProto, wrt: Sequence[str], loss_name: str | None = None
) -> dict[tuple[str, str, int], list[str]]:
    """Every node on a differentiable path from ``wrt`` to the loss (or, without a loss, to
    any graph output) that lacks a kernel or a gradient rule: (domain, op, opset) -> node names.

    This is the pre-flight coverage check: call it before generating anything.
    """
    proto = model.proto if isinstance(model, Model) else model
    walk = _Walk(proto, loss_name, wrt)
    missing = walk.missing_rules()
    for node in walk.path:
        domain = canonical(node.domain)
        opset = walk.opsets.get(domain, 0)
        if lookup(domain, node.op_type, opset) is None:
            names = missing.setdefault((domain, node.op_type, opset), [])
            if _label(node) not in names:
                names.append(_label(node))
    return missing


class _Walk:
    def __init__(self, proto: onnx.ModelProto, loss_name: str | None, wrt: Sequence[str]):
        self.proto = proto
        self.graph = proto.graph
        self.opset = default_opset(proto.opset_import, 1)
        self.opsets = opset_versions(proto.opset_import)
        if self.opset < MIN_OPSET:
            raise GradientError(
                f"gradients need opset >= {MIN_OPSET}, the model has {self.opset}; load it with odt_ops.load_model to convert it"
            )
        self.types = _value_types(proto)
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.nodes = topological_order(self.graph, {i.name for i in self.graph.input} | set(self.initializers))
        self.wrt = list(dict.fromkeys(wrt))
        self._check_wrt()
        targets = [loss_name] if loss_name else [o.name for o in self.graph.output]
        if loss_name and loss_name not in self.types and not any(loss_name in n.output for n in self.nodes):
            raise GradientError(f"loss {loss_name!r} is not a value of the graph")
        self.loss = loss_name
        self.active, self.path = self._differentiable_path(targets)

    def _check_wrt(self) -> None:
        known = {i.name for i in self.graph.input} | set(self.initializers)
        unknown = [p for p in self.wrt if p not in known]
        if unknown:
            raise GradientError(f"parameters {unknown} are neither graph inputs nor initializers")
        not_float = [p for p in self.wrt if not self._is_float(p)]
        if not_float:
            raise GradientError(f"parameters {not_float} are not floating-point tensors; they cannot require gradients")

    def _maybe_float(self, name: str) -> bool:
        """Float, or of a type inference could not tell (a custom op's output): such a value
        stays on the path, so a missing rule is reported instead of the path silently ending."""
        tp = self.types.get(name)
        return tp is None or not tp.tensor_type.elem_type or tp.tensor_type.elem_type in FLOAT_TYPES

    def _is_float(self, name: str) -> bool:
        tp = self.types.get(name)
        return tp is not None and tp.tensor_type.elem_type in FLOAT_TYPES

    def _differentiable_path(self, targets: Iterable[str]) -> tuple[set[str], list[onnx.NodeProto]]:
        """Values depending on a parameter through float tensors, and the nodes (in order)
        that carry such a dependency to a target."""
        active = set(self.wrt)
        for node in self.nodes:
            if any(i in active for i in node_reads(node)):  # a subgraph's reads count: no silent zero gradient
                active.update(o for o in node.output if o and self._maybe_float(o))
        wanted = set(targets)
        path = []
        for node in reversed(self.nodes):
            if any(o in wanted and o in active for o in node.output):
                path.append(node)
                wanted.update(i for i in node_reads(node) if i in active)
        path.reverse()
        return active, path

    def missing_rules(self) -> dict[tuple[str, str, int], list[str]]:
        missing: dict[tuple[str, str, int], list[str]] = {}
        for node in self.path:
            if lookup_gradient(node.domain, node.op_type) is None:
                domain = canonical(node.domain)
                missing.setdefault((domain, node.op_type, self.opsets.get(domain, 0)), []).append(_label(node))
        return missing

    def run(self, grad_names: Mapping[str, str]) -> Gradients:
        taken = {n for node in self.graph.node for n in (*node.input, *node.output, node.name)}
        taken |= set(self.types) | set(self.initializers)
        b = GraphBuilder(taken=taken, opset=self.opset, types=self.types, constants=self.initializers, prefix="grad")
        pending: dict[str, list[str]] = {}  # value -> gradient contributions
        errors: list[str] = []
        if self.wrt and self.loss not in self.active:
            raise GradientError(f"loss {self.loss!r} does not depend on any of the parameters {self.wrt}")
        if self.loss in self.active:
            pending[self.loss] = [_seed(b, self.loss)]
        for node in reversed(self.path):
            out_grads = [total(b, pending.pop(o, None), o) for o in node.output]
            if all(g is None for g in out_grads):
                continue
            needs = tuple(bool(i) and i in self.active for i in node.input)
            try:
                self._apply(b, node, out_grads, needs, pending)
            except GradientError as exc:
                errors.append(str(exc))
        if errors:
            raise GradientError(f"{len(errors)} node(s) cannot be differentiated:\n  " + "\n  ".join(errors))
        totals = {}
        for p in self.wrt:
            with b.scope(f"{p}_total"):
                totals[p] = total(b, pending.get(p), p) or _zeros(b, p)
        shared = Counter(totals.values())
        read = {i for n in b.nodes for i in n.input}
        grads = {p: _named(b, g, grad_names.get(p, f"{p}_grad"), rename=shared[g] == 1, read=read) for p, g in totals.items()}
        return Gradients(b.nodes, b.initializers, grads)

    def _apply(self, b: GraphBuilder, node: onnx.NodeProto, out_grads: list, needs: tuple[bool, ...], pending: dict) -> None:
        rule = lookup_gradient(node.domain, node.op_type)
        ctx = GradContext(node, b, self.opset, needs)
        with b.scope(node.name or f"{node.op_type}({node.output[0]})"):
            result = rule.fn(ctx, *out_grads)
            result = tuple(result or ())
            while len(result) > len(node.input) and result[-1] is None:
                result = result[:-1]  # rules answer for every schema input; absent optional ones get None
            assert len(result) <= len(node.input), f"{node.op_type} rule returned {len(result)} gradients for {len(node.input)} inputs"
            for name, g, wanted in zip(node.input, result, needs):
                if g is None or not wanted:
                    continue
                if rule.broadcasting:
                    g = unbroadcast(ctx, g, name)
                _refine(b, g, name)
                pending.setdefault(name, []).append(g)


def _label(node: onnx.NodeProto) -> str:
    return node.name or node.output[0]


def unbroadcast(ctx: GradContext, g: str, x: str) -> str:
    """Sum ``g`` over the axes numpy broadcasting added or stretched, giving ``x``'s shape.

    Decided from static shapes; a symbolic dim equal on both sides (the batch) is not
    broadcast. Axes that cannot be decided statically are reduced at run time wherever
    ``x`` has extent 1 (summing over an extent-1 axis is harmless when ``g`` has it too).
    """
    b = ctx.b
    gs, xs = b.shape(g), b.shape(x)
    if xs is None or gs is None:
        raise ctx.fail(f"cannot unbroadcast the gradient of {x!r}: its rank or its gradient's rank is unknown")
    lead = len(gs) - len(xs)
    if lead < 0:
        raise ctx.fail(f"gradient of {x!r} has rank {len(gs)} < {len(xs)}")
    static, dynamic = list(range(lead)), False
    for i, xd in enumerate(xs):
        gd = gs[lead + i]
        if xd == gd and xd is not None:
            continue
        if xd == 1:
            static.append(lead + i)
        elif isinstance(xd, int) and isinstance(gd, int):
            raise ctx.fail(f"gradient of {x!r} has shape {gs}, which does not broadcast from {xs}")
        else:
            dynamic = True
    if static:
        g = b.ReduceSum(g, ctx.ints(static), keepdims=1)
        if lead:
            g = b.Squeeze(g, ctx.ints(list(range(lead))))
    if dynamic:
        ones = b.Equal(b.Shape(x), ctx.ints(1))
        axes = b.Compress(ctx.ints(list(range(len(xs)))), ones)
        g = b.ReduceSum(g, axes, keepdims=1, noop_with_empty_axes=1)
    return g


def _refine(b: GraphBuilder, g: str, x: str) -> None:
    """Record what the walker knows: a gradient has its value's shape (inference may not see it)."""
    xs, gs = b.shape(x), b.shape(g)
    if xs is None or (gs is not None and len(gs) != len(xs)):
        return
    merged = [gd if isinstance(gd, int) else xd if xd is not None else gd for xd, gd in zip(xs, gs or xs)]
    b.types[g] = helper.make_tensor_type_proto(b.types[x].tensor_type.elem_type, merged)


def _seed(b: GraphBuilder, loss: str) -> str:
    """d(loss)/d(loss) = 1, shaped like the loss (a non-scalar loss is summed)."""
    dtype = b.dtype(loss)
    shape = b.shape(loss)
    if shape is not None and all(isinstance(d, int) for d in shape):
        return b.constant(np.ones(shape, dtype=dtype), hint="d_loss")
    return b.ConstantOfShape(b.Shape(loss), value=np.ones((1,), dtype=dtype))


def _zeros(b: GraphBuilder, p: str) -> str:
    shape = b.shape(p)
    dtype = b.dtype(p)
    if shape is not None and all(isinstance(d, int) for d in shape):
        dims = b.constant(np.asarray(shape, dtype=np.int64))
    else:
        dims = b.Shape(p)
    return b.ConstantOfShape(dims, value=np.zeros((1,), dtype=dtype))


def _named(b: GraphBuilder, g: str, target: str, *, rename: bool, read: set[str]) -> str:
    """Make the gradient ``g`` available under the name ``target`` (renaming its producer if
    nothing else reads it, else with an Identity)."""
    if b.taken(target):
        raise GradientError(f"gradient name {target!r} is already a value of the graph")
    if rename and b.rename(g, target, read=read):
        return target
    node = helper.make_node("Identity", [g], [target], name=b.fresh(f"{target}/Identity"))
    b.nodes.append(node)
    b.infer(node)
    return target


def _value_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Type of every value; runs shape inference when the model has not been through it."""
    graph = proto.graph
    types = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
    for t in graph.initializer:
        types[t.name] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
    produced = [o for n in graph.node for o in n.output if o]
    if any(o not in types for o in produced):
        _infer_into(proto, types)
    completed = _complete_from_inputs(graph, types)
    if completed:  # what the completed values feed is inferred again from them
        typed = onnx.ModelProto()
        typed.CopyFrom(proto)
        known = {v.name for v in (*typed.graph.input, *typed.graph.output)}
        typed.graph.value_info.extend(helper.make_value_info(n, types[n]) for n in completed if n not in known)
        for out in typed.graph.output:
            if out.name in completed:
                out.type.CopyFrom(types[out.name])
        _infer_into(typed, types, override=lambda tp: not tp.tensor_type.HasField("shape"))
    return types


def _infer_into(proto: onnx.ModelProto, types: dict[str, onnx.TypeProto], override=lambda tp: False) -> None:
    try:
        inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise GradientError(f"shape inference failed, so gradient shapes are unknown: {exc}") from None
    g = inferred.graph
    for v in (*g.input, *g.value_info, *g.output):
        if v.name not in types or (override(types[v.name]) and v.type.tensor_type.HasField("shape")):
            types[v.name] = v.type


def _complete_from_inputs(graph: onnx.GraphProto, types: dict[str, onnx.TypeProto]) -> list[str]:
    """Outputs onnx leaves of unknown rank whose type is an input's: GroupNormalization-21's (onnx
    infers it through the function body, whose Reshape to a computed shape loses the rank; what
    odt_ops.ir.passes completes at load) and a Loop's final carried values (typed as what they
    start from). Returns the names completed."""
    completed = []
    for node in graph.node:
        pairs = [(node.input[0], node.output[0])] if node.op_type in SAME_TYPE_AS_INPUT and node.output and node.input else []
        if node.op_type == "Loop":
            pairs = list(zip(node.input[2:], node.output))
        for source, out in pairs:
            known = types.get(out)
            if source in types and types[source].tensor_type.HasField("shape") and (known is None or not known.tensor_type.HasField("shape")):
                types[out] = types[source]
                completed.append(out)
    return completed


__all__ = ["Gradients", "build_gradients", "missing_gradients", "unbroadcast"]
