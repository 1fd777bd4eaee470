"""Kernels: convolution and pooling (Conv, ConvTranspose, MaxPool, AveragePool, LpPool, Global*Pool).

Every op here slides a window over the spatial axes (all axes after N, C), so they
share one geometry helper that resolves kernel/strides/dilations/pads/auto_pad into
per-axis numbers, and one padding helper that pads exactly as far as the windows
reach (no copy at all when they stay inside the input).

Speed notes (numpy is ~3x slower on ufuncs over short strided rows than over long
contiguous runs, so most of what follows is about layouts):
- Conv at stride 1, one group, over at least as many input channels as outputs, is a GEMM
  per kernel tap read straight from flat padded planes, summed (``_conv_taps``): no im2col.
- Any other Conv is im2col: a strided window view of the padded input, copied once into
  (N, group, C/group * kernel + 1, positions) whose last row is ones, then one batched
  matmul against the weights with the bias as an extra column, landing directly in
  NCHW. At stride 1 the windows are read from flattened padded planes, one flat offset
  per kernel tap (``_flat_planes``), so the copy moves long runs; when the output keeps the
  input's row length ("same" padding) the offsets read the unpadded planes and the few
  reads that wrap across a row end are cleared (``row_windows``): no padded canvas, no
  crop, no extra GEMM columns. Depthwise convolutions
  skip the GEMM (N*group tiny GEMMs are slow) and multiply-add whole shifted planes.
- ConvTranspose is one batched GEMM to columns, then col2im as one np.sum over a
  strided view of the columns per output phase (see ``_col2im``), not one scattered
  addition per kernel tap.
- Pools are separable: a box max or sum is reduced one spatial axis at a time with
  whole-array ufuncs on strided slices (sum(kernel) calls, not prod(kernel)); reducing
  the trailing axes of a window view instead was measured ~50x slower. MaxPool's
  Indices ride along the same passes, selected by arithmetic rather than np.where; when
  the windows tile the input the passes run on a tap-major copy (contiguous blocks).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided, sliding_window_view

from odt_ops.kernels.channels import per_channel
from odt_ops.kernels.geometry import WindowGeometry, per_axis, transpose_pads, window_counts, window_geometry
from odt_ops.kernels.reduce import sum_along
from odt_ops.kernels.registry import kernel

_CACHE_BYTES = 4 << 20  # ``_batch_steps``: im2col/col2im columns kept well inside the last-level cache


# ---------------------------------------------------------------- window geometry


def _pad_into(target: np.ndarray, X: np.ndarray, geo: WindowGeometry) -> None:
    """Copy X into a (N, C, *reach) canvas already filled with the padding value."""
    keep = [min(n, r - b) for n, r, b in zip(X.shape[2:], geo.reach, geo.begin)]
    target[(..., *(slice(b, b + k) for b, k in zip(geo.begin, keep)))] = X[(..., *(slice(k) for k in keep))]


def _pad_for_windows(X: np.ndarray, geo: WindowGeometry, fill) -> np.ndarray:
    """X padded with ``fill`` exactly as far as the windows read (cropped where they stop short)."""
    reach = geo.reach
    if not any(geo.begin) and all(r <= n for r, n in zip(reach, X.shape[2:])):
        return X[(..., *(slice(r) for r in reach))]  # a view: no window touches padding
    padded = np.full(X.shape[:2] + reach, fill, dtype=X.dtype)
    _pad_into(padded, X, geo)
    return padded


def _flat_span(geo: WindowGeometry) -> int:
    """The positions ``_flat_planes`` computes per plane: every output row across the padded row width."""
    return geo.out[0] * math.prod(geo.reach[1:])


def _flat_planes(X: np.ndarray, geo: WindowGeometry) -> tuple[np.ndarray, list[int], int]:
    """Stride-1 windows as flat offsets: (zero-padded flat planes, offset per kernel tap, span).

    With each padded (n, c) grid flattened, kernel tap k reads the plane shifted by one
    flat offset. Computing every output row across the full padded row width (``span``
    positions per plane) turns 2-D/3-D windows into long contiguous runs, for the price
    of a few columns past each output row, which ``_crop_flat`` drops at the end."""
    reach = geo.reach
    plane_strides = [math.prod(reach[i + 1:]) for i in range(len(reach))]
    offsets = [sum(k * d * ps for k, d, ps in zip(offset, geo.dilations, plane_strides))
               for offset in np.ndindex(*geo.kernel)]
    span = _flat_span(geo)
    flat = np.zeros((*X.shape[:2], span + max(offsets)), dtype=X.dtype)  # the tail covers the last tap's reads
    _pad_into(flat[..., : math.prod(reach)].reshape(*X.shape[:2], *reach), X, geo)
    return flat, offsets, span


def _crop_flat(Y: np.ndarray, geo: WindowGeometry) -> np.ndarray:
    """(N, M, span) results of ``_flat_planes`` windows as a contiguous (N, M, positions)."""
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


def _offset_slices(Xp: np.ndarray, geo: WindowGeometry) -> Iterator[np.ndarray]:
    """Per kernel offset (row-major), the strided view of a channels-last padded input (N, *reach, C)
    that the offset reads at every output position."""
    for offset in np.ndindex(*geo.kernel):
        yield Xp[(slice(None), *(slice(k * d, k * d + (o - 1) * s + 1, s)
                                 for k, d, o, s in zip(offset, geo.dilations, geo.out, geo.strides)))]


def _windows(Xp: np.ndarray, geo: WindowGeometry) -> np.ndarray:
    """A (N, C, *out, *kernel) view of every window of the padded input."""
    rank = len(geo.kernel)
    view = sliding_window_view(Xp, geo.extents, axis=tuple(range(2, 2 + rank)))
    return view[(..., *(slice(None, None, s) for s in geo.strides), *(slice(None, None, d) for d in geo.dilations))]


def _wide(*arrays: np.ndarray) -> list[np.ndarray]:
    """Half-precision operands widened to float32: sums of many half products drift past tolerance."""
    return [a.astype(np.float32) if a is not None and a.dtype.itemsize < 4 and a.dtype.kind in "fV" else a
            for a in arrays]


def _spatial_input(X: np.ndarray, op: str) -> None:
    if X.ndim < 3:
        raise ValueError(f"{op} needs an (N, C, spatial...) input of rank >= 3, got shape {X.shape}")


def _check_kernel_shape(kernel_shape: Sequence[int] | None, W: np.ndarray) -> None:
    if kernel_shape is not None and tuple(kernel_shape) != W.shape[2:]:
        raise ValueError(f"kernel_shape {list(kernel_shape)} differs from the weights' spatial shape "
                         f"{list(W.shape[2:])}")


# ---------------------------------------------------------------- Conv


def _conv_geometry(X: np.ndarray, W: np.ndarray, kernel_shape, group: int, **window) -> WindowGeometry:
    _spatial_input(X, "Conv")
    if W.ndim != X.ndim:
        raise ValueError(f"Conv weights of shape {W.shape} do not match the rank of input {X.shape}")
    if group < 1 or X.shape[1] % group or W.shape[0] % group:
        raise ValueError(f"group {group} must divide the input channels {X.shape[1]} and output channels {W.shape[0]}")
    if W.shape[1] * group != X.shape[1]:
        raise ValueError(f"weights {W.shape} expect {W.shape[1] * group} input channels (group {group}), "
                         f"input has {X.shape[1]}")
    _check_kernel_shape(kernel_shape, W)
    return window_geometry(X.shape[2:], W.shape[2:], **window)


def _add_bias(Y: np.ndarray, B: np.ndarray) -> None:
    """Y (N, M, ...) += B per channel, in place."""
    per_channel(np.add, Y, B.astype(Y.dtype, copy=False), out=Y)


def _batch_steps(N: int, per_image: int, budget: int | None = None, whole: int = 2) -> Iterator[slice]:
    """Batch slices whose temporaries (``per_image`` bytes an image) fit ``budget`` (``_CACHE_BYTES``
    unless given); a batch up to ``whole`` budgets is one slice.

    Cache blocking, not a loop over images: a large batch's im2col or col2im columns (15-20 MB
    at batch 256) are written and read back from memory; in slices that stay in cache the same
    work ran 25-50% faster. For them, up to twice that size is one slice (two ran no faster);
    ``_conv_taps`` re-reads its block once per tap and wants ``whole=1`` (one block of 1.6
    budgets ran up to 2x slower than two)."""
    budget = _CACHE_BYTES if budget is None else budget
    step = N if N * per_image <= whole * budget else max(1, budget // max(1, per_image))
    return (slice(i, min(N, i + step)) for i in range(0, N, step))


_TAP_BLOCK_BYTES = 1 << 20  # ``_conv_taps``: an image block's planes and results, kept in the core's cache
_TAP_MIN_CHANNELS = 8  # below this a tap's GEMM is too thin (K = C): im2col's one GEMM of K = C * taps wins


def _tap_bytes(X: np.ndarray, M: int, geo: WindowGeometry) -> int:
    """One image's working set in ``_conv_taps``: its padded planes, and its results twice (sum and term)."""
    return (X.shape[1] * math.prod(geo.reach) + 2 * M * _flat_span(geo)) * X.itemsize


def _takes_taps(X: np.ndarray, W: np.ndarray, geo: WindowGeometry, group: int) -> bool:
    """Whether ``_conv_taps`` is the faster form: one group, stride 1, a spatial kernel, at least as
    many input channels as outputs (the per-tap sums cost M * positions each, im2col's copy C * taps
    per position) and an image that fits the cache block (a ResNet 56x56x64 layer ran 1.3x slower)."""
    M, C = W.shape[0], X.shape[1]
    return (group == 1 and _TAP_MIN_CHANNELS <= C and M <= C and len(geo.kernel) > 1 and math.prod(geo.kernel) > 1
            and all(s == 1 for s in geo.strides) and _tap_bytes(X, M, geo) <= _TAP_BLOCK_BYTES)


def _conv_taps(X: np.ndarray, W: np.ndarray, B: np.ndarray | None, geo: WindowGeometry) -> np.ndarray:
    """A stride-1 convolution as one GEMM per kernel tap over flat planes, summed: no im2col.

    On the zero-padded planes flattened (``_flat_planes``), tap t reads every output position's
    input at one flat offset, so its operand is a plain slice of the planes that BLAS reads in
    place (row pitch = the plane), and Y = sum over taps of W[:, :, t] @ planes[..., offset_t:].
    The im2col form copies C * taps rows per position first (37 MB for one UNet layer at batch
    32) and reads them back; this reads the planes once per tap from cache, blocked by images
    so that a block's planes and results stay there. Measured 1.2-2.2x faster on UNet's 3x3 and
    5x5 layers that keep or narrow the channels; see ``_takes_taps`` for where it is slower."""
    N, C = X.shape[:2]
    M = W.shape[0]
    dtype = np.result_type(X, W)
    planes, offsets, span = _flat_planes(X, geo)
    weights = np.ascontiguousarray(W.reshape(M, C, len(offsets)).transpose(2, 0, 1), dtype=dtype)  # (taps, M, C)
    Y = np.empty((N, M, span), dtype=dtype)
    term = None
    for images in _batch_steps(N, _tap_bytes(X, M, geo), budget=_TAP_BLOCK_BYTES, whole=1):
        Yb = Y[images]
        if term is None:  # the first block is the largest
            term = np.empty_like(Yb)
        tb = term[: images.stop - images.start]
        for t, offset in enumerate(offsets):
            np.matmul(weights[t], planes[images, :, offset:offset + span], out=tb if t else Yb)
            if t:
                Yb += tb
    Y = _crop_flat(Y, geo)
    if B is not None:
        _add_bias(Y, B)
    return Y


def _conv_gemm(X: np.ndarray, W: np.ndarray, B: np.ndarray | None, geo: WindowGeometry, group: int) -> np.ndarray:
    """im2col + one batched GEMM, straight into (N, M, positions).

    The im2col copy goes into a buffer with one extra row of ones when there is a bias,
    so the GEMM adds the bias (as an extra weight column) for the price of that row.
    At stride 1 the columns may come from flat planes (``_flat_planes``): the copy then
    moves long runs instead of output rows."""
    N, C = X.shape[:2]
    M, taps = W.shape[0], math.prod(geo.kernel)
    rows = C // group * taps
    weights = W.reshape(group, M // group, rows)
    unit = all(s == 1 for s in geo.strides)
    dtype = np.result_type(X, W)
    if taps == 1 and unit and not any(geo.begin) and X.shape[2:] == geo.out:
        # pointwise: the input is its own im2col
        Y = np.matmul(weights, X.reshape(N, group, rows, -1)).reshape(N, M, -1)
        if B is not None:
            _add_bias(Y, B)
        return Y
    # flat columns trade the im2col copy's N*C*taps*rows short rows for a crop of the output's
    # N*M*rows short rows (and a few more GEMM columns): worth it when M is well below C*taps
    rowwise = keeps_rows(X, geo)
    flat = unit and len(geo.kernel) > 1 and 2 * M <= C * taps and not rowwise
    if rowwise:
        windows, grid = row_windows(X, geo), (math.prod(geo.out),)
    elif flat:
        planes, _, span = _flat_planes(X, geo)
        plane_strides = [math.prod(geo.reach[i + 1:]) * X.itemsize for i in range(len(geo.kernel))]
        windows = as_strided(planes, shape=(N, C, *geo.kernel, span), writeable=False,
                             strides=(*planes.strides[:2], *(d * ps for d, ps in zip(geo.dilations, plane_strides)),
                                      X.itemsize))
        grid = (span,)
    else:
        rank = len(geo.kernel)
        windows = _windows(_pad_for_windows(X, geo, 0), geo)  # (N, C, *out, *kernel)
        windows = windows.transpose(0, 1, *range(2 + rank, 2 + 2 * rank), *range(2, 2 + rank))
        grid = geo.out
    positions = math.prod(grid)
    if B is not None:
        weights = np.concatenate([weights, B.reshape(group, M // group, 1)], axis=2)
    Y = np.empty((N, group, M // group, positions), dtype=dtype)
    buffer = None
    for batch in _batch_steps(N, group * (rows + 1) * positions * X.itemsize):
        n = batch.stop - batch.start
        if buffer is None:
            buffer = np.empty((n, group, rows + (B is not None), positions), dtype=X.dtype)
            if B is not None:
                buffer[:, :, rows] = 1  # the copies below never touch this row
        cols = buffer[:n]
        np.copyto(cols[:, :, :rows].reshape(n, group, C // group, *geo.kernel, *grid),
                  windows[batch].reshape(n, group, C // group, *geo.kernel, *grid))
        if rowwise:
            zero_wrapped(cols[:, :, :rows].reshape(n, group, C // group, *geo.kernel, *geo.out), geo)
        np.matmul(weights, cols, out=Y[batch])
    Y = Y.reshape(N, M, -1)
    return _crop_flat(Y, geo) if flat else Y


def _channels_last(X: np.ndarray) -> np.ndarray:
    """(N, C, *spatial) as a (N, *spatial, C) view."""
    return X.transpose(0, *range(2, X.ndim), 1)


def _channels_first(Y: np.ndarray) -> np.ndarray:
    """(N, *spatial, C) back to a contiguous (N, C, *spatial)."""
    return np.ascontiguousarray(Y.transpose(0, Y.ndim - 1, *range(1, Y.ndim - 1)))


def _conv_depthwise(X: np.ndarray, W: np.ndarray, B: np.ndarray | None, geo: WindowGeometry, group: int) -> np.ndarray:
    """One input channel per group: accumulate weight * shifted input over kernel offsets.

    Channels last: every tap is then a strided view whose innermost run is all the channels
    (at stride 1, whole rows of them), multiplied by a per-channel weight vector along that
    run, so numpy's inner loops are long and vectorized. Channels first, the same taps were
    short spatial rows times a broadcast scalar, 1.5-3x slower. A channel multiplier (M/group
    outputs per input channel) repeats the input channels first."""
    N, M = X.shape[0], W.shape[0]
    if M != group:
        X = np.repeat(X, M // group, axis=1)
    padded = np.zeros((N, *geo.reach, M), dtype=X.dtype)
    _pad_into(np.moveaxis(padded, -1, 1), X, geo)  # through a channels-first view of the canvas
    # (taps, last output axis, M), contiguous: with the weights spelled out along the last spatial
    # axis too, a stride-1 tap, the weights and Y all hold (last axis, M) as one contiguous run,
    # which numpy's iterator fuses into one inner loop however few the channels
    weights = np.ascontiguousarray(np.broadcast_to(W.reshape(M, -1).T[:, None, :], (W[0].size, geo.out[-1], M)))
    Y = np.empty((N, *geo.out, M), dtype=np.result_type(X, W))
    term = np.empty_like(Y)
    for i, tap in enumerate(_offset_slices(padded, geo)):
        np.multiply(tap, weights[i], out=Y if i == 0 else term)
        if i:
            Y += term
    Y = _channels_first(Y).reshape(N, M, -1)
    if B is not None:
        _add_bias(Y, B)
    return Y


@kernel("Conv", since=1)
def conv(X, W, B=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    geo = _conv_geometry(X, W, kernel_shape, group, strides=strides, dilations=dilations, pads=pads, auto_pad=auto_pad)
    Xc, Wc, Bc = _wide(X, W, B)
    if group > 1 and W.shape[1] == 1:
        Y = _conv_depthwise(Xc, Wc, Bc, geo, group)  # (N, M, positions)
    elif _takes_taps(Xc, Wc, geo, group):
        Y = _conv_taps(Xc, Wc, Bc, geo)
    else:
        Y = _conv_gemm(Xc, Wc, Bc, geo, group)
    return (Y.reshape(X.shape[0], W.shape[0], *geo.out).astype(X.dtype, copy=False),)


# ---------------------------------------------------------------- ConvTranspose


def _phase_taps(lead: int, k: int, d: int, s: int) -> tuple[list[tuple[int, int, int]], int, int]:
    """Along one axis, which kernel taps land on each stride phase.

    Tap k lands at coordinate lead + k*d = c*s + r (block c, phase r). The taps of one
    phase are evenly spaced, ``step`` taps apart, and their blocks ``shift`` apart; per
    phase this gives (first tap, tap count, first block)."""
    step = s // math.gcd(d, s)
    firsts = {(lead + k0 * d) % s: k0 for k0 in range(min(step, k))}
    phases = []
    for r in range(s):
        k0 = firsts.get(r)
        phases.append((0, 0, 0) if k0 is None else (k0, len(range(k0, k, step)), (lead + k0 * d) // s))
    return phases, step, step * d // s


def _col2im(X: np.ndarray, W: np.ndarray, group: int, strides, dilations, first: Sequence[int],
            out: Sequence[int]) -> np.ndarray:
    """The transposed convolution of X by W, cropped to ``out`` positions from ``first`` on.

    Tap k of input position h lands at coordinate h*s + k*d (per axis). A batched GEMM makes
    one column block per (tap, output channel) and image; col2im sums, for every output
    position, the columns of the taps that land there. Rather than one scattered addition
    per tap (numpy adds short strided rows ~3x slower than contiguous ones), every output
    phase (coordinate mod stride) is ONE sum over a strided view of the columns:
    - X is embedded in a zero grid of ``blocks`` (coordinate // stride) per axis, so a tap
      shifted by c blocks is the same columns read c blocks earlier, one flat offset
      across all spatial axes; what it reads before a block's start is the zero margin
      ending the previous block (or a zero guard before the buffer);
    - within a phase the taps and their shifts are evenly spaced (``_phase_taps``), so the
      view has one axis per spatial axis over those taps and np.sum reduces them.
    Large batches go through in slices (``_batch_steps``) reusing one column buffer.
    """
    N, C, *spatial = X.shape
    kernel, taps = W.shape[2:], math.prod(W.shape[2:])
    per_group = W.shape[1]
    if taps == 1 and all(s == 1 for s in strides) and not any(first) and list(out) == spatial:
        # pointwise (a 1x1 convolution's input gradient): every column lands on its own
        # position, so the GEMM's result is the output; no col2im
        Wt = W.reshape(group, C // group, per_group).transpose(0, 2, 1)
        Y = np.matmul(Wt, X.reshape(N, group, C // group, -1))
        return Y.reshape(N, group * per_group, *out)
    lead = [max(0, -f) for f in first]  # shifts coordinates so that none is negative
    reach = [(ld + (k - 1) * d) // s for ld, k, d, s in zip(lead, kernel, dilations, strides)]
    blocks = [max(n + c, -(-(ld + f + o) // s)) for n, c, ld, f, o, s in zip(spatial, reach, lead, first, out, strides)]
    if blocks != spatial:
        grid = np.zeros((N, C, *blocks), dtype=X.dtype)
        grid[(..., *(slice(n) for n in spatial))] = X
        X = grid
    area = math.prod(blocks)
    block_strides = [math.prod(blocks[i + 1:]) for i in range(len(blocks))]
    row = per_group * area  # one (image, group, tap) column block
    guard = sum(c * bs for c, bs in zip(reach, block_strides))
    dtype = np.result_type(X, W)
    # weights as (group, tap, out channel, in channel): each tap's columns are one contiguous block
    Wt = W.reshape(group, C // group, per_group, taps).transpose(0, 3, 2, 1)
    Wt = Wt.reshape(group, taps * per_group, C // group)
    X = X.reshape(N, group, C // group, area)
    per_axis = [_phase_taps(ld, k, d, s) for ld, k, d, s in zip(lead, kernel, dilations, strides)]
    tap_strides = [math.prod(kernel[i + 1:]) for i in range(len(kernel))]
    jumps = [(step * ts * row - shift * bs) * dtype.itemsize
             for (_, step, shift), ts, bs in zip(per_axis, tap_strides, block_strides)]
    Y = np.empty((N, group * per_group, *out), dtype=dtype)
    buffer = None
    for batch in _batch_steps(N, group * taps * row * dtype.itemsize):
        n, Yb = batch.stop - batch.start, Y[batch]
        if buffer is None:
            buffer = np.empty(guard + n * group * taps * row, dtype=dtype)
            buffer[:guard] = 0  # later slices reuse the buffer: the guard stays zero
        columns = buffer[guard:guard + n * group * taps * row].reshape(n, group, taps * per_group, area)
        np.matmul(Wt, X[batch], out=columns)
        for phase in np.ndindex(*strides):
            # output j along an axis is coordinate lead + first + j: phase (lead + first + j) % s
            firsts = [(ph - ld - f) % s for ph, ld, f, s in zip(phase, lead, first, strides)]
            counts = [len(range(j, o, s)) for j, o, s in zip(firsts, out, strides)]
            if 0 in counts:
                continue  # no output position has this phase
            target = (..., *(slice(j, o, s) for j, o, s in zip(firsts, out, strides)))
            chosen = [phases[ph] for (phases, _, _), ph in zip(per_axis, phase)]
            if any(count == 0 for _, count, _ in chosen):
                Yb[target] = 0  # no tap lands on this phase
                continue
            origin = guard + sum(k0 * ts for (k0, _, _), ts in zip(chosen, tap_strides)) * row \
                - sum(c0 * bs for (_, _, c0), bs in zip(chosen, block_strides))
            view = as_strided(
                buffer[origin:],
                shape=(n, group, *(count for _, count, _ in chosen), row),
                strides=(group * taps * row * dtype.itemsize, taps * row * dtype.itemsize, *jumps, dtype.itemsize),
                writeable=False,
            )
            plane = view.sum(axis=tuple(range(2, 2 + len(kernel)))).reshape(n, group * per_group, *blocks)
            starts = [(ld + f + j) // s for ld, f, j, s in zip(lead, first, firsts, strides)]
            Yb[target] = plane[(..., *(slice(b, b + c) for b, c in zip(starts, counts)))]
    return Y


def _transpose_depthwise(X: np.ndarray, W: np.ndarray, group: int, strides, dilations, first: Sequence[int],
                         out: Sequence[int]) -> np.ndarray:
    """``_col2im`` for one channel in and out per group (a depthwise convolution's input gradient).

    Tap k of input position h lands on output position h*s + k*d - first (per axis). Each tap
    adds weight * X over the input positions that land inside the output: one strided
    multiply-add per tap, channels last as in ``_conv_depthwise``. No GEMM (per channel and
    image a 1 x 1 GEMM is all overhead) and no column buffer."""
    N, C, *spatial = X.shape
    kernel = W.shape[2:]
    dtype = np.result_type(X, W)
    Xl = _channels_last(X)
    Y = np.zeros((N, *out, C), dtype=dtype)
    weights = np.ascontiguousarray(W.reshape(C, -1).T)  # (taps, C)
    term = np.empty(Xl.shape, dtype=dtype)
    for t, tap in enumerate(np.ndindex(*kernel)):
        src, dst = [], []
        for k, d, s, f, n, o in zip(tap, dilations, strides, first, spatial, out):
            lo = max(0, -(-(f - k * d) // s))  # first h with h*s + k*d - f >= 0
            hi = min(n - 1, (o - 1 + f - k * d) // s)  # last h landing before the output's end
            if hi < lo:
                break
            src.append(slice(lo, hi + 1))
            start = lo * s + k * d - f
            dst.append(slice(start, start + (hi - lo) * s + 1, s))
        else:
            part = term[(slice(None), *(slice(sl.stop - sl.start) for sl in src))]
            np.multiply(Xl[(slice(None), *src)], weights[t], out=part)
            Y[(slice(None), *dst)] += part
    return _channels_first(Y)


@kernel("ConvTranspose", since=1)
def conv_transpose(X, W, B=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                   output_padding=None, output_shape=None, pads=None, strides=None):
    _spatial_input(X, "ConvTranspose")
    C, rank = X.shape[1], X.ndim - 2
    if W.ndim != X.ndim or W.shape[0] != C:
        raise ValueError(f"ConvTranspose weights {W.shape} must be (C={C}, M/group, kernel...) of rank {X.ndim}")
    if group < 1 or C % group:
        raise ValueError(f"group {group} must divide the input channels {C}")
    _check_kernel_shape(kernel_shape, W)
    kernel = W.shape[2:]
    strides = per_axis("strides", strides, rank, 1, minimum=1)
    dilations = per_axis("dilations", dilations, rank, 1, minimum=1)
    begin, out = transpose_pads(X, kernel, strides=strides, dilations=dilations, pads=pads, auto_pad=auto_pad,
                                 output_padding=output_padding, output_shape=output_shape)
    Xc, Wc, Bc = _wide(X, W, B)
    depthwise = group == C and W.shape[1] == 1
    Y = (_transpose_depthwise if depthwise else _col2im)(Xc, Wc, group, strides, dilations, begin, out)
    if Bc is not None:
        _add_bias(Y, Bc)
    return (Y.astype(X.dtype, copy=False),)


# ---------------------------------------------------------------- pooling


def _pool_geometry(X: np.ndarray, op: str, kernel_shape, *, strides, dilations, pads, auto_pad, ceil_mode) -> WindowGeometry:
    _spatial_input(X, op)
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
    place = _pad_for_windows((place.T if storage_order else place)[None, None], geo, -1)
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
    for batch in _batch_steps(N, 2 * C * plane * X.itemsize):  # the taps and the passes' temporaries
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
    Xp = _pad_for_windows(X, geo, _lowest(X.dtype))
    if _num_outputs > 1:
        return _max_with_indices(X, Xp, geo, storage_order)
    return (_separable(np.maximum, Xp, geo),)


@kernel("AveragePool", since=1)
def average_pool(X, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None, kernel_shape=None,
                 pads=None, strides=None):
    geo = _pool_geometry(X, "AveragePool", kernel_shape, strides=strides, dilations=dilations, pads=pads,
                         auto_pad=auto_pad, ceil_mode=ceil_mode)
    total = _separable(np.add, _pad_for_windows(X, geo, 0), geo)
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
    total = _separable(np.add, _pad_for_windows(powered, geo, 0), geo)
    return (np.sqrt(total) if p == 2 else total ** X.dtype.type(1 / p),)


@kernel("GlobalAveragePool", since=1)
def global_average_pool(X):
    _spatial_input(X, "GlobalAveragePool")
    if X.dtype not in (np.float32, np.float64):
        return (X.mean(axis=tuple(range(2, X.ndim)), keepdims=True),)
    total = sum_along(X, tuple(range(2, X.ndim)), True)  # gemv over the planes where that is faster
    total *= X.dtype.type(1 / math.prod(X.shape[2:]))
    return (total,)


@kernel("GlobalMaxPool", since=1)
def global_max_pool(X):
    _spatial_input(X, "GlobalMaxPool")
    return (X.max(axis=tuple(range(2, X.ndim)), keepdims=True),)
