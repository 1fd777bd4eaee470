"""Gradient rules of the ops in odt_ops/kernels/nn.py: the normalizations, LRN, Resize,
DepthToSpace, SpaceToDepth, Dropout and Pad.

Every normalization standardizes X over some axes, xhat = (X - mean) * inv_std, then
applies a scale g = dY * scale. Its input gradient is the one formula

    dX = inv_std * (g - mean(g) - xhat * mean(g * xhat))      (means over the same axes)

and the scale and bias gradients are sums of dY * xhat and dY over the axes the
scale is shared across. LayerNormalization reuses the Mean and InvStdDev the forward
node can output; the others recompute the statistics (their forward has no such
outputs in opset >= 15).
"""
from __future__ import annotations

import math

import numpy as np
import onnx

from odt_ops.grad.registry import gradient
from odt_ops.grad.rules.shape import INT64_MAX, through_positions
from odt_ops.kernels.geometry import ShapeOnly, resize_axis, resize_output_plan

_STATISTIC_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.BFLOAT16)  # LayerNormalization's Mean/InvStdDev


def _like(ctx, value: str, X: str) -> str:
    """``value`` in the dtype of ``X`` (parameters and statistics may be stored wider or narrower)."""
    return value if ctx.dtype(value) == ctx.dtype(X) else ctx.b.CastLike(value, X)


def _per_channel(ctx, v: str, X: str) -> str:
    """A (C,) vector shaped to broadcast along axis 1 of X, in X's dtype."""
    rank = ctx.rank(X)
    return ctx.b.Unsqueeze(_like(ctx, v, X), ctx.ints([0, *range(2, rank)]))


def _inverse_count(ctx, X: str, reduced: str) -> str:
    """1 / (how many elements of X each element of ``reduced`` summarizes)."""
    xs, rs = ctx.static_shape(X), ctx.static_shape(reduced)
    if xs is not None and rs is not None:
        return ctx.const(math.prod(rs) / max(math.prod(xs), 1), like=X)
    b = ctx.b
    return b.Div(b.CastLike(b.Size(reduced), X), b.CastLike(b.Size(X), X))


def _standardize(ctx, X: str, axes: str, epsilon: float) -> tuple[str, str]:
    """(xhat, inv_std) with the population variance over ``axes`` (kept as size-1 dims)."""
    b = ctx.b
    centered = b.Sub(X, b.ReduceMean(X, axes, keepdims=1))
    var = b.ReduceMean(b.Mul(centered, centered), axes, keepdims=1)
    inv_std = b.Reciprocal(b.Sqrt(b.Add(var, ctx.const(epsilon, like=X))))
    return b.Mul(centered, inv_std), inv_std


def _standardized_grad(ctx, g: str, xhat: str, inv_std: str, axes: str) -> str:
    """dX = inv_std * (g - mean(g) - xhat * mean(g * xhat)), means over ``axes``"""
    b = ctx.b
    mean_g = b.ReduceMean(g, axes, keepdims=1)
    mean_gx = b.ReduceMean(b.Mul(g, xhat), axes, keepdims=1)
    return b.Mul(inv_std, b.Sub(b.Sub(g, mean_g), b.Mul(xhat, mean_gx)))


def _channel_sums(ctx, dY: str, xhat: str, axes: str, like: tuple[str, str]) -> tuple[str | None, str | None]:
    """(d scale, d bias) = (sum(dY * xhat), sum(dY)) over ``axes``, when wanted, typed like ``like``."""
    b = ctx.b
    dscale = b.ReduceSum(b.Mul(dY, xhat), axes, keepdims=0) if ctx.needs(1) else None
    dbias = b.ReduceSum(dY, axes, keepdims=0) if ctx.needs(2) else None
    return (None if dscale is None else _like(ctx, dscale, like[0]),
            None if dbias is None else _like(ctx, dbias, like[1]))


def _statistics_grad(ctx, dY: str, X: str, scale: str, axes: str, count: str, epsilon: float,
                     *, per_instance: bool = False) -> tuple[str | None, str, str]:
    """(dX, sum(dY * xhat), sum(dY)) with the statistics X itself has over ``axes`` (one per channel
    for BatchNormalization, per (n, c) instance for InstanceNormalization; ``count`` is 1/M, M
    elements each; a statistic is unsqueezed back to X's rank along ``axes``) in nine passes over X-sized
    data (the straightforward form takes thirteen to sixteen): c = X - mean(X); by Einsum sums of
    products, which read two tensors in one pass without a product tensor, var = sum(c * c) / M and
    sum(dY * c); then with a = scale * inv_std (scale per channel, unsqueezed to (1, C) ``per_instance``),
    dX = dY * a - (c * (a * inv_std * sum(dY * xhat) / M) + a * sum(dY) / M).
    The runtime runs this graph as one fused node (runtime/fusion/normalization.py)."""
    b = ctx.b
    letters = "nc" + "hwdefgijklm"[: ctx.rank(X) - 2]
    equation = f"{letters},{letters}->{'nc' if per_instance else 'c'}"
    centered = b.Sub(X, b.ReduceMean(X, axes, keepdims=1))
    var = b.Mul(b.Einsum(centered, centered, equation=equation), count)
    inv_std = b.Reciprocal(b.Sqrt(b.Add(var, ctx.const(epsilon, like=X))))
    sum_dy = b.ReduceSum(dY, axes, keepdims=0)
    dscale = b.Mul(b.Einsum(dY, centered, equation=equation), inv_std)
    dX = None
    if ctx.needs(0):
        s = _like(ctx, scale, X)
        a = b.Mul(b.Unsqueeze(s, ctx.ints([0])) if per_instance else s, inv_std)
        tilt = b.Mul(b.Mul(a, b.Mul(inv_std, dscale)), count)
        shift = b.Mul(b.Mul(a, sum_dy), count)
        correction = b.Add(b.Mul(centered, b.Unsqueeze(tilt, axes)), b.Unsqueeze(shift, axes))
        dX = b.Sub(b.Mul(dY, b.Unsqueeze(a, axes)), correction)
    return dX, dscale, sum_dy


def _batch_norm_training_grad(ctx, dY: str, X: str, scale: str, B: str, axes: str, epsilon: float):
    """With the batch statistics, one per channel (see _statistics_grad)."""
    dX, dscale, sum_dy = _statistics_grad(ctx, dY, X, scale, axes, _inverse_count(ctx, X, scale), epsilon)
    return (dX, _like(ctx, dscale, scale) if ctx.needs(1) else None, _like(ctx, sum_dy, B) if ctx.needs(2) else None)


@gradient("BatchNormalization")
def batch_normalization_grad(ctx, dY, d_running_mean=None, d_running_var=None):
    """training: dX = scale * inv_std * (dY - (sum(dY) + xhat * sum(dY * xhat)) / M) with the batch
    statistics (M elements per channel; see _batch_norm_training_grad); inference: dX = dY * scale * inv_std, and the running
    statistics get d mean = -sum(dY) * scale * inv_std, d var = -sum(dY * xhat) * scale * inv_std^2 / 2.
    d scale = sum(dY * xhat), d B = sum(dY), over every axis but the channels."""
    if d_running_mean is not None or d_running_var is not None:
        raise ctx.fail("gradients through the running mean/variance outputs are not supported")
    if dY is None:
        return ()
    b, (X, scale, B, mean, var) = ctx.b, ctx.inputs[:5]
    rank = ctx.rank(X)
    if rank < 2:
        raise ctx.fail(f"an input of rank {rank} has no channel axis")
    axes = ctx.ints([0, *range(2, rank)])
    epsilon = ctx.attrs["epsilon"]
    if ctx.attrs.get("training_mode", 0):
        return _batch_norm_training_grad(ctx, dY, X, scale, B, axes, epsilon)
    s = _per_channel(ctx, scale, X)
    inv_std = b.Reciprocal(b.Sqrt(b.Add(_per_channel(ctx, var, X), ctx.const(epsilon, like=X))))
    xhat = b.Mul(b.Sub(X, _per_channel(ctx, mean, X)), inv_std)
    a = b.Mul(s, inv_std)
    dX = b.Mul(dY, a) if ctx.needs(0) else None
    dscale, dbias = _channel_sums(ctx, dY, xhat, axes, (scale, B))
    dmean = dvar = None
    if ctx.needs(3):
        dmean = _like(ctx, b.Neg(b.ReduceSum(b.Mul(dY, a), axes, keepdims=0)), mean)
    if ctx.needs(4):
        factor = b.Mul(b.Mul(a, inv_std), ctx.const(-0.5, like=X))
        dvar = _like(ctx, b.ReduceSum(b.Mul(b.Mul(dY, xhat), factor), axes, keepdims=0), var)
    return dX, dscale, dbias, dmean, dvar


@gradient("LayerNormalization", broadcasting=True)
def layer_normalization_grad(ctx, dY, dMean=None, dInvStdDev=None):
    """dX by the standardization formula over axes [axis, rank) with g = dY * Scale, reusing the
    forward's Mean and InvStdDev; d Scale = dY * xhat, d B = dY (the walker sums them down to
    the parameters' shapes)"""
    if dMean is not None or dInvStdDev is not None:
        raise ctx.fail("gradients through the Mean/InvStdDev outputs are not supported")
    b, (X, scale, B) = ctx.b, ctx.inputs[:3]
    rank = ctx.rank(X)
    axis = ctx.attrs["axis"] % rank
    axes = ctx.ints(list(range(axis, rank)))
    if ctx.attrs["stash_type"] in _STATISTIC_TYPES:
        inv_std = _like(ctx, ctx.output(2), X)
        xhat = b.Mul(b.Sub(X, _like(ctx, ctx.output(1), X)), inv_std)
    else:  # the spec allows no Mean/InvStdDev outputs of this type: recompute them
        xhat, inv_std = _standardize(ctx, X, axes, ctx.attrs["epsilon"])
    dX = _standardized_grad(ctx, b.Mul(dY, _like(ctx, scale, X)), xhat, inv_std, axes) if ctx.needs(0) else None
    dscale = _like(ctx, b.Mul(dY, xhat), scale) if ctx.needs(1) else None
    dbias = _like(ctx, dY, B) if B and ctx.needs(2) else None
    return dX, dscale, dbias


@gradient("InstanceNormalization")
def instance_normalization_grad(ctx, dY):
    """Per (n, c) instance over the spatial axes, in nine passes (see _statistics_grad; the
    standardization formula took sixteen); d scale = sum over n of the instances' sum(dY * xhat),
    d B = sum(dY) over n and the spatial axes"""
    b, (X, scale, B) = ctx.b, ctx.inputs[:3]
    rank = ctx.rank(X)
    if rank < 3:
        raise ctx.fail(f"an input of rank {rank} has no spatial axis")
    spatial = ctx.ints(list(range(2, rank)))
    dims = (b.shape(X) or (None,) * rank)[2:]
    if all(isinstance(d, int) for d in dims):  # 1/S, a constant even with a symbolic batch
        count = ctx.const(1 / max(math.prod(dims), 1), like=X)
    else:  # from X's shape, never from a value inside the gradient (the fusion needs it outside)
        count = b.Reciprocal(b.CastLike(b.ReduceProd(b.Slice(b.Shape(X), ctx.ints([2]), ctx.ints([rank])), keepdims=0), X))
    dX, dscale, sum_dy = _statistics_grad(ctx, dY, X, scale, spatial, count, ctx.attrs["epsilon"], per_instance=True)
    batch = ctx.ints([0])
    return (dX, _like(ctx, b.ReduceSum(dscale, batch, keepdims=0), scale) if ctx.needs(1) else None,
            _like(ctx, b.ReduceSum(sum_dy, batch, keepdims=0), B) if ctx.needs(2) else None)


@gradient("GroupNormalization")
def group_normalization_grad(ctx, dY):
    """X viewed as (N, groups, rest): dX by the standardization formula over `rest` with
    g = dY * scale; d scale = sum(dY * xhat), d bias = sum(dY) per channel (per group before
    opset 21)"""
    b, (X, scale, bias) = ctx.b, ctx.inputs[:3]
    groups = ctx.attrs.get("num_groups")
    if groups is None:
        raise ctx.fail("the num_groups attribute is missing")
    per_group = ctx.opset < 21  # opset 18-20: one scale and bias per group
    rank = ctx.rank(X)
    grouped = lambda v: b.Reshape(v, ctx.ints([0, groups, -1]))
    last = ctx.ints([2])
    xhat, inv_std = _standardize(ctx, grouped(X), last, ctx.attrs["epsilon"])
    if per_group:
        dYg = grouped(dY)
        g = b.Mul(dYg, b.Unsqueeze(_like(ctx, scale, X), ctx.ints([0, 2])))
        xhat_like_dy, sum_axes = xhat, ctx.ints([0, 2])
    else:
        dYg = dY
        g = grouped(b.Mul(dY, _per_channel(ctx, scale, X)))
        xhat_like_dy, sum_axes = b.Reshape(xhat, ctx.shape_of(X)), ctx.ints([0, *range(2, rank)])
    dX = b.Reshape(_standardized_grad(ctx, g, xhat, inv_std, last), ctx.shape_of(X)) if ctx.needs(0) else None
    return (dX, *_channel_sums(ctx, dYg, xhat_like_dy, sum_axes, (scale, bias)))


@gradient("LRN")
def lrn_grad(ctx, dY):
    """Y = X * S^-beta, S = bias + alpha/size * (sum of X^2 over the channel window):
    dX = dY * S^-beta - 2 alpha beta / size * X * (sum over the mirrored window of dY * Y / S)"""
    b, X, (Y,) = ctx.b, ctx.inputs[0], ctx.outputs
    size, alpha, beta = ctx.attrs["size"], ctx.attrs["alpha"], ctx.attrs["beta"]
    before = (size - 1) // 2  # channels before c in its window; the rest come after
    square_sum = _channel_window_sum(ctx, b.Mul(X, X), before, size - 1 - before)
    S = b.Add(b.Mul(square_sum, ctx.const(alpha / size, like=X)), ctx.const(ctx.attrs["bias"], like=X))
    direct = b.Mul(dY, b.Pow(S, ctx.const(-beta, like=X)))
    # channel c' feeds the windows of c in [c' - after, c' + before]: the mirrored window
    through_s = _channel_window_sum(ctx, b.Div(b.Mul(dY, Y), S), size - 1 - before, before)
    return (b.Sub(direct, b.Mul(b.Mul(X, through_s), ctx.const(2 * alpha * beta / size, like=X))),)


def _channel_window_sum(ctx, x: str, before: int, after: int) -> str:
    """out[:, c] = sum of x[:, c - before .. c + after] (zeros past the ends), as a Conv of x with
    the channels moved to a spatial axis by a ones kernel."""
    b = ctx.b
    rank = ctx.rank(x)
    spread = [1] * (rank - 2)
    ones = ctx.const(np.ones((1, 1, before + after + 1, *spread)), like=x)
    summed = b.Conv(b.Unsqueeze(x, ctx.ints([1])), ones, pads=[before, *[0] * (rank - 2), after, *[0] * (rank - 2)])
    return b.Squeeze(summed, ctx.ints([1]))


# ---------------------------------------------------------------- Resize


@gradient("Resize")
def resize_grad(ctx, dY):
    """Resize is linear and separable: Y = X x_1 A_1 x_2 A_2 ... with one (out, in) interpolation
    matrix per resized axis, so dX = dY x_1 A_1^T x_2 A_2^T ... Spatial axes that upsample by
    repetition (nearest, integer factor f) are one sum pool over f x f blocks; every other axis is
    a MatMul by A, or, when A is long and sparse, a few Gathers of dY weighted and summed."""
    X = ctx.inputs[0]
    rank = ctx.rank(X)
    matrices = _interpolation_matrices(ctx)
    blocks = {axis: f for axis, f in ((axis, _repeat_factor(A)) for axis, A in matrices) if f and axis >= 2}
    g = dY
    for axis, A in matrices:
        if axis not in blocks:
            g = _resample_adjoint(ctx, g, A, axis, rank)
    if blocks:
        factors = [blocks.get(axis, 1) for axis in range(2, rank)]
        block_sums = ctx.b.AveragePool(g, kernel_shape=factors, strides=factors)
        g = ctx.b.Mul(block_sums, ctx.const(math.prod(factors), like=X))
    return (g,)


def _interpolation_matrices(ctx) -> list[tuple[int, np.ndarray]]:
    """(axis, A) per axis the Resize changes, computed by the forward kernel's own 1-D resampler
    applied to an identity matrix."""
    X, roi, scales, sizes = ctx.inputs[:4]
    a = ctx.attrs
    shape = ctx.shape(X)
    if shape is None:
        raise ctx.fail(f"the rank of {X!r} is unknown")
    rank = len(shape)
    mode = a["coordinate_transformation_mode"]
    given = {"scales": scales, "sizes": sizes, **({"roi": roi} if mode == "tf_crop_and_resize" else {})}
    values = {name: ctx.value(v) if v else None for name, v in given.items()}
    same_symbolic = set()  # axes whose computed size is the input's own symbolic dim (the batch)
    if sizes and values["sizes"] is None and not (scales and values["scales"] is None):
        values["sizes"], same_symbolic = _sizes_from_output(ctx, shape)
    if any(v and values[name] is None for name, v in given.items()):
        raise ctx.fail(f"{' and '.join(given)} must be constants to differentiate Resize")
    by_sizes = values["sizes"] is not None and values["sizes"].size > 0
    axes = [int(x) % rank for x in a.get("axes") or range(rank)]
    static = {ax: d for ax, d in enumerate(shape) if isinstance(d, int)}
    plan_shape = [static.get(ax, 1) for ax in range(rank)]
    try:
        plan = resize_output_plan(ShapeOnly(tuple(plan_shape)), values["scales"], values["sizes"], axes,
                            a.get("keep_aspect_ratio_policy", "stretch"))
    except ValueError as exc:
        raise ctx.fail(str(exc)) from None
    rois = [None] * len(axes)
    if mode == "tf_crop_and_resize":
        flat = np.asarray(values["roi"], dtype=np.float64).ravel()
        rois = list(zip(flat[:len(axes)], flat[len(axes):]))
    attrs = dict(mode=a["mode"], coordinate_transformation_mode=mode, nearest_mode=a["nearest_mode"],
                 cubic_coeff_a=a["cubic_coeff_a"], exclude_outside=a["exclude_outside"],
                 extrapolation_value=0.0, antialias=a.get("antialias", 0))  # extrapolated values are constants
    matrices = []
    for (axis, out_len, scale), roi_ in zip(plan, rois):
        if axis not in static:
            if scale != 1.0 or (roi_ is not None and tuple(roi_) != (0.0, 1.0)) or (by_sizes and axis not in same_symbolic):
                raise ctx.fail(f"Resize along the symbolic axis {axis} is not differentiated")
            continue  # an unscaled axis is sampled exactly
        n = static[axis]
        A = resize_axis(np.eye(n), 0, out_len, scale, roi_, attrs)
        if not (A.shape == (n, n) and np.array_equal(A, np.eye(n))):
            matrices.append((axis, A))
    return matrices


def _sizes_from_output(ctx, shape: tuple) -> tuple[np.ndarray | None, set[int]]:
    """Sizes computed at run time (``Concat(Shape(x)[:2], H, W)``, as the TorchScript exporter writes
    ``interpolate(x, size=...)``) read from the inferred output shape: every output dim a number,
    or the same symbol as the input's (the batch, which Resize then leaves alone); else (None, {})."""
    out = ctx.shape(ctx.outputs[0])
    if out is None or len(out) != len(shape):
        return None, set()
    same = {ax for ax, (o, i) in enumerate(zip(out, shape)) if not isinstance(o, int) and o is not None and o == i}
    if any(not isinstance(o, int) and ax not in same for ax, o in enumerate(out)):
        return None, set()
    return np.array([o if isinstance(o, int) else 1 for o in out], np.int64), same


def _repeat_factor(A: np.ndarray) -> int | None:
    """f if A repeats each input f times in a row (nearest upsampling by an integer factor)."""
    out_len, n = A.shape
    if out_len % n:
        return None
    f = out_len // n
    return f if np.array_equal(A, np.repeat(np.eye(n), f, axis=0)) else None


def _resample_adjoint(ctx, g: str, A: np.ndarray, axis: int, rank: int) -> str:
    """g with its ``axis`` (length out) contracted against A (out, in)."""
    b = ctx.b
    out_len, in_len = A.shape
    nonzero = A.T != 0
    taps = int(nonzero.sum(axis=1).max())
    if taps and in_len > 16 * taps:  # (no taps: an empty output, and MatMul gives the zeros)
        # sparse: input j collects A[i, j] * g[i] over the few outputs i it feeds, gathered
        # tap by tap (unused tap slots read output 0 with weight 0)
        index, weight = np.zeros((taps, in_len), np.int64), np.zeros((taps, in_len))
        cols, rows = np.nonzero(nonzero)
        slot = np.arange(cols.size) - np.searchsorted(cols, cols)  # rank of each entry in its column
        index[slot, cols], weight[slot, cols] = rows, A[rows, cols]
        along = (in_len,) + (1,) * (rank - 1 - axis)
        terms = [b.Mul(b.Gather(g, ctx.ints(index[t]), axis=axis), ctx.const(weight[t].reshape(along), like=g))
                 for t in range(taps)]
        return b.Sum(*terms) if taps > 1 else terms[0]
    M = ctx.const(A, like=g)
    if axis == rank - 1:
        return b.MatMul(g, M)
    if axis == rank - 2:
        return b.MatMul(b.Transpose(M, perm=[1, 0]), g)
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    return b.Transpose(b.MatMul(b.Transpose(g, perm=perm), M), perm=perm)


# ---------------------------------------------------------------- DepthToSpace / SpaceToDepth


@gradient("DepthToSpace")
def depth_to_space_grad(ctx, dY):
    """DCR: dX = SpaceToDepth(dY); CRD: the inverse reshape-transpose-reshape"""
    b, X = ctx.b, ctx.inputs[0]
    bs = ctx.attrs["blocksize"]
    if ctx.attrs.get("mode", "DCR") == "DCR":
        return (b.SpaceToDepth(dY, blocksize=bs),)
    shape = ctx.shape(X)
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape[1:]):
        raise ctx.fail(f"CRD mode needs static C, H, W, got shape {shape}")
    _, c, h, w = shape
    split = b.Reshape(dY, ctx.ints([0, c // (bs * bs), h, bs, w, bs]))
    return (b.Reshape(b.Transpose(split, perm=[0, 1, 3, 5, 2, 4]), ctx.ints([0, c, h, w])),)


@gradient("SpaceToDepth")
def space_to_depth_grad(ctx, dY):
    """dX = DepthToSpace(dY) in the same mode (DCR before opset 28)"""
    mode = ctx.attrs.get("mode")
    return (ctx.b.DepthToSpace(dY, blocksize=ctx.attrs["blocksize"], mode=mode or "DCR"),)


@gradient("Dropout")
def dropout_grad(ctx, dY, dMask=None):
    """dX = dY * mask / (1 - ratio) in training mode, dY in inference mode"""
    b, (X, ratio, training) = ctx.b, ctx.inputs[:3]
    mode = ctx.value(training) if training else np.array(False)
    if mode is not None and not bool(mode):
        return (dY,)
    mask = ctx.output(1)
    r = ctx.value(ratio) if ratio else np.array(0.5)
    if r is not None:
        if not 0 <= float(r) < 1:
            raise ctx.fail(f"the dropout ratio is {float(r)}; training needs 0 <= ratio < 1")
        scale = ctx.const(1.0 / (1.0 - float(r)), like=X)
    else:
        one = ctx.const(1, like=X)
        scale = b.Div(one, b.Sub(one, b.CastLike(ratio, X)))
    if mode is None:  # decided at run time; the mask is all true in inference mode
        scale = b.Where(training, scale, ctx.const(1, like=X))
    return (b.Where(mask, b.Mul(dY, scale), ctx.const(0, like=X)),)


@gradient("Pad")
def pad_grad(ctx, dY):
    """constant mode: dX = dY with the padding cut off (Pad by -pads); other modes: the
    padded copies scattered back to their sources"""
    b, (X, pads, _value, axes) = ctx.b, ctx.inputs[:4]
    if ctx.attrs["mode"] != "constant":
        move = lambda positions: b.Pad(positions, pads, "", axes, mode=ctx.attrs["mode"])
        return (through_positions(ctx, dY, move, duplicates=True),)
    static = ctx.value(pads)
    if static is not None and (static >= 0).all():
        half = static.size // 2
        begin, end = static[:half].tolist(), static[half:].tolist()
        rank = ctx.rank(X)
        axes_ = ctx.value(axes).tolist() if axes else list(range(rank))
        ends = [-e if e else INT64_MAX for e in end]
        return (b.Slice(dY, ctx.ints(begin), ctx.ints(ends), ctx.ints(axes_)),)
    return (b.Pad(dY, b.Neg(pads), "", axes),)
