"""Ordering a graph's nodes so each runs after the values it reads exist."""
from __future__ import annotations

from collections.abc import Iterable

import onnx

from odt_ops.errors import ModelCheckError, node_label
from odt_ops.ir.control_flow import node_reads


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
