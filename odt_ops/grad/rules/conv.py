"""Gradient rules: Conv and ConvTranspose (the pools are rules/pool.py, the window both use rules/windows.py).

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
  and contracts them with dY in one MatMul per group, batch and positions together.
"""
from __future__ import annotations

import numpy as np

from odt_ops.grad.registry import gradient
from odt_ops.grad.rules.windows import Window, axes_after_channels, channels, crop, forward_geometry, forward_window, input_grad, spatial_sizes
from odt_ops.kernels.geometry import ShapeOnly, per_axis, transpose_pads


def _weight_grad(ctx, X: str, dY: str, window: Window, group: int, spatial: tuple[int, ...]) -> str:
    """dW[m, c, k] = sum over n and output positions p of dY[n, m, p] * Xpad[n, c, p * s + k * d].

    The windows' columns are gathered once, one strided Slice of the padded X per kernel tap,
    with the batch moved next to the positions so that one MatMul per group contracts both:
    (C/group * taps, N * positions) @ (N * positions, M/group). (The classic Conv over the batch
    with dY as the kernel computes the same, but its im2col of an image-sized kernel runs an
    order of magnitude slower in the numpy engine; a per-sample MatMul would hold N copies of dW.)"""
    b, rank = ctx.b, window.rank
    out = spatial_sizes(ctx, dY)
    spatial_axes = axes_after_channels(rank)
    x = b.Transpose(crop(ctx, X, window, spatial), perm=[1, 0, *spatial_axes])  # (C, N, ...)
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
    per_group = channels(ctx, X) // group
    cols = b.Reshape(cols, ctx.ints([group, per_group * len(taps), -1]))
    grads = b.Reshape(b.Transpose(dY, perm=[1, 0, *spatial_axes]), ctx.ints([group, channels(ctx, dY) // group, -1]))
    # cols @ grads^T rather than grads @ cols^T: BLAS was measured 5-25x faster this way round
    dW = b.MatMul(cols, b.Transpose(grads, perm=[0, 2, 1]))  # (group, C/group * taps, M/group)
    return b.Reshape(b.Transpose(dW, perm=[0, 2, 1]), ctx.ints([-1, per_group, *window.kernel]))


def _bias_grad(ctx, dY: str) -> str:
    return ctx.b.ReduceSum(dY, ctx.ints([0, *axes_after_channels(ctx.rank(dY) - 2)]), keepdims=0)


@gradient("Conv")
def conv_grad(ctx, dY):
    """dX = ConvTranspose(dY, W) with the forward window, dW = sum over the batch and the output
    positions of dY times the window columns of X, dB = sum(dY) over all axes but the channels"""
    X, W, B = ctx.inputs[:3]
    spatial, kernel, group = spatial_sizes(ctx, X), spatial_sizes(ctx, W), ctx.attrs["group"]
    window = forward_window(forward_geometry(ctx, spatial, kernel), spatial)
    dX = input_grad(ctx, dY, W, window, group) if ctx.needs(0) else None
    dW = _weight_grad(ctx, X, dY, window, group, spatial) if ctx.needs(1) else None
    dB = _bias_grad(ctx, dY) if B and ctx.needs(2) else None
    return dX, dW, dB


@gradient("ConvTranspose")
def conv_transpose_grad(ctx, dY):
    """ConvTranspose is the adjoint of the Conv that reads its output: dX = Conv(dY, W),
    dW = that Conv's weight gradient with dY as input and X as output gradient, dB = sum(dY)"""
    X, W, B = ctx.inputs[:3]
    a, spatial, kernel = ctx.attrs, spatial_sizes(ctx, X), spatial_sizes(ctx, W)
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
    window = Window(tuple(kernel), strides, dilations, tuple(begin), end)
    out = tuple(out)
    dX = dW = dB = None
    if ctx.needs(0):
        dX = ctx.b.Conv(crop(ctx, dY, window, out), W, group=group, **window.attrs())
    if ctx.needs(1):
        dW = _weight_grad(ctx, dY, X, window, group, out)
    if B and ctx.needs(2):
        dB = _bias_grad(ctx, dY)
    return dX, dW, dB
