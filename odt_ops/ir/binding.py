"""A node's kernel, ready to call: looked up for the node's opset, its attributes bound.

Kept below the runtime so that the loader's passes (constant folding, control-flow
lowering), which evaluate single nodes, and the runtime's plans bind nodes the same way
without the loader importing the runtime.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from odt_ops.domain import canonical
from odt_ops.errors import KernelError, ModelCheckError, OdtError, UnsupportedOpError, node_label
from odt_ops.ir.attributes import node_attributes
from odt_ops.ir.graph import all_nodes, implicit_inputs, outer_reads, topological_order
from odt_ops.kernels.registry import lookup

# (graph, opsets, constants, input names, output names, rng) -> something with .run(feeds) -> outputs
SubgraphCompiler = Callable[..., Any]


@dataclass
class Scope:
    """What a control-flow kernel needs beyond its attributes: the names of the outer values
    appended to its inputs, the opsets its subgraphs run at, the session's generator, and how to
    compile a subgraph. The runtime passes its Plan (so bodies run as compiled plans); without
    one (the loader folding a constant node) each body runs node by node here, so the kernels
    never import the runtime."""

    outer: tuple[str, ...]
    opsets: Mapping[str, int]
    rng: np.random.Generator | None = None
    label: str = ""
    compile: SubgraphCompiler | None = None
    _plans: dict = field(default_factory=dict, repr=False)

    def split(self, args: Sequence) -> tuple[tuple, tuple]:
        """(the node's own inputs, the outer values)."""
        n = len(args) - len(self.outer)
        return tuple(args[:n]), tuple(args[n:])

    def run(self, graph: onnx.GraphProto, inputs: Sequence, outer: Sequence) -> list:
        """Run ``graph`` on its formal ``inputs``, its outer reads taken from ``outer``."""
        plan, picks = self._plan(graph)
        try:
            return plan.run([*inputs, *(outer[i] for i in picks)])
        except OdtError as exc:
            raise KernelError(f"{self.label}, subgraph {graph.name!r}: {exc}") from exc

    def _plan(self, graph: onnx.GraphProto):
        hit = self._plans.get(id(graph))
        if hit is None or hit[0] is not graph:
            reads = outer_reads(graph)
            constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
            plan = (self.compile or _NodeByNode)(graph, self.opsets, constants, [i.name for i in graph.input] + reads,
                                                 [o.name for o in graph.output], self.rng)
            hit = self._plans[id(graph)] = (graph, plan, [self.outer.index(n) for n in reads])
        return hit[1], hit[2]


class _NodeByNode:
    """A subgraph run one node at a time through the kernels (the loader's fallback; plans are faster)."""

    def __init__(self, graph: onnx.GraphProto, opsets: Mapping[str, int], constants: Mapping[str, np.ndarray],
                 input_names: Sequence[str], output_names: Sequence[str], rng: np.random.Generator | None = None):
        self.input_names, self.output_names, self.constants = list(input_names), list(output_names), dict(constants)
        available = set(self.constants) | set(self.input_names)
        self.steps = []
        for node in topological_order(graph.node, available):
            opset = opsets.get(canonical(node.domain), 0)
            self.steps.append((bind_kernel(node, opset, rng, opsets), node_inputs(node), list(node.output)))

    def run(self, feeds: Sequence) -> list:
        values = {**self.constants, **dict(zip(self.input_names, feeds)), "": None}
        for fn, ins, outs in self.steps:
            values.update(zip(outs, fn(*(values[n] for n in ins))))
        return [values[n] for n in self.output_names]


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """What a bound kernel is called with, by name: the node's inputs without the trailing omitted
    ones (their parameters keep the kernel's defaults; "" in the middle passes None), then the
    outer values its subgraphs read."""
    ins = list(node.input)
    while ins and ins[-1] == "":
        ins.pop()
    return ins + implicit_inputs(node)


def missing_kernels(nodes: Iterable[onnx.NodeProto], opsets: Mapping[str, int]) -> dict[tuple[str, str, int], list[str]]:
    """(domain, op, opset) -> node names, for every node no kernel covers (in subgraphs too)."""
    missing: dict[tuple[str, str, int], list[str]] = {}
    for node in all_nodes(nodes):
        domain = canonical(node.domain)
        opset = opsets.get(domain, 0)
        if lookup(domain, node.op_type, opset) is None:
            missing.setdefault((domain, node.op_type, opset), []).append(node.name or node.output[0])
    return missing


def bind_kernel(node: onnx.NodeProto, opset: int, rng: np.random.Generator | None = None,
                opsets: Mapping[str, int] | None = None, compile_subgraph: SubgraphCompiler | None = None) -> Callable[..., tuple]:
    """The node's kernel with attributes and engine keywords bound. A control-flow kernel (one
    taking ``_scope``) is called with the outer values its subgraphs read after its inputs, and
    compiles its subgraphs with ``compile_subgraph`` (the runtime's Plan; node by node if None)."""
    entry = lookup(node.domain, node.op_type, opset)
    if entry is None:
        raise UnsupportedOpError({(node.domain, node.op_type, opset): [node.name]})
    attrs = node_attributes(node)
    unknown = set(attrs) - entry.attributes
    if unknown:
        raise ModelCheckError(
            f"{node_label(node)}: attribute(s) {sorted(unknown)} are not part of {node.op_type} "
            f"(opset {opset}); allowed: {sorted(entry.attributes)}"
        )
    if "_num_outputs" in entry.engine_keywords:
        attrs["_num_outputs"] = len(node.output)
    if "_rng" in entry.engine_keywords:
        attrs["_rng"] = rng if rng is not None else np.random.default_rng(0)
    if "_scope" in entry.attributes:
        attrs["_scope"] = Scope(tuple(implicit_inputs(node)), dict(opsets or {"": opset}), rng, node_label(node), compile_subgraph)
    return functools.partial(entry.fn, **attrs) if attrs else entry.fn
