"""Compiled execution plans.

Compiling resolves, once, everything a run would otherwise look up: topological
order, the kernel of each node with its attributes bound, an integer slot for every
value, and the step after which each intermediate can be freed. A run is then one
tight loop over pre-bound steps on a list of slots: no graph walking, no dictionary
lookups, no attribute decoding.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from odt_ops.errors import KernelError, ModelCheckError, OdtError, UnsupportedOpError, describe_arrays
from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels import lookup
from odt_ops.runtime.memory import tune_allocator

NONE_SLOT = 0  # always holds None: omitted optional inputs read it
SINK_SLOT = 1  # written by outputs nobody named; never read


def node_label(node: onnx.NodeProto) -> str:
    return f"{node.op_type} node {node.name!r}" if node.name else f"{node.op_type} node producing {list(node.output)}"


def missing_kernels(nodes: Iterable[onnx.NodeProto], opsets: Mapping[str, int]) -> dict[tuple[str, str, int], list[str]]:
    """(domain, op, opset) -> node names, for every node no kernel covers."""
    missing: dict[tuple[str, str, int], list[str]] = {}
    for node in nodes:
        domain = "" if node.domain == "ai.onnx" else node.domain
        opset = opsets.get(domain, 0)
        if lookup(domain, node.op_type, opset) is None:
            missing.setdefault((domain, node.op_type, opset), []).append(node.name or node.output[0])
    return missing


def bind_node(node: onnx.NodeProto, opset: int, rng: np.random.Generator | None = None) -> Callable[..., tuple]:
    """The node's kernel with attributes and engine keywords bound."""
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
    return functools.partial(entry.fn, **attrs) if attrs else entry.fn


@dataclass(frozen=True)
class Step:
    fn: Callable[..., tuple]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    frees: tuple[int, ...]
    node: onnx.NodeProto


class Plan:
    """An executable form of one graph: ``run(feeds) -> outputs`` by position."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        opsets: Mapping[str, int],
        constants: Mapping[str, np.ndarray],
        input_names: Sequence[str],
        output_names: Sequence[str],
        rng: np.random.Generator | None = None,
    ):
        tune_allocator()
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        missing = missing_kernels(graph.node, opsets)
        if missing:
            raise UnsupportedOpError(missing)
        slots: dict[str, int] = {"": NONE_SLOT}
        template: list = [None, None]

        def slot(name: str) -> int:
            if name not in slots:
                slots[name] = len(template)
                template.append(None)
            return slots[name]

        for name, value in constants.items():
            template[slot(name)] = value
        self._input_slots = [slot(n) for n in self.input_names]
        nodes = topological_order(graph, set(constants) | set(self.input_names))
        bound = []
        for node in nodes:
            ins = list(node.input)
            while ins and ins[-1] == "":
                ins.pop()
            for name in ins:
                if name and name not in slots:
                    raise ModelCheckError(f"{node_label(node)} reads {name!r}, which nothing produces")
            outs = tuple(slot(n) if n else SINK_SLOT for n in node.output)
            opset = opsets.get("" if node.domain == "ai.onnx" else node.domain, 0)
            bound.append((bind_node(node, opset, rng), tuple(slots[n] for n in ins), outs, node))
        for name in self.output_names:
            if name not in slots:
                raise ModelCheckError(f"graph output {name!r} is produced by no node, input or initializer")
        self._output_slots = [slots[n] for n in self.output_names]

        # free each intermediate right after its last reader; constants, feeds and
        # outputs stay (the template is copied per run, so freeing constants gains nothing)
        keep = set(self._output_slots) | {slots[n] for n in constants} | {NONE_SLOT, SINK_SLOT}
        last_use: dict[int, int] = {}
        for i, (_, ins, outs, _) in enumerate(bound):
            for s in (*ins, *outs):
                last_use[s] = i
        frees_at: list[list[int]] = [[] for _ in bound]
        for s, i in last_use.items():
            if s not in keep:
                frees_at[i].append(s)
        self.steps = [Step(fn, ins, outs, tuple(frees_at[i]), node) for i, (fn, ins, outs, node) in enumerate(bound)]
        self._template = template
        self._loop = [(s.fn, s.inputs, s.outputs, s.frees) for s in self.steps]
        self.slots = slots

    def run(self, feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        vals = self._template.copy()
        for s, x in zip(self._input_slots, feeds):
            vals[s] = x
        i = 0
        try:
            for i, (fn, ins, outs, frees) in enumerate(self._loop):  # noqa: B007
                res = fn(*[vals[j] for j in ins])
                for o, r in zip(outs, res):
                    vals[o] = r
                for f in frees:
                    vals[f] = None
        except OdtError:
            raise
        except Exception as exc:  # a kernel met values it cannot handle: name the node
            step = self.steps[i]
            raise KernelError(
                f"{node_label(step.node)} failed on inputs ({describe_arrays(vals[j] for j in step.inputs)}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return [vals[j] for j in self._output_slots]


def topological_order(graph: onnx.GraphProto, available: set[str]) -> list[onnx.NodeProto]:
    """Nodes ordered so each runs after its producers (stable for already-sorted graphs)."""
    ready = set(available) | {""}
    pending = list(graph.node)
    order: list[onnx.NodeProto] = []
    while pending:
        progressed = []
        rest = []
        for node in pending:
            if all(n in ready for n in node.input):
                progressed.append(node)
                ready.update(node.output)
            else:
                rest.append(node)
        if not progressed:
            node = rest[0]
            absent = [n for n in node.input if n not in ready]
            raise ModelCheckError(
                f"{node_label(node)} reads {absent}, which no node, input or initializer produces (or the graph has a cycle)"
            )
        order.extend(progressed)
        pending = rest
    return order
