"""Gradient rules: Conv, ConvTranspose and the pools.

Every rule here sees its op as a window sliding over a zero-padded input, resolved
statically by the forward kernels' own geometry helpers (so the gradient agrees with
the forward on auto_pad, ceil_mode and output_shape by construction). The window is
expressed as the pads it actually reads: the end pad may be negative when the last
window stops short of the input's end, the start pad negative when a ConvTranspose
output begins before its input grid.

The adjoints, chosen for being exact and fast in the numpy engine (and plain ONNX):
- the input gradient of a convolution is a ConvTranspose of dY by the same weights
  (output_padding recovering the input positions no window reached; a stride-1
  depthwise one is a Conv by the flipped kernel), and that of a ConvTranspose a Conv;
- the weight gradient gathers the window columns with one strided Slice per kernel tap
  and contracts them with dY in one MatMul per group, batch and positions together;
- average and Lp pools spread dY back over their windows: with stride 1 an AveragePool
  over the mirrored padding, else a ConvTranspose by a ones kernel;
- MaxPool scatters dY to the forward's Indices output (ties: the index the forward
  picked, as onnxruntime and PyTorch do).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from odt_ops.grad.registry import gradient
from odt_ops.kernels.geometry import ShapeOnly, per_axis, transpose_pads, window_counts, window_geometry

INT64_MIN = np.iinfo(np.int64).min


@dataclass(frozen=True)
class _Window:
    """A convolution window over a zero-padded input, per spatial axis."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]  # padding before the input (negative: the input starts cropped)
    end: tuple[int, ...]  # padding the last window reads past the input (negative: unread tail)

    @property
    def rank(self) -> int:
        return len(self.kernel)

    @property
    def pads(self) -> list[int]:
        """Conv/ConvTranspose pads: the non-negative parts of begin and end."""
        return [max(p, 0) for p in (*self.begin, *self.end)]

    def attrs(self) -> dict:
        return {"strides": list(self.strides), "dilations": list(self.dilations), "pads": self.pads}


def _spatial(ctx, name: str) -> tuple[int, ...]:
    """The spatial dims of ``name`` (all after N, C), which the rules need statically."""
    shape = ctx.shape(name)
    if shape is None or len(shape) < 3 or not all(isinstance(d, int) for d in shape[2:]):
        raise ctx.fail(f"the spatial dims of {name!r} must be static, got shape {shape}")
    return tuple(shape[2:])


def _channels(ctx, name: str) -> int:
    dim = (ctx.shape(name) or (None, None))[1]
    if not isinstance(dim, int):
        raise ctx.fail(f"the channel dim of {name!r} must be static, got shape {ctx.shape(name)}")
    return dim


def _forward_geometry(ctx, spatial: tuple[int, ...], kernel: tuple[int, ...]):
    """The forward kernels' geometry of a Conv or pool over an input of ``spatial`` size."""
    a = ctx.attrs
    try:
        return window_geometry(spatial, kernel, strides=a.get("strides"), dilations=a.get("dilations"), pads=a.get("pads"),
                         auto_pad=a.get("auto_pad", "NOTSET"), ceil_mode=a.get("ceil_mode", 0))
    except ValueError as exc:
        raise ctx.fail(str(exc)) from None


def _forward_window(geo, spatial: tuple[int, ...]) -> _Window:
    end = tuple(r - n - b for r, n, b in zip(geo.reach, spatial, geo.begin))
    return _Window(geo.kernel, geo.strides, geo.dilations, geo.begin, end)


def _spatial_axes(rank: int) -> list[int]:
    return list(range(2, rank + 2))


def _crop(ctx, x: str, window: _Window, spatial: tuple[int, ...]) -> str:
    """``x`` without the parts a negative pad says no window reads."""
    lo = [max(-b, 0) for b in window.begin]
    hi = [n - max(-e, 0) for n, e in zip(spatial, window.end)]
    if not any(lo) and hi == list(spatial):
        return x
    return ctx.b.Slice(x, ctx.ints(lo), ctx.ints(hi), ctx.ints(_spatial_axes(window.rank)))


def _input_grad(ctx, dY: str, W: str, window: _Window, group: int) -> str:
    """The adjoint of Conv(X, W) with respect to X: ConvTranspose of dY by W, padded back to X's
    size. At stride 1 (plain or depthwise, kernel larger than 1x1) it is a Conv of dY by the
    flipped kernel, which the engine runs faster than a ConvTranspose."""
    assert min(window.begin, default=0) >= 0, "a Conv window never starts before its input"
    mirrored = _mirrored_pads(window)
    shape = ctx.shape(W)
    depthwise = group > 1 and shape is not None and shape[:2] == (group, 1)
    plain = group == 1 and math.prod(window.kernel) > 1  # a 1x1 kernel's ConvTranspose is a bare GEMM already
    if mirrored is not None and (depthwise or plain):
        # stride 1: the adjoint as a forward Conv by the flipped kernel (channels swapped unless
        # depthwise), whose im2col + GEMM the engine runs 1.2-2.5x faster than ConvTranspose's col2im
        rank = window.rank
        flipped = ctx.b.Slice(W, ctx.ints([-1] * rank), ctx.ints([INT64_MIN] * rank), ctx.ints(_spatial_axes(rank)),
                              ctx.ints([-1] * rank))
        if plain:
            flipped = ctx.b.Transpose(flipped, perm=[1, 0, *_spatial_axes(rank)])
        return ctx.b.Conv(dY, flipped, group=group, pads=mirrored, dilations=list(window.dilations))
    adjust = [max(-e, 0) for e in window.end]
    return ctx.b.ConvTranspose(dY, W, group=group, output_padding=adjust if any(adjust) else None, **window.attrs())


def _mirrored_pads(window: _Window) -> list[int] | None:
    """With stride 1, sliding the flipped window over dY padded by these pads visits, for every
    input position, exactly the outputs whose windows read it: the adjoint as a forward window.
    None for strides > 1 (the adjoint then needs zeros between dY's elements) or when the
    forward pads exceed the window."""
    if any(s != 1 for s in window.strides):
        return None
    extents = [(k - 1) * d + 1 for k, d in zip(window.kernel, window.dilations)]
    pads = [x - 1 - p for x, p in zip(extents * 2, (*window.begin, *window.end))]
    return pads if min(pads, default=0) >= 0 else None


def _weight_grad(ctx, X: str, dY: str, window: _Window, group: int, spatial: tuple[int, ...]) -> str:
    """dW[m, c, k] = sum over n and output positions p of dY[n, m, p] * Xpad[n, c, p * s + k * d].

    The windows' columns are gathered once, one strided Slice of the padded X per kernel tap,
    with the batch moved next to the positions so that one MatMul per group contracts both:
    (C/group * taps, N * positions) @ (N * positions, M/group). (The classic Conv over the batch
    with dY as the kernel computes the same, but its im2col of an image-sized kernel runs an
    order of magnitude slower in the numpy engine; a per-sample MatMul would hold N copies of dW.)"""
    b, rank = ctx.b, window.rank
    out = _spatial(ctx, dY)
    spatial_axes = _spatial_axes(rank)
    x = b.Transpose(_crop(ctx, X, window, spatial), perm=[1, 0, *spatial_axes])  # (C, N, ...)
    if any(window.pads):
        pads = window.pads
        x = b.Pad(x, ctx.ints([0, 0, *pads[:rank], 0, 0, *pads[rank:]]))
    axes = ctx.ints(spatial_axes)
    steps = ctx.ints(list(window.strides)) if any(s > 1 for s in window.strides) else None
    taps = []
    for offset in np.ndindex(*window.kernel):
        starts = [k * d for k, d in zip(offset, window.dilations)]
        ends = [st + (o - 1) * s + 1 for st, o, s in zip(starts, out, window.strides)]
        taps.append(b.Unsqueeze(b.Slice(x, ctx.ints(starts), ctx.ints(ends), axes, steps), ctx.ints([1])))
    cols = b.Concat(*taps, axis=1) if len(taps) > 1 else taps[0]  # (C, taps, N, *out)
    per_group = _channels(ctx, X) // group
    cols = b.Reshape(cols, ctx.ints([group, per_group * len(taps), -1]))
    grads = b.Reshape(b.Transpose(dY, perm=[1, 0, *spatial_axes]), ctx.ints([group, _channels(ctx, dY) // group, -1]))
    # cols @ grads^T rather than grads @ cols^T: BLAS was measured 5-25x faster this way round
    dW = b.MatMul(cols, b.Transpose(grads, perm=[0, 2, 1]))  # (group, C/group * taps, M/group)
    return b.Reshape(b.Transpose(dW, perm=[0, 2, 1]), ctx.ints([-1, per_group, *window.kernel]))


def _bias_grad(ctx, dY: str) -> str:
    return ctx.b.ReduceSum(dY, ctx.ints([0, *_spatial_axes(ctx.rank(dY) - 2)]), keepdims=0)


@gradient("Conv")
def conv_grad(ctx, dY):
    """dX = ConvTranspose(dY, W) with the forward window, dW = sum over the batch and the output
    positions of dY times the window columns of X, dB = sum(dY) over all axes but the channels"""
    X, W, B = ctx.inputs[:3]
    spatial, kernel, group = _spatial(ctx, X), _spatial(ctx, W), ctx.attrs["group"]
    window = _forward_window(_forward_geometry(ctx, spatial, kernel), spatial)
    dX = _input_grad(ctx, dY, W, window, group) if ctx.needs(0) else None
    dW = _weight_grad(ctx, X, dY, window, group, spatial) if ctx.needs(1) else None
    dB = _bias_grad(ctx, dY) if B and ctx.needs(2) else None
    return dX, dW, dB


@gradient("ConvTranspose")
def conv_transpose_grad(ctx, dY):
    """ConvTranspose is the adjoint of the Conv that reads its output: dX = Conv(dY, W),
    dW = that Conv's weight gradient with dY as input and X as output gradient, dB = sum(dY)"""
    X, W, B = ctx.inputs[:3]
    a, spatial, kernel = ctx.attrs, _spatial(ctx, X), _spatial(ctx, W)
    rank, group = len(spatial), a["group"]
    try:
        strides = per_axis("strides", a.get("strides"), rank, 1, minimum=1)
        dilations = per_axis("dilations", a.get("dilations"), rank, 1, minimum=1)
        begin, out = transpose_pads(ShapeOnly((0, 0, *spatial)), kernel, strides=strides, dilations=dilations,
                                     pads=a.get("pads"), auto_pad=a.get("auto_pad", "NOTSET"),
                                     output_padding=a.get("output_padding"), output_shape=a.get("output_shape"))
    except ValueError as exc:
        raise ctx.fail(str(exc)) from None
    # the adjoint Conv reads dY (as its input, `out` long) with windows ending at `reach`
    reach = [(n - 1) * s + (k - 1) * d + 1 for n, s, k, d in zip(spatial, strides, kernel, dilations)]
    end = tuple(r - b - o for r, b, o in zip(reach, begin, out))
    window = _Window(tuple(kernel), strides, dilations, tuple(begin), end)
    out = tuple(out)
    dX = dW = dB = None
    if ctx.needs(0):
        dX = ctx.b.Conv(_crop(ctx, dY, window, out), W, group=group, **window.attrs())
    if ctx.needs(1):
        dW = _weight_grad(ctx, dY, X, window, group, out)
    if B and ctx.needs(2):
        dB = _bias_grad(ctx, dY)
    return dX, dW, dB


# ---------------------------------------------------------------- pools


def _pool_geometry(ctx, X: str):
    """(spatial dims of X, the pool's geometry)"""
    kernel = ctx.attrs.get("kernel_shape")
    if kernel is None:
        raise ctx.fail("the kernel_shape attribute is missing")
    spatial = _spatial(ctx, X)
    return spatial, _forward_geometry(ctx, spatial, tuple(kernel))


def _window_sum_adjoint(ctx, g: str, X: str, window: _Window) -> str:
    """The adjoint of summing every window of X: each input position gets the sum of g over the
    windows covering it. With stride 1 that is itself a window sum (an AveragePool over the
    mirrored padding, times the window size); otherwise one ConvTranspose by a ones kernel,
    channels folded into the batch."""
    b = ctx.b
    mirrored = _mirrored_pads(window)
    if mirrored is not None and all(p < k for p, k in zip(mirrored, window.kernel * 2)):  # pools need pads < kernel
        dilations = list(window.dilations) if any(d > 1 for d in window.dilations) else None
        total = b.AveragePool(g, kernel_shape=list(window.kernel), pads=mirrored, dilations=dilations,
                              count_include_pad=1)
        size = math.prod(window.kernel)
        return b.Mul(total, ctx.const(size, like=X)) if size > 1 else total
    planes = b.Reshape(g, ctx.ints([-1, 1, *_spatial(ctx, g)]))
    ones = ctx.const(np.ones((1, 1, *window.kernel)), like=X)
    return b.Reshape(_input_grad(ctx, planes, ones, window, 1), ctx.shape_of(X))


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
    return (_window_sum_adjoint(ctx, g, X, _forward_window(geo, spatial)),)


@gradient("LpPool")
def lp_pool_grad(ctx, dY):
    """Y = (sum |X|^p)^(1/p) per window: dX = sign(X) |X|^(p-1) * sum over covering windows of
    dY * Y^(1-p) (0 where Y = 0)"""
    b, X, (Y,) = ctx.b, ctx.inputs[0], ctx.outputs
    p = ctx.attrs["p"]
    spatial, geo = _pool_geometry(ctx, X)
    zero = ctx.const(0, like=X)
    g = dY if p == 1 else b.Where(b.Greater(Y, zero), b.Mul(dY, b.Pow(Y, ctx.const(1 - p, like=X))), zero)
    spread = _window_sum_adjoint(ctx, g, X, _forward_window(geo, spatial))
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
    mod = lambda a, m: b.Sub(a, b.Mul(b.Div(a, ctx.ints(m)), ctx.ints(m)))  # noqa: E731
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
