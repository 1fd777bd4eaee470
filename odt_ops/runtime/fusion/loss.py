"""The softmax cross-entropy loss and its gradient's one-hot subtraction, as one node."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels.loss import label_positions
from odt_ops.runtime.fusion.graph import STANDARD, Graph, fused_node, fused_op, fusion, kernel_of


@fusion("softmax_cross_entropy_grad")
def _softmax_cross_entropy_grad(g: Graph) -> bool:
    """SoftmaxCrossEntropyLoss and its gradient rule's (Exp(log_prob) - OneHot(labels)) * coefficient
    -> one node returning loss, log_prob and dscores: the one-hot subtraction becomes a 1
    taken off the labels' entries, in place."""
    changed = False
    for sce in [n for n in g.nodes if n.op_type == "SoftmaxCrossEntropyLoss" and n.domain in STANDARD]:
        if len(sce.output) != 2 or not sce.output[1]:
            continue
        log_prob = sce.output[1]
        for exp in [n for n in g.consumers(log_prob) if n.op_type == "Exp" and n.domain in STANDARD]:
            sub = g.sole_reader(exp.output[0], "Sub", 0)
            if sub is None:
                continue
            one_hot = g.producer(sub.input[1], "OneHot")
            mul = g.sole_reader(sub.output[0], "Mul", 0)
            if one_hot is None or mul is None or g.sole_reader(one_hot.output[0], "Sub") is not sub:
                continue
            values = g.constant(one_hot.input[2])
            if node_attributes(one_hot).get("axis", -1) != 1 or values is None or values.tolist() != [0, 1]:
                continue
            others = [n for n in g.consumers(log_prob) if n is not exp]
            attrs = node_attributes(sce)
            # the loss kernel has checked its labels lie in [0, C): a one-hot of them needs no check
            checked = one_hot.input[0] == sce.input[1] and "ignore_index" not in attrs
            fused = fused_node(
                "SoftmaxCrossEntropyLossGrad",
                [sce.input[0], sce.input[1], sce.input[2] if len(sce.input) > 2 else "", *one_hot.input[:3], mul.input[1]],
                [sce.output[0], log_prob if others or log_prob in g.keep else "", mul.output[0]],
                f"fused/{sce.name or sce.output[0]}", reduction=attrs.get("reduction"), ignore_index=attrs.get("ignore_index"),
                labels_checked=int(checked))
            if g.replace([sce, exp, one_hot, sub, mul], fused):
                changed = True
                break
    return changed


@fused_op("SoftmaxCrossEntropyLossGrad")
def _softmax_cross_entropy_loss_grad(attrs: dict, opset: int) -> Callable[..., tuple]:
    checked = attrs.pop("labels_checked", 0)
    sce = kernel_of("SoftmaxCrossEntropyLoss", opset, _num_outputs=2, **attrs)
    one_hot = kernel_of("OneHot", opset, axis=1)

    def run(scores, labels, weights, indices, depth, values, coefficient):
        loss, log_prob = sce(scores, labels, weights)[:2]
        grad = np.exp(log_prob)
        if not _take_one_at(grad, indices, depth, checked):
            grad = np.subtract(grad, one_hot(indices, depth, values)[0])
        if coefficient.dtype == grad.dtype and _broadcasts_into(coefficient.shape, grad.shape):
            grad *= coefficient
        else:
            grad = np.multiply(grad, coefficient)
        return loss, log_prob, grad

    return run


def _broadcasts_into(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    return len(small) <= len(big) and all(s in (1, b) for s, b in zip(reversed(small), reversed(big)))


def _take_one_at(grad: np.ndarray, indices: np.ndarray, depth: np.ndarray, checked: bool) -> bool:
    """grad - OneHot(indices, depth, [0, 1], axis=1), in place, where the one-hot is simply the
    indices' entries (integers in [0, depth), depth = grad.shape[1]); False otherwise."""
    if grad.ndim < 2 or indices.dtype.kind not in "iu" or indices.shape != (grad.shape[0], *grad.shape[2:]):
        return False
    if int(depth.reshape(-1)[0]) != grad.shape[1]:
        return False
    if indices.size == 0:
        return True
    if not checked and (indices.min() < 0 or indices.max() >= grad.shape[1]):
        return False
    one = grad.dtype.type(1)
    if grad.ndim == 2 and grad.flags.c_contiguous:
        flat, at = grad.reshape(-1), label_positions(grad, indices)
        flat[at] = flat.take(at) - one
    else:
        at = np.expand_dims(indices, 1)
        np.put_along_axis(grad, at, np.take_along_axis(grad, at, 1) - one, 1)
    return True
