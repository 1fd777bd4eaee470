"""Per-channel arithmetic on an (N, C, spatial...) tensor: a bias, a normalization's
statistics and affine, their gradients' per-channel factors.

numpy broadcasts a (1, C, 1, 1) operand one short spatial row at a time and pays its
loop overhead per row: a multiply on (8, 64, 16, 16) float32 took 61 us against 20 us
for two whole arrays. Spelled out over one image first (C x spatial values, a few KiB)
and broadcast over the batch, each image is one contiguous run: 35 us with the row's
making, and the same operation on the same operands element by element, so the same
bits.
"""
from __future__ import annotations

import functools
import math

import numpy as np

_LONG_ROWS = 4096  # spatial sizes from here on broadcast as fast as a spelled-out image


def per_channel(ufunc: np.ufunc, x: np.ndarray, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``ufunc(x, v)`` with ``v`` the C ``values`` along x's axis 1, broadcast over the rest."""
    n, c = x.shape[0], x.shape[1]
    spatial = math.prod(x.shape[2:])
    v = values.reshape(-1)
    if (n < 2 or spatial >= _LONG_ROWS or v.size != c or v.dtype != x.dtype or not x.flags.c_contiguous
            or (out is not None and not out.flags.c_contiguous)):
        return ufunc(x, v.reshape((1, c) + (1,) * (x.ndim - 2)), out=out)
    image = np.empty((c, spatial), dtype=x.dtype)
    image[...] = v[:, None]
    flat_out = None if out is None else out.reshape(n, c * spatial)
    return ufunc(x.reshape(n, c * spatial), image.reshape(1, c * spatial), out=flat_out).reshape(x.shape)


# ---------------------------------------------------------------- channels last: (rows, C)
#
# The channels-last training graph (runtime/fusion/layout.py) holds an (N, H, W, C) tensor as
# (N*H*W, C) rows. Its per-channel sums are then one gemv down the rows (a ones vector times
# the matrix), and its per-channel products whole-array broadcasts along the rows; the
# (N, C, rest) kernels' einsum over a trailing axis of length 1 ran 10x slower on them.


_ROW_BLOCK = 4096  # elements a per-channel operand is spelled out to: numpy's inner loops run this long


def _column_sums(rows: np.ndarray) -> np.ndarray:
    return np.ones(rows.shape[0], dtype=rows.dtype) @ rows


NUMPY_BUFFER = np.getbufsize()  # numpy's default ufunc buffer, in elements


class unbuffered_runs:
    """A block in which numpy's ufuncs read inner runs of at least ``run`` elements in place, without
    copying them through its buffer: ``with unbuffered_runs(run): ...``.

    numpy's iterator copies a broadcast operation whose inner run is shorter than its buffer (8192
    elements by default) through that buffer; with the buffer no longer than the run it reads the
    operands in place. A (rows, C) multiply by C values spelled out over 4096-element rows
    (``along_rows``) took 7.0 us against 4.7 with a 256-element buffer, a whole-array multiply 3.2
    (32768 float32, AMD EPYC Zen 4, one thread). Elementwise ufuncs run the same loops on the same
    elements: the same bits (a reduction's pairwise blocks could follow the buffer: none runs in one).
    The buffer size belongs to numpy's errstate context (per thread), restored on leaving."""

    __slots__ = ("size", "old")

    def __init__(self, run: int):
        self.size = min(NUMPY_BUFFER, max(16, run // 16 * 16))  # numpy takes multiples of 16

    def __enter__(self) -> None:
        self.old = np.setbufsize(self.size)

    def __exit__(self, *exc) -> None:
        np.setbufsize(self.old)


# the run the kernels below leave unbuffered: ``along_rows``'s spelled-out rows are up to _ROW_BLOCK
# long, most at least half of it (measured on the benchmark CNNs' BatchNormalizations at batch 8 and
# 32: 0.73-0.89x the time of the forward, 0.78-0.90x of the gradient)
_SPELLED_RUN = _ROW_BLOCK // 2


def _spelled_runs_unbuffered(kernel):
    """``kernel`` run in ``unbuffered_runs(_SPELLED_RUN)``: its ``along_rows`` calls read in place."""
    @functools.wraps(kernel)
    def run(*args):
        with unbuffered_runs(_SPELLED_RUN):
            return kernel(*args)
    return run


@functools.lru_cache(maxsize=512)
def _rows_per_block(r: int, c: int) -> int:
    """A divisor k of the ``r`` rows with k * ``c`` up to ``_ROW_BLOCK``: the rows are images x pixels,
    mostly with powers of two in them. Cached: a plan asks for the same few shapes every step."""
    most = max(1, _ROW_BLOCK // max(c, 1))
    return max(math.gcd(r, most), math.gcd(r, 1 << (most.bit_length() - 1)))


def along_rows(ufunc: np.ufunc, x: np.ndarray, values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``ufunc(x, values)`` for contiguous (rows, C) ``x`` and C ``values``. Broadcast one row at a
    time, numpy's inner loop is C long (a subtraction over 16 channels ran 4x slower than a whole
    multiply); here the values are spelled out over k rows and x read as (rows / k, k * C): the
    same operation on the same operands, element by element, so the same bits. The values are
    spelled out by one broadcast assignment into a fresh (k, C) block (np.tile took 3 us a call,
    the assignment 1-2, AMD EPYC Zen 4): the plans call this a few hundred times a step."""
    r, c = x.shape
    k = _rows_per_block(r, c)
    if k == 1 or not x.flags.c_contiguous or (out is not None and not out.flags.c_contiguous):
        return ufunc(x, values, out=out)
    spelled = np.empty((k, c), dtype=x.dtype)
    spelled[...] = values  # values of another dtype cast as astype casts them
    wide = (r // k, k * c)
    result = ufunc(x.reshape(wide), spelled.reshape(-1), out=None if out is None else out.reshape(wide))
    return result.reshape(r, c)


@_spelled_runs_unbuffered
def batch_norm_rows(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, mean: np.ndarray, var: np.ndarray,
                    epsilon: float, momentum: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training-mode BatchNormalization of (rows, C) float rows: (Y, running mean, running var),
    the statistics as the ONNX operator defines them (population variance of the batch)."""
    count = x.dtype.type(1 / max(x.shape[0], 1))
    batch_mean = _column_sums(x) * count
    d = along_rows(np.subtract, x, batch_mean)
    square = np.multiply(d, d)
    batch_var = _column_sums(square) * count
    inv_std = np.reciprocal(np.sqrt(batch_var + x.dtype.type(epsilon)))
    y = along_rows(np.multiply, d, inv_std * scale.astype(x.dtype, copy=False), out=d)
    along_rows(np.add, y, bias, out=y)
    stat = mean.dtype
    m, one_minus = stat.type(momentum), stat.type(1.0 - momentum)
    return (y, mean * m + batch_mean.astype(stat, copy=False) * one_minus,
            var * m + batch_var.astype(stat, copy=False) * one_minus)


@_spelled_runs_unbuffered
def batch_norm_inference_rows(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, mean: np.ndarray, var: np.ndarray,
                              epsilon: float) -> np.ndarray:
    """Inference-mode BatchNormalization of (rows, C) float rows, the affine folded as the
    channels-first kernel folds it (kernels/nn.py): the same operations on the same operands."""
    ct = x.dtype
    a = scale.astype(ct, copy=False).ravel() / np.sqrt(var.astype(ct, copy=False).ravel() + ct.type(epsilon))
    y = along_rows(np.multiply, x, a)
    return along_rows(np.add, y, bias.astype(ct, copy=False).ravel() - mean.astype(ct, copy=False).ravel() * a, out=y)


@_spelled_runs_unbuffered
def batch_norm_grad_rows(x: np.ndarray, dy: np.ndarray, scale: np.ndarray, count, epsilon) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The training-mode BatchNormalization gradient (grad/rules/nn.py's rule, as the fused
    NormalizationTrainingGrad computes it) of (rows, C) rows: (dX, d scale, d bias). ``count``
    is 1 / rows, ``epsilon`` the forward's."""
    c = along_rows(np.subtract, x, _column_sums(x) * x.dtype.type(1 / max(x.shape[0], 1)))
    work = np.multiply(c, c)
    inv = np.reciprocal(np.sqrt(np.add(np.multiply(_column_sums(work), count), epsilon)))
    sum_dy = _column_sums(dy)
    dscale = np.multiply(_column_sums(np.multiply(dy, c, out=work)), inv)
    a = np.multiply(scale, inv)
    tilt = np.multiply(np.multiply(a, np.multiply(inv, dscale)), count)
    shift = np.multiply(np.multiply(a, sum_dy), count)
    correction = along_rows(np.multiply, c, tilt, out=c)
    along_rows(np.add, correction, shift, out=correction)
    out = along_rows(np.multiply, dy, a, out=work)
    return np.subtract(out, correction, out=out), dscale, sum_dy
