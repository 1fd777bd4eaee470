"""The four losses of onnxruntime.training, with their options, as Blocks.

Each ``build(output_name, target_name)`` adds the target (labels) as a new graph
input and returns the loss value's name.
"""
from __future__ import annotations

import numpy as np
import onnx

from odt_ops.errors import ArgumentError
from odt_ops.onnxblock.base import Block, current_builder
from odt_ops.onnxblock.blocks import InputLike, add_input, value_info

REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise ArgumentError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def _reduce(x: str, reduction: str) -> str:
    if reduction == "none":
        return x
    return current_builder().op("ReduceMean" if reduction == "mean" else "ReduceSum", [x], keepdims=0)


class MSELoss(Block):
    """mean((output - target)^2)"""

    takes_all_outputs = False

    def __init__(self, reduction: str = "mean"):
        self.reduction = _check_reduction(reduction)

    def build(self, output_name: str, target_name: str = "target") -> str:
        b = current_builder()
        diff = b.op("Sub", [output_name, InputLike(output_name)(target_name)])
        return _reduce(b.op("Mul", [diff, diff]), self.reduction)


class L1Loss(Block):
    """mean(|output - target|)"""

    takes_all_outputs = False

    def __init__(self, reduction: str = "mean"):
        self.reduction = _check_reduction(reduction)

    def build(self, output_name: str, target_name: str = "target") -> str:
        b = current_builder()
        return _reduce(b.op("Abs", [b.op("Sub", [output_name, InputLike(output_name)(target_name)])]), self.reduction)


class BCEWithLogitsLoss(Block):
    """w * (pos_weight * y * softplus(-x) + (1 - y) * softplus(x)), torch's stable form."""

    takes_all_outputs = False

    def __init__(self, weight=None, reduction: str = "mean", pos_weight=None):
        self.reduction = _check_reduction(reduction)
        self.weight = None if weight is None else np.asarray(weight, np.float32)
        self.pos_weight = None if pos_weight is None else np.asarray(pos_weight, np.float32)

    def build(self, output_name: str, target_name: str = "target") -> str:
        b = current_builder()
        y = InputLike(output_name)(target_name)
        positive = b.op("Mul", [y, b.op("Softplus", [b.op("Neg", [output_name])])])
        if self.pos_weight is not None:
            positive = b.op("Mul", [positive, b.constant(self.pos_weight)])
        negative = b.op("Mul", [b.op("Sub", [b.constant(np.float32(1)), y]), b.op("Softplus", [output_name])])
        loss = b.op("Add", [positive, negative])
        if self.weight is not None:
            loss = b.op("Mul", [loss, b.constant(self.weight)])
        return _reduce(loss, self.reduction)


class CrossEntropyLoss(Block):
    """Softmax cross-entropy on class scores [N, C, ...] against int64 labels [N, ...],
    as torch.nn.CrossEntropyLoss: class ``weight``, ``ignore_index``, ``label_smoothing``."""

    takes_all_outputs = False

    def __init__(self, weight=None, reduction: str = "mean", ignore_index: int | None = None, label_smoothing: float = 0.0):
        self.reduction = _check_reduction(reduction)
        self.weight = None if weight is None else np.asarray(weight, np.float32)
        self.ignore_index = ignore_index
        if not 0.0 <= label_smoothing <= 1.0:
            raise ArgumentError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        self.label_smoothing = float(label_smoothing)

    def build(self, scores_name: str, labels_name: str = "labels") -> str:
        b = current_builder()
        tt = value_info(scores_name).type.tensor_type
        dims = [d.dim_param or (d.dim_value if d.HasField("dim_value") else None) for d in tt.shape.dim]
        labels = add_input(labels_name, onnx.TensorProto.INT64, [dims[0], *dims[2:]] if dims else None)
        inputs = [scores_name, labels] + ([b.constant(self.weight)] if self.weight is not None else [])
        attrs = {} if self.ignore_index is None else {"ignore_index": int(self.ignore_index)}
        if self.label_smoothing == 0.0:
            return b.op("SoftmaxCrossEntropyLoss", inputs, reduction=self.reduction, **attrs)
        return self._smoothed(b, inputs, attrs, labels, num_classes=dims[1] if len(dims) > 1 else None)

    def _smoothed(self, b, inputs, attrs, labels, num_classes) -> str:
        """(1-e) * nll + e/C * sum_c -w_c log p_c, per sample, with torch's mean denominator."""
        if not isinstance(num_classes, int):
            raise ArgumentError("label_smoothing needs a static number of classes (dimension 1 of the scores)")
        eps = self.label_smoothing
        nll, log_prob = b.op_multi("SoftmaxCrossEntropyLoss", inputs, 2, reduction="none", **attrs)
        weighted = log_prob
        if self.weight is not None:
            # the class axis is 1: broadcast the weight as [C, 1, ...] over trailing dims
            rank_tail = max(0, len(value_info(inputs[0]).type.tensor_type.shape.dim) - 2)
            weighted = b.op("Mul", [log_prob, b.constant(self.weight.reshape([num_classes] + [1] * rank_tail))])
        smooth = b.op("Neg", [b.op("ReduceSum", [weighted, b.constant(np.array([1], np.int64))], keepdims=0)])
        if self.ignore_index is not None:
            ignored = b.op("Equal", [labels, b.constant(np.array(self.ignore_index, np.int64))])
            smooth = b.op("Where", [ignored, b.constant(np.float32(0)), smooth])
        per_sample = b.op("Add", [b.op("Mul", [nll, b.constant(np.float32(1 - eps))]),
                                  b.op("Mul", [smooth, b.constant(np.float32(eps / num_classes))])])
        if self.reduction == "none":
            return per_sample
        total = b.op("ReduceSum", [per_sample], keepdims=0)
        if self.reduction == "sum":
            return total
        return b.op("Div", [total, self._denominator(b, labels)])

    def _denominator(self, b, labels: str) -> str:
        """Sum of the labels' class weights over non-ignored samples (their count without weights)."""
        valid = None
        safe = labels
        if self.ignore_index is not None:
            valid = b.op("Not", [b.op("Equal", [labels, b.constant(np.array(self.ignore_index, np.int64))])])
            safe = b.op("Where", [valid, labels, b.constant(np.array(0, np.int64))])
        if self.weight is not None:
            w = b.op("Gather", [b.constant(self.weight), safe], axis=0)
        else:
            w = b.op("CastLike", [b.op("Equal", [safe, safe]), b.constant(np.float32(0))])
        if valid is not None:
            w = b.op("Where", [valid, w, b.constant(np.float32(0))])
        return b.op("ReduceSum", [w], keepdims=0)
