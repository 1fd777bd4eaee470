"""Gradient rules: the pools. Average and Lp pools spread dY back over their windows (with
stride 1 an AveragePool over the mirrored padding, else a ConvTranspose by a ones kernel);
MaxPool scatters dY to the forward's Indices output (ties: the index the forward picked, as
onnxruntime and PyTorch do)."""
from __future__ import annotations

import math

import numpy as np

from odt_ops.grad.registry import gradient
from odt_ops.grad.rules.windows import Window, forward_geometry, forward_window, input_grad, mirrored_pads, spatial_sizes
from odt_ops.kernels.geometry import window_counts


def _pool_geometry(ctx, X: str):
    """(spatial dims of X, the pool's geometry)"""
    kernel = ctx.attrs.get("kernel_shape")
    if kernel is None:
        raise ctx.fail("the kernel_shape attribute is missing")
    spatial = spatial_sizes(ctx, X)
    return spatial, forward_geometry(ctx, spatial, tuple(kernel))


def _window_sum_adjoint(ctx, g: str, X: str, window: Window) -> str:
    """The adjoint of summing every window of X: each input position gets the sum of g over the
    windows covering it. With stride 1 that is itself a window sum (an AveragePool over the
    mirrored padding, times the window size); otherwise one ConvTranspose by a ones kernel,
    channels folded into the batch."""
    b = ctx.b
    mirrored = mirrored_pads(window)
    if mirrored is not None and all(p < k for p, k in zip(mirrored, window.kernel * 2)):  # pools need pads < kernel
        dilations = list(window.dilations) if any(d > 1 for d in window.dilations) else None
        total = b.AveragePool(g, kernel_shape=list(window.kernel), pads=mirrored, dilations=dilations,
                              count_include_pad=1)
        size = math.prod(window.kernel)
        return b.Mul(total, ctx.const(size, like=X)) if size > 1 else total
    planes = b.Reshape(g, ctx.ints([-1, 1, *spatial_sizes(ctx, g)]))
    ones = ctx.const(np.ones((1, 1, *window.kernel)), like=X)
    return b.Reshape(input_grad(ctx, planes, ones, window, 1), ctx.shape_of(X))


@gradient("AveragePool")
def average_pool_grad(ctx, dY):
    """dX = every window's dY / count spread evenly over the window (count with or without the
    padding, as count_include_pad says)"""
    X = ctx.inputs[0]
    spatial, geo = _pool_geometry(ctx, X)
    counts = window_counts(spatial, geo, bool(ctx.attrs["count_include_pad"]))
    full = math.prod(geo.kernel)
    scale = 1.0 / full if (counts == full).all() else 1.0 / counts
    g = ctx.b.Mul(dY, ctx.const(scale, like=X))
    return (_window_sum_adjoint(ctx, g, X, forward_window(geo, spatial)),)


@gradient("LpPool")
def lp_pool_grad(ctx, dY):
    """Y = (sum |X|^p)^(1/p) per window: dX = sign(X) |X|^(p-1) * sum over covering windows of
    dY * Y^(1-p) (0 where Y = 0)"""
    b, X, (Y,) = ctx.b, ctx.inputs[0], ctx.outputs
    p = ctx.attrs["p"]
    spatial, geo = _pool_geometry(ctx, X)
    zero = ctx.const(0, like=X)
    g = dY if p == 1 else b.Where(b.Greater(Y, zero), b.Mul(dY, b.Pow(Y, ctx.const(1 - p, like=X))), zero)
    spread = _window_sum_adjoint(ctx, g, X, forward_window(geo, spatial))
    if p == 1:
        local = b.Sign(X)
    elif p == 2:
        local = X
    else:
        local = b.Mul(b.Sign(X), b.Pow(b.Abs(X), ctx.const(p - 1, like=X)))
    return (b.Mul(spread, local),)


@gradient("MaxPool")
def max_pool_grad(ctx, dY, dIndices=None):
    """dX = dY scattered (added, where windows overlap) to the Indices the forward picked"""
    b, X = ctx.b, ctx.inputs[0]
    if dY is None:
        return ()
    spatial, geo = _pool_geometry(ctx, X)
    indices = ctx.output(1)
    if ctx.attrs["storage_order"]:
        indices = _row_major(ctx, indices, spatial)
    overlapping = any(s < e for s, e in zip(geo.strides, geo.extents))
    flat = b.Reshape(indices, ctx.ints([-1]))
    scattered = b.ScatterElements(_flat_zeros(ctx, X), flat, b.Reshape(dY, ctx.ints([-1])), axis=0,
                                  reduction="add" if overlapping else None)
    return (b.Reshape(scattered, ctx.shape_of(X)),)


def _row_major(ctx, indices: str, spatial: tuple[int, ...]) -> str:
    """Indices in column-major order within each (n, c) plane (storage_order=1) made row-major.
    Indices are non-negative, so a % m is a - (a / m) * m with Div truncating."""
    b = ctx.b
    mod = lambda a, m: b.Sub(a, b.Mul(b.Div(a, ctx.ints(m)), ctx.ints(m)))
    within = mod(indices, math.prod(spatial))
    row = None
    for axis, n in enumerate(spatial):
        column_stride, row_stride = math.prod(spatial[:axis]), math.prod(spatial[axis + 1:])
        term = b.Mul(mod(b.Div(within, ctx.ints(column_stride)), n), ctx.ints(row_stride))
        row = term if row is None else b.Add(row, term)
    return b.Add(b.Sub(indices, within), row)


def _flat_zeros(ctx, X: str) -> str:
    static = ctx.static_shape(X)
    size = ctx.ints([math.prod(static)]) if static is not None else ctx.b.Reshape(ctx.b.Size(X), ctx.ints([1]))
    return ctx.b.ConstantOfShape(size, value=np.zeros((1,), dtype=ctx.dtype(X)))


@gradient("GlobalAveragePool")
def global_average_pool_grad(ctx, dY):
    """dX = dY / (number of spatial positions), broadcast over them"""
    b, X, (Y,) = ctx.b, ctx.inputs[0], ctx.outputs
    spatial = (ctx.shape(X) or (None,))[2:]
    if spatial and all(isinstance(d, int) for d in spatial):
        scale = ctx.const(1.0 / max(math.prod(spatial), 1), like=X)
    else:
        scale = b.Div(b.CastLike(b.Size(Y), X), b.CastLike(b.Size(X), X))
    return (b.Expand(b.Mul(dY, scale), ctx.shape_of(X)),)


@gradient("GlobalMaxPool")
def global_max_pool_grad(ctx, dY):
    """dX = dY at the first maximum of each (n, c) plane, as ArgMax picks it; zeros elsewhere"""
    b, X = ctx.b, ctx.inputs[0]
    planes = b.Reshape(X, ctx.ints([0, 0, -1]))
    first = b.ArgMax(planes, axis=2, keepdims=1)
    scattered = b.ScatterElements(ctx.zeros_like(planes), first, b.Reshape(dY, ctx.ints([0, 0, 1])), axis=2)
    return (b.Reshape(scattered, ctx.shape_of(X)),)
