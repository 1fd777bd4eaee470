"""Gradient rules: reductions, cumulative sums, the softmax family, TopK.

A reduction's gradient is its output gradient put back on the reduced axes (``keep``)
and broadcast over the input, times the local derivative.
"""
from __future__ import annotations

import numpy as np

from odt_ops.grad.registry import gradient


def _keep(ctx, g: str) -> str:
    """``g`` (shaped like the reduction's output) with the reduced axes restored as size 1."""
    axes = ctx.inputs[1]
    if ctx.attrs["keepdims"] or not _has_axes(ctx):
        return g  # keepdims, or everything reduced to a scalar: broadcasting does the rest
    return ctx.b.Unsqueeze(g, axes)


def _has_axes(ctx) -> bool:
    axes = ctx.inputs[1]
    if not axes:
        return False
    value = ctx.value(axes)
    return value is None or value.size > 0


def _is_noop(ctx) -> bool:
    return not _has_axes(ctx) and bool(ctx.attrs.get("noop_with_empty_axes", 0))


def _broadcast_to_input(ctx, g: str) -> str:
    return ctx.b.Expand(g, ctx.shape_of(ctx.inputs[0]))


def _reduced_count(ctx) -> str:
    """How many elements each output element summed, as a constant when shapes are static."""
    X, (Y,) = ctx.inputs[0], ctx.outputs
    xs, ys = ctx.static_shape(X), ctx.static_shape(Y)
    if xs is not None and ys is not None:
        return ctx.const(1.0 / max(1, int(np.prod(xs)) // max(1, int(np.prod(ys)))), like=X)
    b = ctx.b
    return b.Div(b.CastLike(b.Size(Y), X), b.CastLike(b.Size(X), X))


@gradient("ReduceSum")
def reduce_sum_grad(ctx, dY):
    """dX = broadcast(dY)"""
    if _is_noop(ctx):
        return (dY,)
    return (_broadcast_to_input(ctx, _keep(ctx, dY)),)


@gradient("ReduceMean")
def reduce_mean_grad(ctx, dY):
    """dX = broadcast(dY) / n"""
    if _is_noop(ctx):
        return (dY,)
    return (_broadcast_to_input(ctx, ctx.b.Mul(_keep(ctx, dY), _reduced_count(ctx))),)


def _elementwise_reduce(formula):
    """A rule for reductions whose gradient is keep(dY) times a function of X and keep(Y)."""

    def rule(ctx, dY):
        if _is_noop(ctx):
            raise ctx.fail("noop_with_empty_axes with empty axes is not differentiated for this reduction")
        return (formula(ctx, _keep(ctx, dY), ctx.inputs[0], _keep(ctx, ctx.outputs[0])),)

    rule.__doc__ = formula.__doc__
    return rule


def _extremum(ctx, g, X, Y):
    """dX = dY shared evenly among the elements equal to Y"""
    b = ctx.b
    hit = b.CastLike(b.Equal(X, Y), X)
    ties = b.ReduceSum(hit, ctx.inputs[1], keepdims=1)
    return b.Mul(hit, b.Div(g, ties))


gradient("ReduceMax")(_elementwise_reduce(_extremum))
gradient("ReduceMin")(_elementwise_reduce(_extremum))


@gradient("ReduceProd")
@_elementwise_reduce
def reduce_prod_grad(ctx, g, X, Y):
    """dX = dY * Y / X (inputs are assumed non-zero)"""
    return ctx.b.Div(ctx.b.Mul(g, Y), X)


@gradient("ReduceL1")
@_elementwise_reduce
def reduce_l1_grad(ctx, g, X, Y):
    """dX = dY * sign(X)"""
    return ctx.b.Mul(g, ctx.b.Sign(X))


@gradient("ReduceL2")
@_elementwise_reduce
def reduce_l2_grad(ctx, g, X, Y):
    """dX = dY * X / Y"""
    return ctx.b.Mul(ctx.b.Div(g, Y), X)


@gradient("ReduceSumSquare")
@_elementwise_reduce
def reduce_sum_square_grad(ctx, g, X, Y):
    """dX = 2 dY X"""
    return ctx.b.Mul(ctx.b.Mul(g, ctx.const(2, like=X)), X)


@gradient("ReduceLogSum")
@_elementwise_reduce
def reduce_log_sum_grad(ctx, g, X, Y):
    """dX = broadcast(dY / exp(Y))"""
    return _broadcast_to_input(ctx, ctx.b.Div(g, ctx.b.Exp(Y)))


@gradient("ReduceLogSumExp")
@_elementwise_reduce
def reduce_log_sum_exp_grad(ctx, g, X, Y):
    """dX = dY * exp(X - Y)"""
    return ctx.b.Mul(g, ctx.b.Exp(ctx.b.Sub(X, Y)))


@gradient("LpNormalization")
def lp_normalization_grad(ctx, dY):
    """Y = X / n, n the Lp norm along axis: dX = (dY - d(n)/dX * sum(dY * Y, axis)) / n,
    with d(n)/dX = Y for p = 2 and sign(X) for p = 1"""
    b, X, (Y,) = ctx.b, ctx.inputs[0], ctx.outputs
    p, axis = ctx.attrs["p"], ctx.ints([ctx.attrs["axis"]])
    if p not in (1, 2):
        raise ctx.fail(f"LpNormalization is defined for p = 1 or 2, got {p}")
    norm = b.ReduceL2(X, axis, keepdims=1) if p == 2 else b.ReduceL1(X, axis, keepdims=1)
    slope = Y if p == 2 else b.Sign(X)
    dot = b.ReduceSum(b.Mul(dY, Y), axis, keepdims=1)
    return (b.Div(b.Sub(dY, b.Mul(slope, dot)), norm),)


@gradient("CumSum")
def cum_sum_grad(ctx, dY):
    """dX = cumsum of dY in the opposite direction"""
    X, axis = ctx.inputs[:2]
    return (ctx.b.CumSum(dY, axis, exclusive=ctx.attrs["exclusive"], reverse=1 - ctx.attrs["reverse"]), None)


@gradient("Softmax")
def softmax_grad(ctx, dY):
    """dX = Y * (dY - sum(dY * Y, axis))"""
    b, (Y,) = ctx.b, ctx.outputs
    dot = b.ReduceSum(b.Mul(dY, Y), ctx.ints([ctx.attrs["axis"]]), keepdims=1)
    return (b.Mul(Y, b.Sub(dY, dot)),)


@gradient("LogSoftmax")
def log_softmax_grad(ctx, dY):
    """dX = dY - exp(Y) * sum(dY, axis)"""
    b, (Y,) = ctx.b, ctx.outputs
    total = b.ReduceSum(dY, ctx.ints([ctx.attrs["axis"]]), keepdims=1)
    return (b.Sub(dY, b.Mul(b.Exp(Y), total)),)


@gradient("TopK")
def top_k_grad(ctx, dValues, dIndices=None):
    """dX = scatter dValues to Indices along axis, zeros elsewhere"""
    if dValues is None:
        return ()
    X = ctx.inputs[0]
    indices = ctx.output(1)
    return (ctx.b.ScatterElements(ctx.zeros_like(X), indices, dValues, axis=ctx.attrs["axis"]), None)


@gradient("Hardmax")
def hardmax_grad(ctx, dY):
    """dX = 0 (piecewise constant)"""
    return ()
