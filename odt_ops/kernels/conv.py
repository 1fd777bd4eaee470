"""Kernels: convolution (Conv, ConvTranspose); pooling is kernels/pool.py, the window views
both use kernels/windows.py.

Every op here slides a window over the spatial axes (all axes after N, C), so they
share one geometry helper that resolves kernel/strides/dilations/pads/auto_pad into
per-axis numbers, and one padding helper that pads exactly as far as the windows
reach (no copy at all when they stay inside the input).

Speed notes (numpy is ~3x slower on ufuncs over short strided rows than over long
contiguous runs, so most of what follows is about layouts):
- Conv at stride 1, one group, over at least as many input channels as outputs and with output
  rows of at least 16, is a GEMM per kernel tap read straight from flat padded planes, summed
  (``_conv_taps``): no im2col.
- Any other Conv is im2col: a strided window view of the padded input, copied once into
  (N, group, C/group * kernel + 1, positions) whose last row is ones, then one batched
  matmul against the weights with the bias as an extra column, landing directly in
  NCHW. At stride 1 the windows are read from flattened padded planes, one flat offset
  per kernel tap (``flat_planes``), so the copy moves long runs; when the output keeps the
  input's row length ("same" padding) the offsets read the unpadded planes and the few
  reads that wrap across a row end are cleared (``row_windows``): no padded canvas, no
  crop, no extra GEMM columns. Depthwise convolutions
  skip the GEMM (N*group tiny GEMMs are slow) and multiply-add whole shifted planes.
- ConvTranspose is one batched GEMM to columns, then col2im as one np.sum over a
  strided view of the columns per output phase (see ``_col2im``), not one scattered
  addition per kernel tap.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from odt_ops.kernels.channels import NUMPY_BUFFER, per_channel, unbuffered_runs
from odt_ops.kernels.geometry import ShapeOnly, WindowGeometry, per_axis, transpose_pads, window_geometry
from odt_ops.kernels.registry import kernel
from odt_ops.kernels.windows import (
    batch_steps,
    check_kernel_shape,
    check_spatial_input,
    crop_flat,
    flat_planes,
    flat_span,
    keeps_rows,
    offset_slices,
    pad_for_windows,
    pad_into,
    row_windows,
    wide,
    window_view,
    zero_wrapped,
)

# ---------------------------------------------------------------- Conv


def _conv_geometry(X: np.ndarray, W: np.ndarray, kernel_shape, group: int, **window) -> WindowGeometry:
    check_spatial_input(X, "Conv")
    if W.ndim != len(X.shape):  # X may be a ShapeOnly
        raise ValueError(f"Conv weights of shape {W.shape} do not match the rank of input {X.shape}")
    if group < 1 or X.shape[1] % group or W.shape[0] % group:
        raise ValueError(f"group {group} must divide the input channels {X.shape[1]} and output channels {W.shape[0]}")
    if W.shape[1] * group != X.shape[1]:
        raise ValueError(f"weights {W.shape} expect {W.shape[1] * group} input channels (group {group}), "
                         f"input has {X.shape[1]}")
    check_kernel_shape(kernel_shape, W)
    return window_geometry(X.shape[2:], W.shape[2:], **window)


def _add_bias(Y: np.ndarray, B: np.ndarray) -> None:
    """Y (N, M, ...) += B per channel, in place."""
    per_channel(np.add, Y, B.astype(Y.dtype, copy=False), out=Y)


_TAP_BLOCK_BYTES = 1 << 20  # ``_conv_taps``: an image block's planes and results, kept in the core's cache
_TAP_MIN_CHANNELS = 8  # below this a tap's GEMM is too thin (K = C): im2col's one GEMM of K = C * taps wins
# below this many output columns the flat planes waste too much: each row computes (kernel width - 1)
# columns that are cropped, and the pad rows too (UNet's and ResNet-50's 3x3 layers, one thread, Zen 4:
# im2col took 0.64-0.74x the per-tap time at 4-8 columns and 0.81-0.91x at 14, 1.2-1.9x at 16-32)
_TAP_MIN_COLUMNS = 16


def _tap_bytes(X: np.ndarray, M: int, geo: WindowGeometry) -> int:
    """One image's working set in ``_conv_taps``: its padded planes, and its results twice (sum and term)."""
    return (X.shape[1] * math.prod(geo.reach) + 2 * M * flat_span(geo)) * X.itemsize


def _takes_taps(X: np.ndarray, W: np.ndarray, geo: WindowGeometry, group: int) -> bool:
    """Whether ``_conv_taps`` is the faster form: one group, stride 1, a spatial kernel, at least as
    many input channels as outputs (the per-tap sums cost M * positions each, im2col's copy C * taps
    per position), output rows of at least ``_TAP_MIN_COLUMNS`` and an image that fits the cache block
    (a ResNet 56x56x64 layer ran 1.3x slower)."""
    M, C = W.shape[0], X.shape[1]
    return (group == 1 and _TAP_MIN_CHANNELS <= C and M <= C and len(geo.kernel) > 1 and math.prod(geo.kernel) > 1
            and geo.out[-1] >= _TAP_MIN_COLUMNS
            and all(s == 1 for s in geo.strides) and _tap_bytes(X, M, geo) <= _TAP_BLOCK_BYTES)


def _conv_taps(X: np.ndarray, W: np.ndarray, B: np.ndarray | None, geo: WindowGeometry) -> np.ndarray:
    """A stride-1 convolution as one GEMM per kernel tap over flat planes, summed: no im2col.

    On the zero-padded planes flattened (``flat_planes``), tap t reads every output position's
    input at one flat offset, so its operand is a plain slice of the planes that BLAS reads in
    place (row pitch = the plane), and Y = sum over taps of W[:, :, t] @ planes[..., offset_t:].
    The im2col form copies C * taps rows per position first (37 MB for one UNet layer at batch
    32) and reads them back; this reads the planes once per tap from cache, blocked by images
    so that a block's planes and results stay there. Measured 1.2-2.2x faster on UNet's 3x3 and
    5x5 layers that keep or narrow the channels; see ``_takes_taps`` for where it is slower."""
    N, C = X.shape[:2]
    M = W.shape[0]
    dtype = np.result_type(X, W)
    planes, offsets, span = flat_planes(X, geo)
    weights = np.ascontiguousarray(W.reshape(M, C, len(offsets)).transpose(2, 0, 1), dtype=dtype)  # (taps, M, C)
    Y = np.empty((N, M, span), dtype=dtype)
    term = None
    for images in batch_steps(N, _tap_bytes(X, M, geo), budget=_TAP_BLOCK_BYTES, whole=1):
        Yb = Y[images]
        if term is None:  # the first block is the largest
            term = np.empty_like(Yb)
        tb = term[: images.stop - images.start]
        for t, offset in enumerate(offsets):
            np.matmul(weights[t], planes[images, :, offset:offset + span], out=tb if t else Yb)
            if t:
                Yb += tb
    Y = crop_flat(Y, geo)
    if B is not None:
        _add_bias(Y, B)
    return Y


def _conv_gemm(X: np.ndarray, W: np.ndarray, B: np.ndarray | None, geo: WindowGeometry, group: int) -> np.ndarray:
    """im2col + one batched GEMM, straight into (N, M, positions).

    The im2col copy goes into a buffer with one extra row of ones when there is a bias,
    so the GEMM adds the bias (as an extra weight column) for the price of that row.
    At stride 1 the columns may come from flat planes (``flat_planes``): the copy then
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
    flat = unit and len(geo.kernel) > 1 and C * taps >= 2 * M and not rowwise
    if rowwise:
        windows, grid = row_windows(X, geo), (math.prod(geo.out),)
    elif flat:
        planes, _, span = flat_planes(X, geo)
        plane_strides = [math.prod(geo.reach[i + 1:]) * X.itemsize for i in range(len(geo.kernel))]
        windows = as_strided(planes, shape=(N, C, *geo.kernel, span), writeable=False,
                             strides=(*planes.strides[:2], *(d * ps for d, ps in zip(geo.dilations, plane_strides)),
                                      X.itemsize))
        grid = (span,)
    else:
        rank = len(geo.kernel)
        windows = window_view(pad_for_windows(X, geo, 0), geo)  # (N, C, *out, *kernel)
        windows = windows.transpose(0, 1, *range(2 + rank, 2 + 2 * rank), *range(2, 2 + rank))
        grid = geo.out
    positions = math.prod(grid)
    if B is not None:
        weights = np.concatenate([weights, B.reshape(group, M // group, 1)], axis=2)
    Y = np.empty((N, group, M // group, positions), dtype=dtype)
    buffer = None
    for batch in batch_steps(N, group * (rows + 1) * positions * X.itemsize):
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
    return crop_flat(Y, geo) if flat else Y


def _channels_last(X: np.ndarray) -> np.ndarray:
    """(N, C, *spatial) as a (N, *spatial, C) view."""
    return X.transpose(0, *range(2, X.ndim), 1)


def _channels_first(Y: np.ndarray) -> np.ndarray:
    """(N, *spatial, C) back to a contiguous (N, C, *spatial)."""
    return np.ascontiguousarray(Y.transpose(0, Y.ndim - 1, *range(1, Y.ndim - 1)))


def _conv_depthwise(X: np.ndarray, W: np.ndarray, B: np.ndarray | None, geo: WindowGeometry, group: int) -> np.ndarray:
    """``depthwise_channels_last`` on an (N, C, *spatial) input, as a contiguous (N, M, positions)."""
    N, M = X.shape[0], W.shape[0]
    Y = _channels_first(depthwise_channels_last(_channels_last(X), W, geo, group)).reshape(N, M, -1)
    if B is not None:
        _add_bias(Y, B)
    return Y


def depthwise_channels_last(Xl: np.ndarray, W: np.ndarray, geo: WindowGeometry, group: int) -> np.ndarray:
    """One input channel per group, channels last in and out: (N, *spatial, C) -> (N, *out, M), no bias.
    Accumulates weight * shifted input over kernel offsets.

    Channels last: every tap is then a strided view whose innermost run is all the channels
    (at stride 1, whole rows of them), multiplied by a per-channel weight vector along that
    run, so numpy's inner loops are long and vectorized. Channels first, the same taps were
    short spatial rows times a broadcast scalar, 1.5-3x slower. A channel multiplier (M/group
    outputs per input channel) repeats the input channels first. The channels-last training
    graph (runtime/fusion/layout.py) calls this directly; ``conv`` transposes around it."""
    N, M = Xl.shape[0], W.shape[0]
    if group != M:
        Xl = np.repeat(Xl, M // group, axis=-1)
    if len(geo.kernel) == 2 and any(s > 1 for s in geo.strides):
        taps = _phase_plane_taps(Xl, geo)
    else:
        padded = np.zeros((N, *geo.reach, M), dtype=Xl.dtype)
        pad_into(np.moveaxis(padded, -1, 1), np.moveaxis(Xl, -1, 1), geo)  # through channels-first views
        taps = offset_slices(padded, geo)
    # (taps, last output axis, M), contiguous: with the weights spelled out along the last spatial
    # axis too, a stride-1 tap, the weights and Y all hold (last axis, M) as one contiguous run,
    # which numpy's iterator fuses into one inner loop however few the channels
    weights = np.ascontiguousarray(np.broadcast_to(W.reshape(M, -1).T[:, None, :], (W[0].size, geo.out[-1], M)))
    Y = np.empty((N, *geo.out, M), dtype=np.result_type(Xl, W))
    term = np.empty_like(Y)
    # a run of (last axis, M) is read in place, not through numpy's buffer: 0.6-0.9x the time on the
    # benchmark CNNs' layers (the strided taps of other ranks measured no faster unbuffered)
    whole_rows = len(geo.kernel) == 2 or geo.strides[-1] == 1  # 2-D: stride 1 or phase planes
    with unbuffered_runs(geo.out[-1] * M if whole_rows else NUMPY_BUFFER):
        for i, tap in enumerate(taps):
            np.multiply(tap, weights[i], out=Y if i == 0 else term)
            if i:
                Y += term
    return Y


def _phase_plane_taps(Xl: np.ndarray, geo: WindowGeometry) -> list[np.ndarray]:
    """A strided 2-D window's taps (row-major, as ``offset_slices``) as stride-1 views: the zero-padded
    input split into strides[0] x strides[1] phase planes (padded row a + s*u of phase a is plane row
    u), where tap (i, j) reads phase ((i*d) % s) from plane offset ((i*d) // s) on, per axis. A stride-2
    tap read straight from the padded input has runs of C values; here it has whole rows (output
    width x C) in place: 0.67-0.82x the depthwise Conv's time on the benchmark CNNs' stride-2 layers,
    batch 8 and 32, one thread, AMD EPYC Zen 4. The same products in the same order: the same bits."""
    N, M = Xl.shape[0], Xl.shape[-1]
    (kh, kw), (sh, sw), (dh, dw), out = geo.kernel, geo.strides, geo.dilations, geo.out
    (rh, rw), (bh, bw) = geo.reach, geo.begin
    ph, pw = -(-rh // sh), -(-rw // sw)
    planes = {}
    for a, b in {((i * dh) % sh, (j * dw) % sw) for i, j in np.ndindex(kh, kw)}:
        plane = np.zeros((N, ph, pw, M), dtype=Xl.dtype)
        u, v = -(-(bh - a) // sh), -(-(bw - b) // sw)  # the first plane row / column inside the input
        rows = Xl[:, a + sh * u - bh:rh - bh:sh, b + sw * v - bw:rw - bw:sw]  # the input rows / columns that phase holds
        plane[:, u:u + rows.shape[1], v:v + rows.shape[2]] = rows
        planes[a, b] = plane
    return [planes[(i * dh) % sh, (j * dw) % sw][:, (i * dh) // sh:(i * dh) // sh + out[0], (j * dw) // sw:(j * dw) // sw + out[1]]
            for i, j in np.ndindex(kh, kw)]


def _nchw(shape: Sequence[int]) -> ShapeOnly:
    """An (N, *spatial, C) shape as the (N, C, *spatial) one the geometry helpers read."""
    return ShapeOnly((shape[0], shape[-1], *shape[1:-1]))


def _pointwise(W: np.ndarray, geo: WindowGeometry, group: int, spatial: Sequence[int]) -> bool:
    return group == 1 and math.prod(geo.kernel) == 1 and all(s == 1 for s in geo.strides) and not any(geo.begin) \
        and tuple(geo.out) == tuple(spatial)


def is_depthwise_conv(channels: int, weight_shape: Sequence[int], group: int) -> bool:
    """Whether ``conv`` runs a Conv over ``channels`` inputs with these weights and group as
    ``depthwise_channels_last`` (one input channel per group)."""
    return group > 1 and group == channels and len(weight_shape) > 2 and weight_shape[1] == 1


def windows_channels_last(Xl: np.ndarray, W: np.ndarray, geo: WindowGeometry) -> np.ndarray:
    """A one-group convolution channels last in and out, (N, *spatial, C) -> (N, *out, M), no bias,
    as ONE matrix product: the windows (N * positions, taps * C) @ the weights (taps * C, M).

    Channels last, a window is a few runs of C contiguous values (one per kernel row), so the
    im2col copy is one ``np.copyto`` from a strided view of the padded input, and the product
    lands already channels last: no per-image GEMMs, no layout shuffle. Images go through in
    cache-sized slices (``batch_steps``) that reuse one column buffer."""
    N, C, M = Xl.shape[0], Xl.shape[-1], W.shape[0]
    rank, taps = len(geo.kernel), math.prod(geo.kernel)
    if any(geo.begin) or any(r > n for r, n in zip(geo.reach, Xl.shape[1:-1])):
        padded = np.zeros((N, *geo.reach, C), dtype=Xl.dtype)
        pad_into(np.moveaxis(padded, -1, 1), np.moveaxis(Xl, -1, 1), geo)  # through channels-first views
    else:
        padded = Xl  # the windows stay inside the input
    step = padded.strides[1:-1]
    windows = as_strided(padded, shape=(N, *geo.out, *geo.kernel, C), writeable=False,
                         strides=(padded.strides[0], *(p * s for p, s in zip(step, geo.strides)),
                                  *(p * d for p, d in zip(step, geo.dilations)), padded.strides[-1]))
    # (M, C, *kernel) -> (*kernel, C, M): row t * C + c multiplies window column t * C + c
    weights = np.ascontiguousarray(W.transpose(*range(2, 2 + rank), 1, 0).reshape(taps * C, M), dtype=np.result_type(Xl, W))
    positions = math.prod(geo.out)
    Y = np.empty((N, positions, M), dtype=weights.dtype)
    buffer = None
    for batch in batch_steps(N, positions * taps * C * Xl.itemsize):
        n = batch.stop - batch.start
        if buffer is None:
            buffer = np.empty((n, *geo.out, *geo.kernel, C), dtype=Xl.dtype)
        columns = buffer[:n]
        np.copyto(columns, windows[batch])
        np.matmul(columns.reshape(n * positions, taps * C), weights, out=Y[batch].reshape(n * positions, M))
    return Y.reshape(N, *geo.out, M)


def pointwise_channels_last(Xl: np.ndarray, W: np.ndarray, transposed: bool = False) -> np.ndarray:
    """A 1x1 convolution (or, ``transposed``, a 1x1 transposed one) of one group, stride 1 and no
    padding on a channels-last array, no bias: a matrix product per pixel, (pixels, C) @ (C, M), the
    same dot products as the channels-first GEMM summed in BLAS's order for this shape (rounding only)."""
    C = Xl.shape[-1]
    weights = W.reshape(C, -1) if transposed else W.reshape(W.shape[0], -1).T
    return (Xl.reshape(-1, C) @ weights).reshape(*Xl.shape[:-1], weights.shape[1])


def conv_channels_last(Xl, W, B=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    """``conv`` on and to channels-last arrays. Depthwise: the same products and sums in the same
    order (the bias added per element as ``conv`` adds it), so the same bits; 1x1: one matrix
    product, the same sums in BLAS's order; any other one-group convolution: ``windows_channels_last``,
    the same products summed in BLAS's order."""
    geo = _conv_geometry(_nchw(Xl.shape), W, kernel_shape, group, strides=strides, dilations=dilations, pads=pads,
                         auto_pad=auto_pad)
    Xc, Wc, Bc = wide(Xl, W, B)
    if _pointwise(W, geo, group, Xl.shape[1:-1]):
        Y = pointwise_channels_last(Xc, Wc)
    elif is_depthwise_conv(Xl.shape[-1], W.shape, group):
        Y = depthwise_channels_last(Xc, Wc, geo, group)
    elif group == 1:
        Y = windows_channels_last(Xc, Wc, geo)
    else:
        raise ValueError(f"the channels-last Conv runs one-group and depthwise convolutions only, not weights {W.shape} in group {group}")
    if Bc is not None:
        np.add(Y, Bc.astype(Y.dtype, copy=False), out=Y)
    return (Y.astype(Xl.dtype, copy=False),)


@kernel("Conv", since=1)
def conv(X, W, B=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    geo = _conv_geometry(X, W, kernel_shape, group, strides=strides, dilations=dilations, pads=pads, auto_pad=auto_pad)
    Xc, Wc, Bc = wide(X, W, B)
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
    Large batches go through in slices (``batch_steps``) reusing one column buffer.
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
    for batch in batch_steps(N, group * taps * row * dtype.itemsize):
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
    """``transpose_depthwise_channels_last`` on an (N, C, *spatial) input, to (N, C, *out)."""
    return _channels_first(transpose_depthwise_channels_last(_channels_last(X), W, strides, dilations, first, out))


# the strided per-tap multiplies of a depthwise convolution's input gradient (here) and weight gradient
# (runtime/fusion/layout_ops.py, DepthwiseWeightGrad) run in ``unbuffered_runs`` of this many elements:
# on the benchmark CNNs' layers, batch 8 and 32, one thread, AMD EPYC Zen 4, the input gradient took
# 0.72-0.92x the time of numpy's default buffer, the weight gradient 0.80-0.95x at stride 1 (0.98-1.00
# at stride 2)
TAP_RUN = 2048


def transpose_depthwise_channels_last(Xl: np.ndarray, W: np.ndarray, strides, dilations, first: Sequence[int],
                                      out: Sequence[int]) -> np.ndarray:
    """``_col2im`` for one channel in and out per group (a depthwise convolution's input gradient),
    channels last in and out: (N, *spatial, C) -> (N, *out, C), no bias.

    Tap k of input position h lands on output position h*s + k*d - first (per axis). Each tap
    adds weight * X over the input positions that land inside the output: one strided
    multiply-add per tap, channels last as in ``depthwise_channels_last``. No GEMM (per channel and
    image a 1 x 1 GEMM is all overhead) and no column buffer."""
    N, *spatial, C = Xl.shape
    kernel = W.shape[2:]
    dtype = np.result_type(Xl, W)
    Y = np.zeros((N, *out, C), dtype=dtype)
    weights = np.ascontiguousarray(W.reshape(C, -1).T)  # (taps, C)
    term = np.empty(Xl.shape, dtype=dtype)
    with unbuffered_runs(TAP_RUN):
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
    return Y


def _transpose_geometry(X, W, *, auto_pad, dilations, group, kernel_shape, output_padding, output_shape, pads, strides):
    """(strides, dilations, first output coordinate, output sizes) of a ConvTranspose; X may be a ShapeOnly."""
    check_spatial_input(X, "ConvTranspose")
    C, rank = X.shape[1], len(X.shape) - 2
    if W.ndim != len(X.shape) or W.shape[0] != C:
        raise ValueError(f"ConvTranspose weights {W.shape} must be (C={C}, M/group, kernel...) of rank {len(X.shape)}")
    if group < 1 or C % group:
        raise ValueError(f"group {group} must divide the input channels {C}")
    check_kernel_shape(kernel_shape, W)
    kernel = W.shape[2:]
    strides = per_axis("strides", strides, rank, 1, minimum=1)
    dilations = per_axis("dilations", dilations, rank, 1, minimum=1)
    begin, out = transpose_pads(X, kernel, strides=strides, dilations=dilations, pads=pads, auto_pad=auto_pad,
                                 output_padding=output_padding, output_shape=output_shape)
    return strides, dilations, begin, out


@kernel("ConvTranspose", since=1)
def conv_transpose(X, W, B=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                   output_padding=None, output_shape=None, pads=None, strides=None):
    strides, dilations, begin, out = _transpose_geometry(
        X, W, auto_pad=auto_pad, dilations=dilations, group=group, kernel_shape=kernel_shape,
        output_padding=output_padding, output_shape=output_shape, pads=pads, strides=strides)
    Xc, Wc, Bc = wide(X, W, B)
    depthwise = group == X.shape[1] and W.shape[1] == 1
    Y = (_transpose_depthwise if depthwise else _col2im)(Xc, Wc, group, strides, dilations, begin, out)
    if Bc is not None:
        _add_bias(Y, Bc)
    return (Y.astype(X.dtype, copy=False),)


def conv_transpose_channels_last(Xl, W, B=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                                 output_padding=None, output_shape=None, pads=None, strides=None):
    """``conv_transpose`` of a depthwise (the same bits) or 1x1 (one matrix product) transposed
    convolution on and to channels-last arrays."""
    strides, dilations, begin, out = _transpose_geometry(
        _nchw(Xl.shape), W, auto_pad=auto_pad, dilations=dilations, group=group, kernel_shape=kernel_shape,
        output_padding=output_padding, output_shape=output_shape, pads=pads, strides=strides)
    Xc, Wc, Bc = wide(Xl, W, B)
    if group == 1 and W.shape[2:] == (1, 1) and all(s == 1 for s in strides) and not any(begin) and tuple(out) == Xl.shape[1:-1]:
        Y = pointwise_channels_last(Xc, Wc, transposed=True)
    elif group == Xl.shape[-1] and W.shape[1] == 1:
        Y = transpose_depthwise_channels_last(Xc, Wc, strides, dilations, begin, out)
    else:
        raise ValueError(f"the channels-last ConvTranspose runs depthwise and 1x1 ones only, not weights {W.shape} in group {group}")
    if Bc is not None:
        np.add(Y, Bc.astype(Y.dtype, copy=False), out=Y)
    return (Y.astype(Xl.dtype, copy=False),)
