"""Gradient rules: SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.

Both weigh position n by w_n = weights[label_n] (1 without weights), 0 where the label
is ignore_index, and 'mean' divides by the sum of w_n, as the kernels do. The gradient
reaches the scores only; labels and class weights get none.
"""
from __future__ import annotations

import numpy as np

from odt_ops.grad.registry import gradient


def _coefficient(ctx, dLoss: str) -> tuple[str, str, bool]:
    """(labels safe to one-hot, per-position factor on the gradient, whether the factor has
    the labels' shape rather than being a scalar)."""
    b, (scores, labels, weights) = ctx.b, ctx.inputs[:3]
    ignore, reduction = ctx.attrs.get("ignore_index"), ctx.attrs["reduction"]
    zero, one = ctx.const(0, like=scores), ctx.const(1, like=scores)
    safe, w = labels, None
    if ignore is not None:
        ignored = b.Equal(labels, b.CastLike(ctx.ints(ignore), labels))
        safe = b.Where(ignored, b.CastLike(ctx.ints(0), labels), labels)
        w = b.Where(ignored, zero, b.Gather(weights, safe) if weights else one)
    elif weights:
        w = b.Gather(weights, safe)
    if w is None:
        if reduction != "mean":
            return safe, dLoss, reduction == "none"
        return safe, b.Mul(dLoss, _inverse_count(ctx, labels)), False
    if reduction == "mean":
        return safe, b.Mul(w, b.Div(dLoss, b.ReduceSum(w, keepdims=0))), True
    return safe, b.Mul(w, dLoss), True


def _inverse_count(ctx, labels: str) -> str:
    static = ctx.static_shape(labels)
    if static is not None:
        return ctx.const(1.0 / max(1, int(np.prod(static))), like=ctx.inputs[0])
    b, one = ctx.b, ctx.const(1, like=ctx.inputs[0])
    return b.Div(one, b.CastLike(b.Size(labels), one))


def _one_hot(ctx, safe: str) -> str:
    b, scores = ctx.b, ctx.inputs[0]
    shape = ctx.shape(scores)
    depth = ctx.ints(shape[1]) if shape is not None and isinstance(shape[1], int) else b.Shape(scores, start=1, end=2)
    values = ctx.b.constant(np.array([0, 1], dtype=ctx.dtype(scores)))
    return b.OneHot(safe, depth, values, axis=1)


def _scaled(ctx, g: str, coefficient: str, per_position: bool) -> str:
    return ctx.b.Mul(g, ctx.b.Unsqueeze(coefficient, ctx.ints([1])) if per_position else coefficient)


@gradient("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss_grad(ctx, dLoss, dLogProb=None):
    """dscores = (softmax(scores) - onehot(labels)) * w / (sum w if mean) * dLoss
    (+ dLogProb - softmax * sum(dLogProb, axis=1) when log_prob is used too)"""
    b = ctx.b
    log_prob = ctx.output(1)
    prob = b.Exp(log_prob)
    dscores = None
    if dLoss is not None:
        safe, coefficient, per_position = _coefficient(ctx, dLoss)
        dscores = _scaled(ctx, b.Sub(prob, _one_hot(ctx, safe)), coefficient, per_position)
    if dLogProb is not None:
        through = b.Sub(dLogProb, b.Mul(prob, b.ReduceSum(dLogProb, ctx.ints([1]), keepdims=1)))
        dscores = through if dscores is None else b.Add(dscores, through)
    return dscores, None, None


@gradient("NegativeLogLikelihoodLoss")
def negative_log_likelihood_loss_grad(ctx, dLoss):
    """dinput = -onehot(target) * w / (sum w if mean) * dLoss"""
    safe, coefficient, per_position = _coefficient(ctx, dLoss)
    return ctx.b.Neg(_scaled(ctx, _one_hot(ctx, safe), coefficient, per_position)), None, None
