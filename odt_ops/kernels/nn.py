"""Kernels: nn (normalizations, LRN, Dropout, Resize, DepthToSpace/SpaceToDepth, Pad)."""
from __future__ import annotations

import math

import numpy as np
import onnx

from odt_ops.kernels.channels import per_channel
from odt_ops.kernels.geometry import NEAREST_ROUNDING, resize_axis, resize_output_plan
from odt_ops.kernels.reduce import ROW_DOT_MIN, row_dots, sum_along
from odt_ops.kernels.registry import kernel

# ---------------------------------------------------------------------------- shared helpers


def _axis(axis: int, ndim: int, what: str = "axis") -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what} {axis} is out of range for a tensor of rank {ndim}")
    return axis % ndim


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype arithmetic runs in: half precisions (and integers) go through float32."""
    if dtype.kind == "f" and dtype.itemsize >= 4:
        return dtype
    return np.dtype(np.float32)


def _channel_shape(ndim: int) -> tuple[int, ...]:
    """Broadcast shape of a per-channel (axis 1) parameter against an N x C x ... tensor."""
    return (1, -1) + (1,) * (ndim - 2)


def _standardize(x3: np.ndarray, epsilon: float, scale: np.ndarray | None = None, *, by_rows: bool = False):
    """Normalize an (a, b, c) array over axes 0 and 2, times an optional per-b ``scale``.

    Every normalization here is one such layout (BatchNorm: N x C x spatial; the others:
    1 x groups x elements). Returns (a new normalized array, mean, population variance,
    1/std), the statistics of shape (b,). ``by_rows`` (a == 1 only) sums the squares row by
    row through BLAS, see _square_sums.
    """
    count = x3.dtype.type(max(x3.shape[0] * x3.shape[2], 1))
    # gemv sums: numpy's mean over axes 0 and 2 ran 2-8x slower (many channels, small maps)
    mean = sum_along(x3, (0, 2), False) / count
    d = per_channel(np.subtract, x3, mean)
    var = _square_sums(d, by_rows) / count
    inv_std = np.reciprocal(np.sqrt(var + x3.dtype.type(epsilon)))
    per_channel(np.multiply, d, inv_std if scale is None else inv_std * scale, out=d)
    return d, mean, var, inv_std


def _square_sums(d: np.ndarray, by_rows: bool) -> np.ndarray:
    """The per-b sums of d's squares over axes 0 and 2, without materializing the squares."""
    if by_rows and d.shape[0] == 1 and d.shape[2] >= ROW_DOT_MIN:
        return row_dots(d[0], d[0])
    # einsum: about 3x faster than mean(square(d))
    return np.einsum("abc,abc->b", d, d)


def _stash_dtype(stash_type: int) -> np.dtype:
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(stash_type))
    except (KeyError, ValueError, TypeError):
        dtype = None
    if dtype is None or dtype.kind not in "fV":
        raise ValueError(f"stash_type {stash_type} is not a floating-point TensorProto type")
    return dtype


# ---------------------------------------------------------------------------- BatchNormalization


def _bn_layout(x: np.ndarray, spatial: int) -> np.ndarray:
    """``x`` as (N, channels, rest): one statistic per channel, over axes 0 and 2."""
    if x.ndim < 2:  # an (N,) input has one channel
        return x.reshape(-1, 1, 1)
    if spatial:
        return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))
    return x.reshape(x.shape[0], math.prod(x.shape[1:]), 1)  # deprecated non-spatial: per element


def _batch_norm(X, scale, B, mean, var, *, epsilon, momentum, training, spatial=1):
    """(Y, running_mean, running_var, batch_mean, batch_var); the stats are None in inference."""
    ct = _compute_dtype(X.dtype)
    x3 = _bn_layout(X.astype(ct, copy=False), spatial)
    s, b = (p.astype(ct, copy=False).ravel() for p in (scale, B))
    if not training:
        # fold the per-channel affine so the big tensor is touched twice only
        a = s / np.sqrt(var.astype(ct, copy=False).ravel() + ct.type(epsilon))
        y = per_channel(np.multiply, x3, a)
        per_channel(np.add, y, b - mean.astype(ct, copy=False).ravel() * a, out=y)
        return y.reshape(X.shape).astype(X.dtype, copy=False), None, None, None, None
    y, bmean, bvar, _ = _standardize(x3, epsilon, s)
    per_channel(np.add, y, b, out=y)
    stat = mean.dtype
    bmean = bmean.reshape(mean.shape).astype(stat, copy=False)
    bvar = bvar.reshape(var.shape).astype(stat, copy=False)
    m, one_minus = stat.type(momentum), stat.type(1.0 - momentum)
    running_mean, running_var = mean * m + bmean * one_minus, var * m + bvar * one_minus
    return y.reshape(X.shape).astype(X.dtype, copy=False), running_mean, running_var, bmean, bvar


@kernel("BatchNormalization", since=7)
def batch_normalization_7(X, scale, B, mean, var, *, epsilon=1e-5, momentum=0.9, spatial=1, _num_outputs=1):
    # before opset 14, asking for the optional outputs is what selects training mode
    return _batch_norm(X, scale, B, mean, var, epsilon=epsilon, momentum=momentum,
                       training=_num_outputs > 1, spatial=spatial)


@kernel("BatchNormalization", since=9)
def batch_normalization_9(X, scale, B, mean, var, *, epsilon=1e-5, momentum=0.9, _num_outputs=1):
    # outputs: Y, running mean, running var, batch mean, batch (population) variance
    return _batch_norm(X, scale, B, mean, var, epsilon=epsilon, momentum=momentum, training=_num_outputs > 1)


@kernel("BatchNormalization", since=14)
def batch_normalization(X, scale, B, input_mean, input_var, *, epsilon=1e-5, momentum=0.9, training_mode=0,
                        _num_outputs=1):
    if not training_mode and _num_outputs > 1:
        raise ValueError("running_mean/running_var outputs are only defined with training_mode=1")
    out = _batch_norm(X, scale, B, input_mean, input_var, epsilon=epsilon, momentum=momentum,
                      training=bool(training_mode))
    return out[:3] if training_mode else out[:1]


# ---------------------------------------------------------------------------- Layer/Instance/Group norm


@kernel("LayerNormalization", since=17)
def layer_normalization(X, Scale, B=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    axis = _axis(axis, X.ndim)
    stash = _stash_dtype(stash_type)
    outer = X.shape[:axis]
    x3 = X.astype(_compute_dtype(stash), copy=False).reshape(1, math.prod(outer), math.prod(X.shape[axis:]))
    normalized, mean, _, inv_std = _standardize(x3, epsilon)
    y = normalized.reshape(X.shape).astype(X.dtype, copy=False)  # stage two runs in X's type
    y *= Scale
    if B is not None:
        y += B
    stat_shape = outer + (1,) * (X.ndim - axis)
    return y, mean.reshape(stat_shape).astype(stash, copy=False), inv_std.reshape(stat_shape).astype(stash, copy=False)


@kernel("InstanceNormalization", since=6)
def instance_normalization(input, scale, B, *, epsilon=1e-5):
    n, c = input.shape[:2]
    ct = _compute_dtype(input.dtype)
    x3 = input.astype(ct, copy=False).reshape(1, n * c, math.prod(input.shape[2:]))
    scale, B = scale.astype(ct, copy=False), B.astype(ct, copy=False)
    # GroupNorm's export (Reshape -> InstanceNormalization -> Reshape -> Mul -> Add) passes a scale
    # of ones and a bias of zeros: multiplying by 1 changes no bit, and adding +0 changes none but
    # a -0.0 (to +0.0, an equal number), so skipping the bias spares a pass over the whole input
    y = _standardize(x3, epsilon, None if np.all(scale == 1) else np.tile(scale, n), by_rows=True)[0]
    if np.any(B != 0):
        y += np.tile(B, n)[:, None]
    return (y.reshape(input.shape).astype(input.dtype, copy=False),)


def _group_norm(X, scale, bias, num_groups, epsilon, stash, per_group):
    if num_groups is None:
        raise ValueError("GroupNormalization needs the num_groups attribute")
    n, c = X.shape[:2]
    if num_groups <= 0 or c % num_groups:
        raise ValueError(f"num_groups={num_groups} does not divide the {c} channels")
    x3 = X.astype(_compute_dtype(stash), copy=False).reshape(1, n * num_groups, -1)
    # stage one in the stash precision, stage two (scale and bias) in X's type
    y = _standardize(x3, epsilon, by_rows=True)[0].reshape(n, c, -1).astype(X.dtype, copy=False)
    if per_group:  # opset 18: one scale/bias per group, shared by its channels
        scale, bias = np.repeat(scale, c // num_groups), np.repeat(bias, c // num_groups)
    per_channel(np.multiply, y, scale, out=y)
    per_channel(np.add, y, bias, out=y)
    return (y.reshape(X.shape),)


@kernel("GroupNormalization", since=18)
def group_normalization_18(X, scale, bias, *, num_groups=None, epsilon=1e-5):
    return _group_norm(X, scale, bias, num_groups, epsilon, X.dtype, per_group=True)


@kernel("GroupNormalization", since=21)
def group_normalization(X, scale, bias, *, num_groups=None, epsilon=1e-5, stash_type=1):
    return _group_norm(X, scale, bias, num_groups, epsilon, _stash_dtype(stash_type), per_group=False)


# ---------------------------------------------------------------------------- LRN


@kernel("LRN", since=1)
def lrn(X, *, size=None, alpha=1e-4, beta=0.75, bias=1.0):
    if size is None or size < 1:
        raise ValueError(f"LRN needs a positive size attribute, got {size}")
    ct = _compute_dtype(X.dtype)
    x = X.astype(ct, copy=False)
    c = X.shape[1]
    lo = (size - 1) // 2  # channels before c in the window; ceil((size-1)/2) after it
    padded = np.zeros((X.shape[0], c + size - 1, *X.shape[2:]), dtype=ct)
    np.square(x, out=padded[:, lo:lo + c])
    # the window is a handful of channels: sum shifted views rather than elements
    square_sum = padded[:, 0:c].copy()
    for k in range(1, size):
        square_sum += padded[:, k:k + c]
    square_sum *= ct.type(alpha / size)
    square_sum += ct.type(bias)
    return ((x / np.power(square_sum, ct.type(beta))).astype(X.dtype, copy=False),)


# ---------------------------------------------------------------------------- Dropout


def _dropout(data, ratio, training, rng, want_mask, mask_dtype=np.bool_):
    ratio = float(np.asarray(ratio).item())
    if not training or ratio == 0.0:
        return (data, np.ones(data.shape, dtype=mask_dtype)) if want_mask else (data,)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"Dropout ratio must be in [0, 1), got {ratio}")
    keep = rng.random(data.shape, dtype=np.float32) >= np.float32(ratio)
    out = data * data.dtype.type(1.0 / (1.0 - ratio))
    out *= keep
    return out, keep


@kernel("Dropout", since=7)
def dropout_7(data, *, ratio=0.5, _num_outputs=1):
    # no training switch exists before opset 12: the op is the test-mode identity
    return _dropout(data, ratio, False, None, _num_outputs > 1, mask_dtype=data.dtype)


@kernel("Dropout", since=10)
def dropout_10(data, *, ratio=0.5, _num_outputs=1):
    return _dropout(data, ratio, False, None, _num_outputs > 1)


@kernel("Dropout", since=12)
def dropout(data, ratio=None, training_mode=None, *, seed=None, _num_outputs=1, _rng=None):
    # `seed` is accepted but the session's generator governs every draw (one seed per session)
    training = training_mode is not None and bool(np.asarray(training_mode).item())
    return _dropout(data, 0.5 if ratio is None else ratio, training, _rng, _num_outputs > 1)


# ---------------------------------------------------------------------------- Resize

_COORDINATE_MODES = frozenset({"half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners",
                               "asymmetric", "tf_crop_and_resize", "tf_half_pixel_for_nn"})


def _resize(X, roi, scales, sizes, *, mode, coordinate_transformation_mode, nearest_mode="round_prefer_floor",
            cubic_coeff_a=-0.75, exclude_outside=0, extrapolation_value=0.0, antialias=0, axes=None,
            keep_aspect_ratio_policy="stretch"):
    if mode not in ("nearest", "linear", "cubic"):
        raise ValueError(f"unknown Resize mode {mode!r}")
    if coordinate_transformation_mode not in _COORDINATE_MODES:
        raise ValueError(f"unknown coordinate_transformation_mode {coordinate_transformation_mode!r}")
    if nearest_mode not in NEAREST_ROUNDING:
        raise ValueError(f"unknown nearest_mode {nearest_mode!r}")
    axes = list(range(X.ndim)) if axes is None else [_axis(a, X.ndim, "Resize axis") for a in axes]
    if len(set(axes)) != len(axes):
        raise ValueError(f"Resize axes {axes} repeat an axis")
    plan = resize_output_plan(X, scales, sizes, axes, keep_aspect_ratio_policy)
    rois = [None] * len(axes)
    if coordinate_transformation_mode == "tf_crop_and_resize":
        if roi is None or roi.size != 2 * len(axes):
            raise ValueError(f"tf_crop_and_resize needs roi with {2 * len(axes)} values")
        flat = np.asarray(roi, dtype=np.float64).ravel()
        rois = list(zip(flat[:len(axes)], flat[len(axes):]))
    attrs = dict(mode=mode, coordinate_transformation_mode=coordinate_transformation_mode,
                 nearest_mode=nearest_mode, cubic_coeff_a=cubic_coeff_a, exclude_outside=exclude_outside,
                 extrapolation_value=extrapolation_value, antialias=antialias)
    interpolating = mode != "nearest"
    # integers interpolate in float64 and round to nearest, as the spec's reference does
    # (onnxruntime truncates instead, so it can differ by one)
    ct = np.dtype(np.float64) if X.dtype.kind in "iu" else _compute_dtype(X.dtype)
    y = X.astype(ct, copy=False) if interpolating else X
    # shrinking axes first and, among equals, the innermost first: the per-element gathers
    # along the last axis then run on the smallest array (2x bilinear gets ~15% faster)
    order = sorted(range(len(plan)), key=lambda i: (plan[i][1] / max(X.shape[plan[i][0]], 1), -plan[i][0]))
    for i in order:
        axis, out_len, scale = plan[i]
        y = resize_axis(y, axis, out_len, scale, rois[i], attrs)
    if interpolating and X.dtype.kind in "iu":
        info = np.iinfo(X.dtype)
        y = np.clip(np.rint(y), info.min, info.max)
    return (y.astype(X.dtype, copy=False),)


@kernel("Resize", since=10)
def resize_10(X, scales, *, mode="nearest"):
    if mode not in ("nearest", "linear"):
        raise ValueError(f"Resize-10 supports nearest and linear modes, not {mode!r}")
    return _resize(X, None, scales, None, mode=mode, coordinate_transformation_mode="asymmetric",
                   nearest_mode="_opset10")


@kernel("Resize", since=11)
def resize_11(X, roi=None, scales=None, sizes=None, *, mode="nearest", coordinate_transformation_mode="half_pixel",
              nearest_mode="round_prefer_floor", cubic_coeff_a=-0.75, exclude_outside=0, extrapolation_value=0.0):
    return _resize(X, roi, scales, sizes, mode=mode, coordinate_transformation_mode=coordinate_transformation_mode,
                   nearest_mode=nearest_mode, cubic_coeff_a=cubic_coeff_a, exclude_outside=exclude_outside,
                   extrapolation_value=extrapolation_value)


@kernel("Resize", since=18)
def resize(X, roi=None, scales=None, sizes=None, *, mode="nearest", coordinate_transformation_mode="half_pixel",
           nearest_mode="round_prefer_floor", cubic_coeff_a=-0.75, exclude_outside=0, extrapolation_value=0.0,
           antialias=0, axes=None, keep_aspect_ratio_policy="stretch"):
    if coordinate_transformation_mode == "tf_half_pixel_for_nn":
        raise ValueError("coordinate_transformation_mode tf_half_pixel_for_nn was removed in opset 13")
    return _resize(X, roi, scales, sizes, mode=mode, coordinate_transformation_mode=coordinate_transformation_mode,
                   nearest_mode=nearest_mode, cubic_coeff_a=cubic_coeff_a, exclude_outside=exclude_outside,
                   extrapolation_value=extrapolation_value, antialias=antialias, axes=axes,
                   keep_aspect_ratio_policy=keep_aspect_ratio_policy)


# ---------------------------------------------------------------------------- DepthToSpace / SpaceToDepth

# transposes from the split layout to the output layout, per (op, mode)
_D2S_PERM = {"DCR": (0, 3, 4, 1, 5, 2), "CRD": (0, 1, 4, 2, 5, 3)}
_S2D_PERM = {"DCR": (0, 3, 5, 1, 2, 4), "CRD": (0, 1, 3, 5, 2, 4)}


def _check_block(x, blocksize, mode, perms):
    if x.ndim != 4:
        raise ValueError(f"expects a 4-D N x C x H x W input, got shape {x.shape}")
    if blocksize is None or blocksize < 1:
        raise ValueError(f"blocksize must be a positive integer, got {blocksize}")
    if mode not in perms:
        raise ValueError(f"mode must be DCR or CRD, got {mode!r}")


def _depth_to_space(x, blocksize, mode):
    _check_block(x, blocksize, mode, _D2S_PERM)
    n, c, h, w = x.shape
    bs = blocksize
    if c % (bs * bs):
        raise ValueError(f"{c} channels are not divisible by blocksize^2 = {bs * bs}")
    split = (n, bs, bs, c // (bs * bs), h, w) if mode == "DCR" else (n, c // (bs * bs), bs, bs, h, w)
    return (x.reshape(split).transpose(_D2S_PERM[mode]).reshape(n, c // (bs * bs), h * bs, w * bs),)


def _space_to_depth(x, blocksize, mode):
    _check_block(x, blocksize, mode, _S2D_PERM)
    n, c, h, w = x.shape
    bs = blocksize
    if h % bs or w % bs:
        raise ValueError(f"spatial dims {h} x {w} are not divisible by blocksize {bs}")
    split = x.reshape(n, c, h // bs, bs, w // bs, bs)
    return (split.transpose(_S2D_PERM[mode]).reshape(n, c * bs * bs, h // bs, w // bs),)


@kernel("DepthToSpace", since=1)
def depth_to_space_1(input, *, blocksize=None):
    return _depth_to_space(input, blocksize, "DCR")


@kernel("DepthToSpace", since=11)
def depth_to_space(input, *, blocksize=None, mode="DCR"):
    return _depth_to_space(input, blocksize, mode)


@kernel("SpaceToDepth", since=1)
def space_to_depth_1(input, *, blocksize=None):
    return _space_to_depth(input, blocksize, "DCR")


@kernel("SpaceToDepth", since=28)
def space_to_depth(input, *, blocksize=None, mode="DCR"):
    return _space_to_depth(input, blocksize, mode)


# ---------------------------------------------------------------------------- Pad

_PAD_MODES = frozenset({"constant", "reflect", "edge", "wrap"})


def _pad(data, pads, mode, value, axes=None):
    if mode not in _PAD_MODES:
        raise ValueError(f"unknown Pad mode {mode!r}; expected one of {sorted(_PAD_MODES)}")
    r = data.ndim
    axes = list(range(r)) if axes is None else [_axis(int(a), r, "Pad axis") for a in axes]
    pads = [int(p) for p in pads]
    if len(pads) != 2 * len(axes):
        raise ValueError(f"pads has {len(pads)} values; {2 * len(axes)} expected for {len(axes)} axes")
    begin, end = [0] * r, [0] * r
    for i, a in enumerate(axes):
        begin[a], end[a] = pads[i], pads[len(axes) + i]
    # negative pads remove elements: crop (a view) first, then pad what remains
    x = data[tuple(slice(max(-b, 0), n - max(-e, 0)) for b, e, n in zip(begin, end, data.shape))]
    widths = [(max(b, 0), max(e, 0)) for b, e in zip(begin, end)]
    if not any(b or e for b, e in widths):
        return (x,)
    if mode != "constant":
        return (np.pad(x, widths, mode=mode),)
    shape = tuple(n + b + e for n, (b, e) in zip(x.shape, widths))
    if value is None:
        value = "" if data.dtype.kind in "OSU" else 0
    out = np.full(shape, value, dtype=data.dtype)
    out[tuple(slice(b, b + n) for n, (b, _) in zip(x.shape, widths))] = x
    return (out,)


@kernel("Pad", since=2)
def pad_2(data, *, pads=None, mode="constant", value=0.0):
    if pads is None:
        raise ValueError("Pad needs the pads attribute")
    return _pad(data, pads, mode, value)


@kernel("Pad", since=11)
def pad(data, pads, constant_value=None, axes=None, *, mode="constant"):
    # axes (opset 18+) is a trailing optional input, so one kernel serves opsets 11..25
    value = None if constant_value is None or constant_value.size == 0 else constant_value.reshape(-1)[0]
    return _pad(data, pads.ravel(), mode, value, None if axes is None else axes.ravel().tolist())
