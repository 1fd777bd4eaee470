"""Window views shared by convolution and pooling: padding exactly as far as the windows
reach, im2col as strided views of (flat) padded planes, row windows over unpadded planes,
and image blocks sized to stay in cache. Also read by the fused window gradients
(runtime/fusion/windows.py)."""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided, sliding_window_view

from odt_ops.kernels.geometry import WindowGeometry

CACHE_BYTES = 4 << 20  # ``batch_steps``: im2col/col2im columns kept well inside the last-level cache




def pad_into(target: np.ndarray, X: np.ndarray, geo: WindowGeometry) -> None:
    """Copy X into a (N, C, *reach) canvas already filled with the padding value."""
    keep = [min(n, r - b) for n, r, b in zip(X.shape[2:], geo.reach, geo.begin)]
    target[(..., *(slice(b, b + k) for b, k in zip(geo.begin, keep)))] = X[(..., *(slice(k) for k in keep))]


def pad_for_windows(X: np.ndarray, geo: WindowGeometry, fill) -> np.ndarray:
    """X padded with ``fill`` exactly as far as the windows read (cropped where they stop short)."""
    reach = geo.reach
    if not any(geo.begin) and all(r <= n for r, n in zip(reach, X.shape[2:])):
        return X[(..., *(slice(r) for r in reach))]  # a view: no window touches padding
    padded = np.full(X.shape[:2] + reach, fill, dtype=X.dtype)
    pad_into(padded, X, geo)
    return padded


def flat_span(geo: WindowGeometry) -> int:
    """The positions ``flat_planes`` computes per plane: every output row across the padded row width."""
    return geo.out[0] * math.prod(geo.reach[1:])


def flat_planes(X: np.ndarray, geo: WindowGeometry) -> tuple[np.ndarray, list[int], int]:
    """Stride-1 windows as flat offsets: (zero-padded flat planes, offset per kernel tap, span).

    With each padded (n, c) grid flattened, kernel tap k reads the plane shifted by one
    flat offset. Computing every output row across the full padded row width (``span``
    positions per plane) turns 2-D/3-D windows into long contiguous runs, for the price
    of a few columns past each output row, which ``crop_flat`` drops at the end."""
    reach = geo.reach
    plane_strides = [math.prod(reach[i + 1:]) for i in range(len(reach))]
    offsets = [sum(k * d * ps for k, d, ps in zip(offset, geo.dilations, plane_strides))
               for offset in np.ndindex(*geo.kernel)]
    span = flat_span(geo)
    flat = np.zeros((*X.shape[:2], span + max(offsets)), dtype=X.dtype)  # the tail covers the last tap's reads
    pad_into(flat[..., : math.prod(reach)].reshape(*X.shape[:2], *reach), X, geo)
    return flat, offsets, span


def crop_flat(Y: np.ndarray, geo: WindowGeometry) -> np.ndarray:
    """(N, M, span) results of ``flat_planes`` windows as a contiguous (N, M, positions)."""
    rows = Y.reshape(*Y.shape[:2], geo.out[0], *geo.reach[1:])
    return np.ascontiguousarray(rows[(..., *(slice(o) for o in geo.out[1:]))]).reshape(*Y.shape[:2], -1)


def keeps_rows(X: np.ndarray, geo: WindowGeometry) -> bool:
    """Stride 1 and every output axis but the first as long as the input's: ``row_windows`` applies."""
    return all(s == 1 for s in geo.strides) and geo.out[1:] == X.shape[3:]


def row_windows(X: np.ndarray, geo: WindowGeometry) -> np.ndarray:
    """For ``keeps_rows`` geometries: a (N, C, *kernel, positions) view of the taps, read from the
    UNPADDED planes flattened, each tap one flat offset away.

    An output position then reads its tap at its own flat position plus the offset, so the
    im2col copy moves whole planes and the columns come out in output order (no padded rows
    to crop, no extra GEMM columns). Reads above or below the plane land in zero margins;
    reads past a row's end wrap into the neighbouring row: ``zero_wrapped`` clears those."""
    N, C, *spatial = X.shape
    pitch = [math.prod(spatial[a + 1:]) for a in range(len(spatial))]
    shifts = [(-b * p) for b, p in zip(geo.begin, pitch)]  # offset of the first tap
    first = sum(shifts)
    last = first + sum((k - 1) * d * p for k, d, p in zip(geo.kernel, geo.dilations, pitch))  # offset of the last tap
    plane, span = math.prod(spatial), geo.out[0] * pitch[0]
    front = max(0, -min(first, last))
    planes = np.empty((N, C, front + max(plane, span + max(first, last))), dtype=X.dtype)
    planes[..., :front] = 0  # only the margins need zeros: the plane is copied over
    planes[..., front + plane:] = 0
    planes[..., front:front + plane] = X.reshape(N, C, plane)
    return as_strided(planes[..., front + first:], shape=(N, C, *geo.kernel, span), writeable=False,
                      strides=(*planes.strides[:2], *(d * p * X.itemsize for d, p in zip(geo.dilations, pitch)),
                               X.itemsize))


def zero_wrapped(cols: np.ndarray, geo: WindowGeometry) -> None:
    """Clear the im2col entries ``row_windows`` read across a row end. ``cols`` is (..., *kernel, *out):
    along every axis but the first, tap k shifted by s = k*d - pad reads a neighbour row at the
    first -s or the last s positions; one strided assignment per such tap and axis."""
    rank = len(geo.kernel)
    for axis in range(1, rank):
        n = geo.out[axis]
        for k in range(geo.kernel[axis]):
            shift = k * geo.dilations[axis] - geo.begin[axis]
            if shift == 0:
                continue
            where = [slice(None)] * (2 * rank)
            where[axis] = k
            where[rank + axis] = slice(0, min(-shift, n)) if shift < 0 else slice(max(0, n - shift), n)
            cols[(..., *where)] = 0


def offset_slices(Xp: np.ndarray, geo: WindowGeometry) -> Iterator[np.ndarray]:
    """Per kernel offset (row-major), the strided view of a channels-last padded input (N, *reach, C)
    that the offset reads at every output position."""
    for offset in np.ndindex(*geo.kernel):
        yield Xp[(slice(None), *(slice(k * d, k * d + (o - 1) * s + 1, s)
                                 for k, d, o, s in zip(offset, geo.dilations, geo.out, geo.strides)))]


def window_view(Xp: np.ndarray, geo: WindowGeometry) -> np.ndarray:
    """A (N, C, *out, *kernel) view of every window of the padded input."""
    rank = len(geo.kernel)
    view = sliding_window_view(Xp, geo.extents, axis=tuple(range(2, 2 + rank)))
    return view[(..., *(slice(None, None, s) for s in geo.strides), *(slice(None, None, d) for d in geo.dilations))]


def wide(*arrays: np.ndarray) -> list[np.ndarray]:
    """Half-precision operands widened to float32: sums of many half products drift past tolerance."""
    return [a.astype(np.float32) if a is not None and a.dtype.itemsize < 4 and a.dtype.kind in "fV" else a
            for a in arrays]


def check_spatial_input(X: np.ndarray, op: str) -> None:
    if len(X.shape) < 3:  # X may be a geometry.ShapeOnly
        raise ValueError(f"{op} needs an (N, C, spatial...) input of rank >= 3, got shape {X.shape}")


def check_kernel_shape(kernel_shape: Sequence[int] | None, W: np.ndarray) -> None:
    if kernel_shape is not None and tuple(kernel_shape) != W.shape[2:]:
        raise ValueError(f"kernel_shape {list(kernel_shape)} differs from the weights' spatial shape "
                         f"{list(W.shape[2:])}")


def batch_steps(N: int, per_image: int, budget: int | None = None, whole: int = 2) -> Iterator[slice]:
    """Batch slices whose temporaries (``per_image`` bytes an image) fit ``budget`` (``CACHE_BYTES``
    unless given); a batch up to ``whole`` budgets is one slice.

    Cache blocking, not a loop over images: a large batch's im2col or col2im columns (15-20 MB
    at batch 256) are written and read back from memory; in slices that stay in cache the same
    work ran 25-50% faster. For them, up to twice that size is one slice (two ran no faster);
    ``_conv_taps`` re-reads its block once per tap and wants ``whole=1`` (one block of 1.6
    budgets ran up to 2x slower than two)."""
    budget = CACHE_BYTES if budget is None else budget
    step = N if N * per_image <= whole * budget else max(1, budget // max(1, per_image))
    return (slice(i, min(N, i + step)) for i in range(0, N, step))
