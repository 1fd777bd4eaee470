"""Window and resize geometry: where a convolution's or a pool's windows sit over its input,
how a transposed convolution's padding works out, and which input samples each resized
output reads. Shared by the kernels (odt_ops/kernels/conv.py, pool.py, windows.py, nn.py) and the gradient rules
that must retrace the forward's geometry exactly (odt_ops/grad/rules/conv.py, nn.py).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

AUTO_PADS = ("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")
NEAREST_ROUNDING = {
    "round_prefer_floor": lambda x, scale: np.ceil(x - 0.5),
    "round_prefer_ceil": lambda x, scale: np.floor(x + 0.5),
    "floor": lambda x, scale: np.floor(x),
    "ceil": lambda x, scale: np.ceil(x),
    # Resize-10 (as onnxruntime runs it): truncate when upsampling, round up when downsampling
    "_opset10": lambda x, scale: np.ceil(x) if scale < 1 else np.floor(x),
}


def per_axis(name: str, values: Sequence[int] | None, rank: int, default: int, *, minimum: int) -> tuple[int, ...]:
    """A per-spatial-axis attribute (strides, dilations, kernel_shape...) checked and defaulted."""
    if values is None:
        return (default,) * rank
    values = tuple(int(v) for v in values)
    if len(values) != rank:
        raise ValueError(f"{name} {list(values)} must have one value per spatial axis ({rank})")
    if any(v < minimum for v in values):
        raise ValueError(f"{name} {list(values)} must all be >= {minimum}")
    return values

def explicit_pads(pads: Sequence[int] | None, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if pads is None:
        return (0,) * rank, (0,) * rank
    pads = tuple(int(p) for p in pads)
    if len(pads) != 2 * rank:
        raise ValueError(f"pads {list(pads)} must have 2 values per spatial axis ({2 * rank})")
    if any(p < 0 for p in pads):
        raise ValueError(f"pads {list(pads)} must be non-negative")
    return pads[:rank], pads[rank:]

def check_auto_pad(auto_pad: str) -> None:
    if auto_pad not in AUTO_PADS:
        raise ValueError(f"auto_pad {auto_pad!r} is not one of {', '.join(AUTO_PADS)}")

def split_pad(total: int, auto_pad: str) -> tuple[int, int]:
    """Split a total padding between the two ends: SAME_UPPER puts the odd one at the end."""
    small = total // 2
    return (small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small)

@dataclass(frozen=True)
class WindowGeometry:
    """Per spatial axis: the window and where it lands. ``begin``/``end`` are the pads."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]
    end: tuple[int, ...]
    out: tuple[int, ...]

    @property
    def extents(self) -> tuple[int, ...]:
        """How far one window reaches along each axis."""
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations))

    @property
    def reach(self) -> tuple[int, ...]:
        """The padded length the windows read: up to the end of the last window."""
        return tuple((o - 1) * s + e for o, s, e in zip(self.out, self.strides, self.extents))

def window_geometry(spatial: Sequence[int], kernel: Sequence[int], *, strides, dilations, pads, auto_pad: str,
              ceil_mode: int = 0) -> WindowGeometry:
    rank = len(spatial)
    check_auto_pad(auto_pad)
    strides = per_axis("strides", strides, rank, 1, minimum=1)
    dilations = per_axis("dilations", dilations, rank, 1, minimum=1)
    extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        out = [-(-n // s) for n, s in zip(spatial, strides)]
        # a window shorter than the stride would need negative padding: clamp at 0 (as TensorFlow
        # and onnxruntime's Conv do); the output size stays ceil(input / stride) either way
        totals = [max(0, (o - 1) * s + e - n) for o, s, e, n in zip(out, strides, extents, spatial)]
        begin, end = zip(*(split_pad(t, auto_pad) for t in totals)) if rank else ((), ())
    else:
        if auto_pad == "VALID":
            begin, end = (0,) * rank, (0,) * rank
        else:
            begin, end = explicit_pads(pads, rank)
        rounding = math.ceil if ceil_mode else math.floor
        out = [rounding((n + b + f - e) / s) + 1 for n, b, f, e, s in zip(spatial, begin, end, extents, strides)]
        if ceil_mode:
            # a window that would start in the end padding is dropped
            out = [o - 1 if (o - 1) * s >= n + b else o for o, s, n, b in zip(out, strides, spatial, begin)]
    if any(o < 1 for o in out):
        raise ValueError(
            f"the window (kernel {list(kernel)}, dilations {list(dilations)}) does not fit the input "
            f"spatial shape {list(spatial)} with pads {list(begin) + list(end)}"
        )
    return WindowGeometry(tuple(kernel), strides, dilations, tuple(begin), tuple(end), tuple(out))

def transpose_pads(X: np.ndarray, kernel: Sequence[int], *, strides, dilations, pads, auto_pad, output_padding,
                    output_shape) -> tuple[list[int], list[int]]:
    """Pad at the start of each axis (may be negative) and the output size, as ConvTranspose defines them."""
    spatial = X.shape[2:]
    rank = len(spatial)
    check_auto_pad(auto_pad)
    adjust = per_axis("output_padding", output_padding, rank, 0, minimum=0)
    full = [s * (n - 1) + a + (k - 1) * d + 1 for s, n, a, k, d in zip(strides, spatial, adjust, kernel, dilations)]
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if output_shape is None:
            out = [n * s for n, s in zip(spatial, strides)]
        else:
            out = [int(v) for v in output_shape][-rank:]  # some exporters include N and C
            if len(out) != rank or min(out) < 1:
                raise ValueError(f"output_shape {list(output_shape)} must give {rank} positive spatial sizes")
        # pads follow from the requested size; SAME_UPPER puts the odd one at the end
        begin = [split_pad(f - o, auto_pad)[0] for f, o in zip(full, out)]
        return begin, out
    if auto_pad == "VALID":
        return [0] * rank, full
    begin, end = explicit_pads(pads, rank)
    out = [f - b - e for f, b, e in zip(full, begin, end)]
    if any(o < 1 for o in out):
        raise ValueError(f"pads {list(pads)} leave no output (uncropped output size {full})")
    return list(begin), out

def window_counts(spatial: Sequence[int], geo: WindowGeometry, include_pad: bool) -> np.ndarray:
    """How many window taps land inside the input (or its explicit padding), per output position."""
    counts = []
    for n, k, s, d, b, e, o in zip(spatial, geo.kernel, geo.strides, geo.dilations, geo.begin, geo.end, geo.out):
        taps = np.arange(o)[:, None] * s - b + np.arange(k)[None, :] * d
        low, high = (-b, n + e) if include_pad else (0, n)
        counts.append(((taps >= low) & (taps < high)).sum(axis=1))
    grid = counts[0]
    for c in counts[1:]:
        grid = np.multiply.outer(grid, c)
    return grid

def source_coords(mode, out_len, in_len, scale, roi):
    """Input coordinate each output index samples (float64), and which ones fall outside (crop mode)."""
    y = np.arange(out_len, dtype=np.float64)
    # the spec's reference divides by the fractional output length in align_corners / crop modes
    out_f = scale * in_len
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5, None
    if mode == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - out_len / out_f)
        return offset + (y + 0.5) / scale - 0.5, None
    if mode == "pytorch_half_pixel":
        return ((y + 0.5) / scale - 0.5 if out_len > 1 else np.zeros_like(y)), None
    if mode == "align_corners":
        return (y * (in_len - 1) / (out_f - 1) if out_f != 1 else np.zeros_like(y)), None
    if mode == "asymmetric":
        return y / scale, None
    if mode == "tf_half_pixel_for_nn":
        return (y + 0.5) / scale, None
    start, end = roi
    if out_f != 1:
        x = start * (in_len - 1) + y * (end - start) * (in_len - 1) / (out_f - 1)
    else:
        x = np.full_like(y, 0.5 * (start + end) * (in_len - 1))
    return x, (x < 0) | (x > in_len - 1)

def cubic_keys(t, a):
    t = np.abs(t)
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = ((a * t - 5 * a) * t + 8 * a) * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))

def interpolation_taps(x, in_len, scale, mode, cubic_coeff_a, antialias, exclude_outside):
    """(indices, weights), each (out_len, taps): output i = sum_k weights[i, k] * input[indices[i, k]]."""
    s = min(scale, 1.0) if antialias else 1.0  # antialiasing stretches the filter when downscaling
    support = 1.0 if mode == "linear" else 2.0
    first = math.floor(-support / s) + 1
    offsets = np.arange(first, 1 - first + 1)
    left = np.ceil(x) - 1  # left neighbour, so the fraction lies in (0, 1] as in the reference
    t = s * (offsets[None, :] - (x - left)[:, None])
    weights = np.maximum(1 - np.abs(t), 0.0) if mode == "linear" else cubic_keys(t, cubic_coeff_a)
    if antialias:
        weights /= weights.sum(axis=1, keepdims=True)
    idx = left.astype(np.int64)[:, None] + offsets[None, :]
    if exclude_outside:
        weights = np.where((idx < 0) | (idx >= in_len), 0.0, weights)
        total = weights.sum(axis=1, keepdims=True)
        weights /= np.where(total == 0, 1.0, total)
    return np.clip(idx, 0, in_len - 1), weights

def resize_axis(x, axis, out_len, scale, roi, attrs):
    in_len = x.shape[axis]
    coords, outside = source_coords(attrs["coordinate_transformation_mode"], out_len, in_len, scale, roi)
    if outside is None or not outside.any():
        outside = None
        if out_len == in_len and np.array_equal(coords, np.arange(in_len)):
            return x  # samples land exactly on the input: nothing to do on this axis
    bshape = [1] * x.ndim
    bshape[axis] = out_len
    if attrs["mode"] == "nearest":
        idx = NEAREST_ROUNDING[attrs["nearest_mode"]](coords, scale)
        y = np.take(x, np.clip(idx, 0, in_len - 1).astype(np.intp), axis=axis)
    else:
        idx, w = interpolation_taps(coords, in_len, scale, attrs["mode"], attrs["cubic_coeff_a"],
                                     attrs["antialias"], attrs["exclude_outside"])
        w = w.astype(x.dtype)
        # a few taps per output: accumulate shifted gathers instead of looping over elements
        y = np.take(x, idx[:, 0], axis=axis)
        y *= w[:, 0].reshape(bshape)
        for k in range(1, idx.shape[1]):
            tap = np.take(x, idx[:, k], axis=axis)
            tap *= w[:, k].reshape(bshape)
            y += tap
    if outside is not None:
        y = np.where(outside.reshape(bshape), x.dtype.type(attrs["extrapolation_value"]), y)
    return y

def resize_output_plan(X, scales, sizes, axes, policy):
    """Per resized axis: (axis, output length, scale used by the coordinate transform)."""
    in_sizes = [X.shape[a] for a in axes]
    have_scales = scales is not None and scales.size > 0
    have_sizes = sizes is not None and sizes.size > 0
    if have_scales == have_sizes:
        raise ValueError("Resize needs exactly one of the scales and sizes inputs")
    if have_scales:
        scales = [float(s) for s in np.asarray(scales, dtype=np.float64).ravel()]
        if len(scales) != len(axes):
            raise ValueError(f"scales has {len(scales)} values for {len(axes)} resized axes")
        if min(scales) <= 0:
            raise ValueError(f"scales must be positive, got {scales}")
        return [(a, int(math.floor(s * n)), s) for a, s, n in zip(axes, scales, in_sizes)]
    sizes = [int(s) for s in np.asarray(sizes).ravel()]
    if len(sizes) != len(axes):
        raise ValueError(f"sizes has {len(sizes)} values for {len(axes)} resized axes")
    if min(sizes) <= 0:
        raise ValueError(f"sizes must be positive, got {sizes}")
    ratios = [s / n for s, n in zip(sizes, in_sizes)]
    if policy == "stretch":
        return [(a, s, r) for a, s, r in zip(axes, sizes, ratios)]
    if policy not in ("not_larger", "not_smaller"):
        raise ValueError(f"unknown keep_aspect_ratio_policy {policy!r}")
    r = min(ratios) if policy == "not_larger" else max(ratios)
    return [(a, int(r * n + 0.5), r) for a, n in zip(axes, in_sizes)]  # round half up

class ShapeOnly:
    """Stands in for an array where a kernel helper only reads ``.shape``."""

    def __init__(self, shape: tuple[int, ...]):
        self.shape = shape
