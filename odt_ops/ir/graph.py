"""Graph reads every layer needs: the subgraphs of a node, the outer-scope values they read,
every node recursively, and an order in which each node runs after the values it reads.

Subgraphs read outer-scope values by name, without listing them as node inputs. Every
analysis that asks "who reads this value" (pruning, folding, ordering, freeing) must see
those reads too: ``implicit_inputs(node)`` lists them, recursively through nested
subgraphs, in a fixed order (the order the kernels in odt_ops/kernels/control_flow.py
receive their values in). This module imports nothing of the engine but its errors, so the
loader, the binding, the gradient builder and the runtime all read graphs one way.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import onnx

from odt_ops.errors import ModelCheckError, node_label

AT = onnx.AttributeProto


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The node's graph attributes (If's branches, Loop's and Scan's body), in attribute order."""
    graphs: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.type == AT.GRAPH:
            graphs.append(attr.g)
        elif attr.type == AT.GRAPHS:
            graphs.extend(attr.graphs)
    return graphs


def has_subgraphs(node: onnx.NodeProto) -> bool:
    return any(a.type in (AT.GRAPH, AT.GRAPHS) for a in node.attribute)


def outer_reads(graph: onnx.GraphProto) -> list[str]:
    """Names the graph's nodes (and their subgraphs, recursively) read but the graph does
    not define (inputs, initializers, node outputs): the outer-scope values it needs."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    reads: dict[str, None] = {}
    for node in graph.node:
        for name in (*node.input, *implicit_inputs(node)):
            if name and name not in defined:
                reads[name] = None
        defined.update(node.output)
    for out in graph.output:  # a body may output an outer value as it is
        if out.name not in defined:
            reads[out.name] = None
    return list(reads)


def implicit_inputs(node: onnx.NodeProto) -> list[str]:
    """Outer-scope values the node's subgraphs read (none for ordinary nodes)."""
    if not node.attribute or not has_subgraphs(node):
        return []
    reads: dict[str, None] = {}
    for graph in subgraphs(node):
        reads.update(dict.fromkeys(outer_reads(graph)))
    return list(reads)


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The node's inputs followed by the outer values its subgraphs read."""
    return [*node.input, *implicit_inputs(node)]


def all_nodes(nodes: Iterable[onnx.NodeProto]) -> Iterator[onnx.NodeProto]:
    """The nodes and, recursively, those of their subgraphs."""
    for node in nodes:
        yield node
        for graph in subgraphs(node):
            yield from all_nodes(graph.node)


def producers(nodes: Iterable[onnx.NodeProto]) -> dict[str, onnx.NodeProto]:
    """Each value's producing node (graph inputs and initializers have none)."""
    return {name: node for node in nodes for name in node.output if name}


def consumers(nodes: Iterable[onnx.NodeProto]) -> dict[str, list[onnx.NodeProto]]:
    """The nodes reading each value, once per node, outer reads of their subgraphs included."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in dict.fromkeys(node_reads(node)):
            readers.setdefault(name, []).append(node)
    return readers


def topological_order(nodes: onnx.GraphProto | Iterable[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """Nodes ordered so each runs after its producers (stable for already-sorted graphs)."""
    ready = set(available) | {""}
    pending = list(nodes.node if isinstance(nodes, onnx.GraphProto) else nodes)
    order: list[onnx.NodeProto] = []
    while pending:
        progressed = []
        rest = []
        for node in pending:
            if all(n in ready for n in node_reads(node)):
                progressed.append(node)
                ready.update(node.output)
            else:
                rest.append(node)
        if not progressed:
            node = rest[0]
            absent = [n for n in node_reads(node) if n not in ready]
            raise ModelCheckError(
                f"{node_label(node)} reads {absent}, which no node, input or initializer produces (or the graph has a cycle)"
            )
        order.extend(progressed)
        pending = rest
    return order
