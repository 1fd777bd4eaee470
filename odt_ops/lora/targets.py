"""Which weights an adapter can sit beside, and which of them a LoraConfig selects.

A weight is an initializer that reaches the weight input of a MatMul (input B), a Gemm
(input B) or a Conv (input W), directly or through a 2-D Transpose, an Identity or a
DequantizeLinear (a quantized base: the adapter then sits beside the int8/int4 weight,
which stays as stored). Every reader of the weight must be such a node, with the same
layout, so that folding the adapter into the weight later changes nothing else.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from odt_ops.domain import is_default
from odt_ops.errors import LoraError
from odt_ops.ir.graph import consumers, producers
from odt_ops.lora.config import ADAPTABLE_OPS, LoraConfig

_WEIGHT_INPUT = {"MatMul": 1, "Gemm": 1, "Conv": 1}


@dataclass
class Target:
    """One weight and the nodes that read it. ``in_features`` x ``out_features`` is the matrix
    the nodes multiply by (for a Conv: in channels times the kernel, out channels)."""

    weight: str
    kind: str
    nodes: list[str] = field(default_factory=list)
    shape: tuple[int, ...] = ()  # the weight as stored
    transposed: bool = False  # the nodes multiply by the stored weight transposed
    dequantize: str | None = None  # the DequantizeLinear node between weight and nodes
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float32))
    group: int = 1  # a Conv's groups: the adapter keeps them (one rank-r update per group's block of W)
    reason: str | None = None  # why no adapter can sit here (None: it can)
    chain: set[str] = field(default_factory=set)  # values between the weight and its readers

    @property
    def in_features(self) -> int:
        if self.kind == "Conv":
            return int(self.shape[1])
        return int(self.shape[1] if self.transposed else self.shape[0])

    @property
    def out_features(self) -> int:
        if self.kind == "Conv":
            return int(self.shape[0])
        return int(self.shape[0] if self.transposed else self.shape[1])

    @property
    def kernel(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.shape[2:]) if self.kind == "Conv" else ()

    @property
    def rank_limit(self) -> int:
        """The largest useful rank: that of one group's block of the weight (the whole weight if ungrouped)."""
        return min(self.in_features * int(np.prod(self.kernel, dtype=np.int64)), self.out_features // self.group)


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def find_candidates(graph: onnx.GraphProto) -> dict[str, Target]:
    """Every weight that a MatMul, Gemm or Conv reads, by initializer name, in graph order."""
    inits = {t.name: t for t in graph.initializer}
    producer, readers = producers(graph.node), consumers(graph.node)
    found: dict[str, Target] = {}
    for node in graph.node:
        if not is_default(node.domain) or node.op_type not in ADAPTABLE_OPS or len(node.input) < 2:
            continue
        traced = _trace(node.input[_WEIGHT_INPUT[node.op_type]], inits, producer)
        if traced is None:
            continue  # an activation (attention scores), not a weight
        weight, transposed, dequantize, chain = traced
        if node.op_type == "Gemm" and _attr(node, "transB", 0):
            transposed = not transposed
        init = inits[weight]
        group = int(_attr(node, "group", 1)) if node.op_type == "Conv" else 1
        target = found.setdefault(weight, Target(weight, node.op_type, shape=tuple(init.dims), transposed=transposed,
                                                 dequantize=dequantize, dtype=_float_type(init, dequantize, inits, producer), group=group))
        target.nodes.append(node.name)
        if target.reason:
            continue
        if (target.kind, target.transposed, target.dequantize, target.group) != (node.op_type, transposed, dequantize, group):
            target.reason = f"it is read by nodes of different kinds, layouts or groups ({target.nodes})"
        elif node.op_type != "Conv" and len(init.dims) != 2:
            target.reason = f"it is {len(init.dims)}-D; LoRA adapts 2-D weight matrices"
        elif node.op_type == "Gemm" and _attr(node, "transA", 0):
            target.reason = f"Gemm node {node.name!r} has transA=1"
        target.chain.update(chain)
    for target in found.values():  # every reader of the weight must be one the adapter accounts for
        accounted = set(target.nodes) | {producer[v].name for v in target.chain}
        others = sorted({r.name or r.op_type for v in (target.weight, *target.chain) for r in readers.get(v, []) if r.name not in accounted})
        if target.reason is None and others:
            target.reason = f"it is also read by {others}, which an adapter would not change"
    return found


def _trace(value: str, inits, producer) -> tuple[str, bool, str | None, list[str]] | None:
    """(initializer, transposed, DequantizeLinear node, values on the way) behind ``value``."""
    transposed, dequantize, chain = False, None, []
    for _ in range(8):
        if value in inits:
            return value, transposed, dequantize, chain
        node = producer.get(value)
        if node is None or not is_default(node.domain):
            return None
        chain.append(value)
        if node.op_type == "Transpose" and _attr(node, "perm", [1, 0]) in ([1, 0], (1, 0)):
            transposed = not transposed
        elif node.op_type == "DequantizeLinear" and dequantize is None:
            dequantize = node.name
        elif node.op_type != "Identity":
            return None
        value = node.input[0]
    return None


def _float_type(init: onnx.TensorProto, dequantize: str | None, inits, producer) -> np.dtype:
    """The adapter's dtype: the weight's, or for a quantized weight its scale's."""
    if dequantize is not None:
        node = next(n for n in producer.values() if n.name == dequantize)
        scale = inits.get(node.input[1])
        return helper.tensor_dtype_to_np_dtype(scale.data_type) if scale is not None else np.dtype(np.float32)
    return helper.tensor_dtype_to_np_dtype(init.data_type)


def select(graph: onnx.GraphProto, config: LoraConfig, source: str = "model") -> list[Target]:
    """The targets ``config`` selects, checked against its rank; errors name the glob or weight."""
    candidates = find_candidates(graph)
    chosen: dict[str, Target] = {}
    for pattern in config.targets:
        if pattern in ADAPTABLE_OPS:
            # an op type may select nothing (targets: [Gemm, Conv] suits an MLP and a CNN alike), as long as something is chosen
            # a grouped Conv whose blocks cannot hold the rank (a depthwise conv's block is one output
            # channel: rank 1) is left out of an op-type selection; a glob naming it is an error below
            hits = [t for t in candidates.values() if t.kind == pattern and t.reason is None and (t.group == 1 or config.rank <= t.rank_limit)]
        else:
            matched = [t for t in candidates.values()
                       if fnmatch.fnmatchcase(t.weight, pattern) or any(fnmatch.fnmatchcase(n, pattern) for n in t.nodes)]
            if not matched:
                raise LoraError(f"{source}: LoRA target glob {pattern!r} matches no weight or node; "
                                f"the weights of MatMul, Gemm and Conv nodes are {_preview(candidates)}")
            refused = [t for t in matched if t.reason]
            if refused:
                raise LoraError(f"{source}: LoRA target glob {pattern!r} matches weight {refused[0].weight!r}, but {refused[0].reason}")
            hits = matched
        for t in hits:
            chosen.setdefault(t.weight, t)
    if not chosen:
        kinds = [p for p in config.targets if p in ADAPTABLE_OPS]
        raise LoraError(f"{source}: LoRA targets {kinds} select no {'/'.join(kinds)} node with a weight an adapter can sit beside"
                        f"{''.join(_refusals(candidates, k) for k in kinds)}; the adaptable weights are {_preview(candidates)}")
    for t in chosen.values():
        limit = t.rank_limit
        if config.rank > limit:
            groups = f" in each of its {t.group} groups" if t.group > 1 else ""
            raise LoraError(f"{source}: LoRA rank {config.rank} is larger than weight {t.weight!r} (node {t.nodes[0]!r}) allows: it maps "
                            f"{t.in_features * int(np.prod(t.kernel, dtype=np.int64))} to {t.out_features // t.group} features{groups}, "
                            f"so the rank is at most {limit}; use rank <= {limit} or leave this weight out of the targets")
    return [t for t in candidates.values() if t.weight in chosen]  # graph order, whatever the targets' order


def _refusals(candidates: dict[str, Target], kind: str) -> str:
    refused = [t for t in candidates.values() if t.kind == kind and t.reason]
    return f" (weight {refused[0].weight!r} cannot take one: {refused[0].reason})" if refused else ""


def _preview(candidates: dict[str, Target], n: int = 12) -> str:
    names = [f"{t.weight} ({t.kind} {t.nodes[0]})" for t in candidates.values() if t.reason is None]
    if not names:
        return "none"
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")
