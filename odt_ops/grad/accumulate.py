"""How the gradient contributions of a value read by several nodes (its fan-out) combine.

Usually a Sum. Two kinds of fan-out have a cheaper total, equal in exact arithmetic:

- A weight read by k matrix products (a recurrent net's recurrence weight, once per
  time step): its contributions are ``A_i^T g_i``, and their sum is one product of the
  stacked operands, ``[A_1; ...; A_k]^T [g_1; ...; g_k]``. That is one GEMM where there were
  k small ones and a k-way Sum (an LSTM over 20 steps: 20 GEMMs of (H, B) x (B, 4H) and
  a 20-input Sum of (H, 4H)). Only the summation order changes. The operands now live
  until the end of the backward pass instead of one step, which is one time step's
  gradient per step: the size of the activations the backward already keeps.
- A tensor cut into slices read separately (the exporter reorders an LSTM's gates by
  slicing its weights): each contribution is a slice's gradient padded with zeros back
  to the whole, and when the slices tile one axis the sum of the padded pieces is just
  their Concat in place order (x + 0 == x), with no zeros written and no Sum.
"""
from __future__ import annotations

import onnx

from odt_ops.domain import is_default
from odt_ops.ir.attributes import node_attributes
from odt_ops.ir.builder import GraphBuilder


def total(b: GraphBuilder, contributions: list[str] | None, value: str) -> str | None:
    """The gradient of ``value``: its single contribution, or the total of its fan-out."""
    if not contributions:
        return None
    if len(contributions) == 1:
        return contributions[0]
    producers = _sole_producers(b, contributions)
    with b.scope(f"sum/{value}"):
        if producers is not None:
            for combine in (_stacked_product, _tiled_concat):
                combined = combine(b, producers, value)
                if combined is not None:
                    for node in producers:
                        b.nodes.remove(node)
                    return combined
        return b.op("Sum", contributions)


def _sole_producers(b: GraphBuilder, contributions: list[str]) -> list[onnx.NodeProto] | None:
    """The emitted node that makes each contribution, when each is a distinct single-output
    node's output that no emitted node reads (so it can be replaced); else None."""
    if len(set(contributions)) != len(contributions):
        return None
    wanted = set(contributions)
    made: dict[str, onnx.NodeProto] = {}
    for node in b.nodes:
        if wanted.intersection(node.input):
            return None
        if len(node.output) == 1 and node.output[0] in wanted:
            made[node.output[0]] = node
    if len(made) != len(contributions):
        return None
    return [made[c] for c in contributions]


def _stacked_product(b: GraphBuilder, producers: list[onnx.NodeProto], value: str) -> str | None:
    """sum_i Gemm(A_i, g_i, transA=1) -> Gemm(Concat(A_i), Concat(g_i), transA=1), rows stacked."""
    left, right = [], []
    for node in producers:
        attrs = node_attributes(node)
        if (node.op_type != "Gemm" or not is_default(node.domain) or len(node.input) != 2
                or attrs.get("transA", 0) != 1 or attrs.get("transB", 0) != 0 or attrs.get("alpha", 1.0) != 1.0):
            return None
        left.append(node.input[0])
        right.append(node.input[1])
    if not (_stackable(b, left) and _stackable(b, right)):
        return None
    return b.Gemm(b.Concat(*left, axis=0), b.Concat(*right, axis=0), transA=1)


def _stackable(b: GraphBuilder, names: list[str]) -> bool:
    """Matrices whose column counts are known and equal, so Concat along rows is valid."""
    shapes = [b.shape(n) for n in names]
    if any(s is None or len(s) != 2 or s[1] is None for s in shapes):
        return False
    return len({s[1] for s in shapes}) == 1 and len({b.dtype(n) for n in names}) == 1


def _tiled_concat(b: GraphBuilder, producers: list[onnx.NodeProto], value: str) -> str | None:
    """sum_i Pad(x_i) with zero pads on one axis whose pieces tile it -> Concat of the x_i in order."""
    whole = b.shape(value)
    if whole is None:
        return None
    pieces, axis = [], None
    for node in producers:
        placed = _zero_pad_on_one_axis(b, node, len(whole))
        if placed is None:
            return None
        a, begin, end = placed
        if axis not in (None, a) or not isinstance(whole[a], int):
            return None
        axis = a
        pieces.append((begin, whole[a] - begin - end, node.input[0]))
    pieces.sort()
    at = 0
    for begin, length, _ in pieces:
        if begin != at or length <= 0:
            return None
        at += length
    if at != whole[axis]:
        return None
    return b.Concat(*(x for _, _, x in pieces), axis=axis)


def _zero_pad_on_one_axis(b: GraphBuilder, node: onnx.NodeProto, rank: int) -> tuple[int, int, int] | None:
    """(axis, begin, end) of a constant-mode Pad with zero fill and non-negative constant pads
    on exactly one axis; else None."""
    if node.op_type != "Pad" or not is_default(node.domain) or node_attributes(node).get("mode", "constant") != "constant":
        return None
    inputs = list(node.input) + [""] * (4 - len(node.input))
    pads = b.value(inputs[1]) if inputs[1] else None
    fill = b.value(inputs[2]) if inputs[2] else None
    axes = b.value(inputs[3]) if inputs[3] else None
    if pads is None or (inputs[2] and (fill is None or fill.size != 1 or fill.reshape(-1)[0] != 0)) or (inputs[3] and axes is None):
        return None
    axes_ = [int(a) % rank for a in axes.reshape(-1)] if axes is not None else list(range(rank))
    pads_ = [int(p) for p in pads.reshape(-1)]
    if len(pads_) != 2 * len(axes_) or min(pads_, default=0) < 0:
        return None
    padded = [(a, pads_[i], pads_[len(axes_) + i]) for i, a in enumerate(axes_) if pads_[i] or pads_[len(axes_) + i]]
    return padded[0] if len(padded) == 1 else None
