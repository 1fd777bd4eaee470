"""Kernels: pooling (MaxPool, AveragePool, LpPool, GlobalAveragePool, GlobalMaxPool).

Pools are separable: a box max or sum is reduced one spatial axis at a time with
whole-array ufuncs on strided slices (sum(kernel) calls, not prod(kernel)); reducing
the trailing axes of a window view instead was measured ~50x slower. MaxPool's
Indices ride along the same passes, selected by arithmetic rather than np.where; when
the windows tile the input the passes run on a tap-major copy (contiguous blocks).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from odt_ops.kernels.geometry import WindowGeometry, per_axis, window_counts, window_geometry
from odt_ops.kernels.reduce import sum_along
from odt_ops.kernels.registry import kernel
from odt_ops.kernels.windows import batch_steps, check_spatial_input, pad_for_windows


def _pool_geometry(X: np.ndarray, op: str, kernel_shape, *, strides, dilations, pads, auto_pad, ceil_mode) -> WindowGeometry:
    check_spatial_input(X, op)
    if kernel_shape is None:
        raise ValueError(f"{op} needs the kernel_shape attribute")
    kernel = per_axis("kernel_shape", kernel_shape, X.ndim - 2, 1, minimum=1)
    return window_geometry(X.shape[2:], kernel, strides=strides, dilations=dilations, pads=pads, auto_pad=auto_pad,
                     ceil_mode=ceil_mode)


def _lowest(dtype: np.dtype):
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


def _axis_taps(V: np.ndarray, geo: WindowGeometry, axis: int) -> list[np.ndarray]:
    """Per kernel offset along one spatial axis, the strided view it reads at every output position."""
    k, d, o, s = geo.kernel[axis], geo.dilations[axis], geo.out[axis], geo.strides[axis]
    lead = (slice(None),) * (2 + axis)
    return [V[(*lead, slice(j * d, j * d + (o - 1) * s + 1, s))] for j in range(k)]


def _separable(ufunc: np.ufunc, Xp: np.ndarray, geo: WindowGeometry) -> np.ndarray:
    """Reduce every window with ``ufunc`` one axis at a time: a box max or sum is separable, so
    sum(kernel) whole-array ufunc calls replace prod(kernel) ones, each on shrinking data.
    The first spatial axis goes first, while the innermost one is still contiguous."""
    V = Xp
    for axis in range(len(geo.kernel)):
        taps = _axis_taps(V, geo, axis)
        if len(taps) == 1:
            V = taps[0]
            continue
        V = ufunc(taps[0], taps[1])
        for tap in taps[2:]:
            ufunc(V, tap, out=V)
    return V if V.base is None else np.array(V)  # never hand out a view of the input


def _max_with_indices(X: np.ndarray, Xp: np.ndarray, geo: WindowGeometry,
                      storage_order: int) -> tuple[np.ndarray, np.ndarray]:
    """Max and the flat input index of the first maximum in row-major window order.

    Separable like the plain max, but from the last axis to the first: picking the first
    strict maximum per row, then the first row holding a strictly larger one, is exactly
    "first in row-major order". Each value carries the position it came from."""
    N, C, *spatial = X.shape
    plane = math.prod(spatial)
    # each element's flat position in its (n, c) plane (row- or column-major), -1 on padding;
    # int32 halves the traffic of the selects below (a plane never holds 2**31 elements)
    place = np.arange(plane, dtype=np.int32).reshape(spatial[::-1] if storage_order else spatial)
    place = pad_for_windows((place.T if storage_order else place)[None, None], geo, -1)
    padded = bool((place < 0).any())
    values, where = Xp, place
    for axis in reversed(range(len(spatial))):
        taps = zip(_axis_taps(values, geo, axis), _axis_taps(where, geo, axis))
        first, first_place = next(taps)
        values = np.array(first)
        where = np.broadcast_to(first_place, values.shape).copy()
        for tap, tap_place in taps:
            better = tap > values
            if padded:  # any real tap replaces a padding one (uint8 zeros tie with the padding)
                better |= where < 0
            np.maximum(values, tap, out=values)
            # select by arithmetic: np.where / masked copyto branch on a random mask and run ~7x slower
            step = tap_place - where
            step *= better
            where += step
    planes = np.arange(N * C, dtype=np.int64).reshape(N, C, *(1,) * len(spatial)) * plane
    return values, planes + where


def _tiles(geo: WindowGeometry, spatial: Sequence[int]) -> bool:
    """Whether the windows tile the input: kernel == stride, undilated, no padding read."""
    return geo.kernel == geo.strides and all(d == 1 for d in geo.dilations) and not any(geo.begin) \
        and all(r <= n for r, n in zip(geo.reach, spatial))


def _offset_dtype(largest: int) -> np.dtype:
    """The narrowest signed integer holding +-largest: the selects below move 1-2 bytes per element."""
    return next(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64) if largest <= np.iinfo(t).max)


def _max_with_indices_tiled(X: np.ndarray, geo: WindowGeometry, storage_order: int) -> tuple[np.ndarray, np.ndarray]:
    """``_max_with_indices`` for windows that tile the input (the common 2x2 stride 2).

    The same passes, last window axis first, so ties and NaNs resolve exactly alike. The
    strided taps of small planes cost numpy one short inner loop per output row in every
    pass, so one copy first lays the input out tap-major, (*kernel, N, C, *out): each pass
    then runs over whole contiguous blocks (a large batch in cache-sized slices). Each value
    carries its offset from its window's origin in the narrowest integer that holds it; the
    flat index is assembled once, straight into the output."""
    N, C, *spatial = X.shape
    rank = len(spatial)
    plane = math.prod(spatial)
    pitch = [math.prod(spatial[a + 1:]) for a in range(rank)]  # row-major plane strides
    if storage_order:
        pitch = [math.prod(spatial[:a]) for a in range(rank)]
    grid = as_strided(X, writeable=False,
                      shape=(N, C, *(n for o, k in zip(geo.out, geo.kernel) for n in (o, k))),
                      strides=(*X.strides[:2], *(n for s, k in zip(X.strides[2:], geo.kernel) for n in (s * k, s))))
    tap_major = (*range(3, 2 + 2 * rank, 2), 0, 1, *range(2, 2 + 2 * rank, 2))
    origin = sum(np.arange(o, dtype=np.int64).reshape((o,) + (1,) * (rank - 1 - a)) * (k * p)
                 for a, (o, k, p) in enumerate(zip(geo.out, geo.kernel, pitch)))
    planes = np.arange(N * C, dtype=np.int64).reshape(N, C, *(1,) * rank) * plane
    offset_type = _offset_dtype(sum((k - 1) * p for k, p in zip(geo.kernel, pitch)))  # the farthest tap
    values = np.empty((N, C, *geo.out), dtype=X.dtype)
    indices = np.empty((N, C, *geo.out), dtype=np.int64)
    buffer = None
    for batch in batch_steps(N, 2 * C * plane * X.itemsize):  # the taps and the passes' temporaries
        n = batch.stop - batch.start
        if buffer is None:
            buffer = np.empty((*geo.kernel, n, C, *geo.out), dtype=X.dtype)
        taps = buffer[(slice(None),) * rank + (slice(n),)]
        np.copyto(taps, grid[batch].transpose(tap_major))
        offsets = _first_max_offsets(taps, geo.kernel, pitch, offset_type, values[batch])
        np.add(planes[batch], origin, out=indices[batch])
        if offsets is not None:  # None: one-tap windows
            indices[batch] += offsets
    return values, indices


def _first_max_offsets(taps: np.ndarray, kernel: Sequence[int], pitch: Sequence[int], offset_type: np.dtype,
                       out: np.ndarray) -> np.ndarray | None:
    """Max over the leading (*kernel) axes of ``taps`` into ``out``, last axis first, and the plane
    offset of the first maximum (None for one-tap windows), as in ``_max_with_indices``."""
    rank = len(kernel)
    values, offsets = taps, None
    for axis in reversed(range(rank)):  # values: (*kernel[:axis + 1], n, C, *out)
        lead = (slice(None),) * axis
        row = [values[(*lead, j)] for j in range(kernel[axis])]
        carried = [None if offsets is None else offsets[(*lead, j)] for j in range(kernel[axis])]
        best, at = row[0], carried[0]
        for j, (tap, came) in enumerate(zip(row[1:], carried[1:]), start=1):
            # at = better ? j steps along this axis + came : at, by arithmetic (no branchy select)
            better = (tap > best).view(np.int8)
            if j == 1:  # the first maximum makes a fresh array (the last pass's lands in ``out``)
                best = np.maximum(best, tap, out=out if axis == 0 else None)
            else:
                np.maximum(best, tap, out=best)
            if at is None:  # no offsets yet: all zero
                at = better * offset_type.type(j * pitch[axis])
                continue
            step = np.subtract(offset_type.type(j * pitch[axis]), at, dtype=offset_type)
            if came is not None:
                step += came
            step *= better
            at = at + step if j == 1 else np.add(at, step, out=at)
        values, offsets = best, at
    if values is not out:  # a one-tap first axis: no maximum was taken in the last pass
        np.copyto(out, values)
    return offsets


@kernel("MaxPool", since=1)
def max_pool(X, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, pads=None, storage_order=0,
             strides=None, _num_outputs=1):
    geo = _pool_geometry(X, "MaxPool", kernel_shape, strides=strides, dilations=dilations, pads=pads,
                         auto_pad=auto_pad, ceil_mode=ceil_mode)
    if storage_order not in (0, 1):
        raise ValueError(f"storage_order must be 0 (row major) or 1 (column major), got {storage_order}")
    if _num_outputs > 1 and _tiles(geo, X.shape[2:]):
        return _max_with_indices_tiled(X, geo, storage_order)
    Xp = pad_for_windows(X, geo, _lowest(X.dtype))
    if _num_outputs > 1:
        return _max_with_indices(X, Xp, geo, storage_order)
    return (_separable(np.maximum, Xp, geo),)


@kernel("AveragePool", since=1)
def average_pool(X, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape=None,
                 pads=None, strides=None):
    geo = _pool_geometry(X, "AveragePool", kernel_shape, strides=strides, dilations=dilations, pads=pads,
                         auto_pad=auto_pad, ceil_mode=ceil_mode)
    total = _separable(np.add, pad_for_windows(X, geo, 0), geo)
    counts = window_counts(X.shape[2:], geo, bool(count_include_pad))
    full = math.prod(geo.kernel)
    if (counts == full).all():
        total *= X.dtype.type(1 / full)
    else:
        total /= counts.astype(X.dtype)
    return (total,)


@kernel("LpPool", since=1)
def lp_pool(X, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, p=2, pads=None, strides=None):
    geo = _pool_geometry(X, "LpPool", kernel_shape, strides=strides, dilations=dilations, pads=pads,
                         auto_pad=auto_pad, ceil_mode=ceil_mode)
    if p <= 0:
        raise ValueError(f"LpPool p must be positive, got {p}")
    powered = X * X if p == 2 else np.abs(X) ** X.dtype.type(p)
    total = _separable(np.add, pad_for_windows(powered, geo, 0), geo)
    return (np.sqrt(total) if p == 2 else total ** X.dtype.type(1 / p),)


@kernel("GlobalAveragePool", since=1)
def global_average_pool(X):
    check_spatial_input(X, "GlobalAveragePool")
    if X.dtype not in (np.float32, np.float64):
        return (X.mean(axis=tuple(range(2, X.ndim)), keepdims=True),)
    total = sum_along(X, tuple(range(2, X.ndim)), True)  # gemv over the planes where that is faster
    total *= X.dtype.type(1 / math.prod(X.shape[2:]))
    return (total,)


@kernel("GlobalMaxPool", since=1)
def global_max_pool(X):
    check_spatial_input(X, "GlobalMaxPool")
    return (X.max(axis=tuple(range(2, X.ndim)), keepdims=True),)
