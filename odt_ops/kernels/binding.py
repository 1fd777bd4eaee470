"""A node's kernel, ready to call: looked up for the node's opset, its attributes bound.

Kept below the runtime so that the loader's passes (constant folding, control-flow
lowering), which evaluate single nodes, and the runtime's plans bind nodes the same way
without the loader importing the runtime.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import onnx

from odt_ops.errors import ModelCheckError, UnsupportedOpError, node_label
from odt_ops.ir.attributes import node_attributes
from odt_ops.ir.control_flow import all_nodes, implicit_inputs
from odt_ops.kernels.control_flow import Scope
from odt_ops.kernels.registry import lookup


def missing_kernels(nodes: Iterable[onnx.NodeProto], opsets: Mapping[str, int]) -> dict[tuple[str, str, int], list[str]]:
    """(domain, op, opset) -> node names, for every node no kernel covers (in subgraphs too)."""
    missing: dict[tuple[str, str, int], list[str]] = {}
    for node in all_nodes(nodes):
        domain = "" if node.domain == "ai.onnx" else node.domain
        opset = opsets.get(domain, 0)
        if lookup(domain, node.op_type, opset) is None:
            missing.setdefault((domain, node.op_type, opset), []).append(node.name or node.output[0])
    return missing


def bind_kernel(node: onnx.NodeProto, opset: int, rng: np.random.Generator | None = None,
                opsets: Mapping[str, int] | None = None) -> Callable[..., tuple]:
    """The node's kernel with attributes and engine keywords bound. A control-flow kernel (one
    taking ``_scope``) is called with the outer values its subgraphs read after its inputs."""
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
        attrs["_scope"] = Scope(tuple(implicit_inputs(node)), dict(opsets or {"": opset}), rng, node_label(node))
    return functools.partial(entry.fn, **attrs) if attrs else entry.fn
