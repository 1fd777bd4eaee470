"""Fast paths for elementwise kernels: numpy runs a few shapes of work far slower than the
arithmetic needs (ufuncs against a scalar, np.where on unpredictable masks). Shared by the
elementwise kernels and the fused ops (runtime/fusion/), each bit-identical to the plain form."""
from __future__ import annotations

import functools

import numpy as np

_RUN = 16384  # elements per row of ``with_scalar``'s constant
_SPELLED_OUT_MIN = 4096  # below this the scalar loop is as quick as the reshapes


def with_scalar(ufunc: np.ufunc, X: np.ndarray, c, out: np.ndarray | None = None) -> np.ndarray:
    """``ufunc(X, c)`` for a scalar ``c`` (bit-identical), for np.maximum and np.minimum.

    numpy vectorizes those two only over two contiguous arrays: against a scalar they run
    ~3x slower (150 vs 50 us for 401K float32). So c is spelled out as one contiguous row
    of ``_RUN`` elements that broadcasts over X cut into rows of that length."""
    n = X.size
    if n < _SPELLED_OUT_MIN or not X.flags.c_contiguous or (out is not None and not out.flags.c_contiguous):
        return ufunc(X, c, out=out)
    flat = X.reshape(-1)
    res = np.empty_like(flat) if out is None else out.reshape(-1)
    # keyed by the bits: -0.0 == 0.0 and NaN != NaN would make a key of the value itself hit
    # the wrong row or never hit
    row = _constant_row(X.dtype, np.asarray(c, dtype=X.dtype).tobytes())
    body = n - n % _RUN
    if body:
        ufunc(flat[:body].reshape(-1, _RUN), row, out=res[:body].reshape(-1, _RUN))
    ufunc(flat[body:], row[: n - body], out=res[body:])
    return res.reshape(X.shape)


@functools.lru_cache(maxsize=32)
def _constant_row(dtype: np.dtype, bits: bytes) -> np.ndarray:
    # filling 64 KiB on every call cost a fifth of a ReLU of 256x128
    row = np.full(_RUN, np.frombuffer(bits, dtype=dtype)[0], dtype=dtype)
    row.flags.writeable = False
    return row


BITS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


def _is_zero_scalar(bits: np.ndarray) -> bool:
    return bits.size == 1 and bits.item() == 0


def select_bits(condition: np.ndarray, X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """np.where(condition, X, Y) for X and Y of one fixed-width dtype, as bitwise arithmetic.

    np.where branches per element: on an unpredictable mask (a ReLU backward's) it runs
    ~3.6 ns/element, ten times a few branch-free integer passes. The select works on the
    raw bits (X ^ Y) & mask ^ Y with mask all-ones where the condition holds, so the
    result is bit-identical (NaN payloads, -0.0). A scalar zero branch (ReLU backward's
    Where(mask, dY, 0)) makes it one AND."""
    bits = BITS[X.dtype.itemsize]
    Xb, Yb = X.view(bits), Y.view(bits)
    out = np.empty(np.broadcast(condition, X, Y).shape, dtype=bits)
    ones = condition.view(np.int8)  # numpy bools are bytes 0/1
    if _is_zero_scalar(Yb):
        np.negative(ones, out=out, casting="unsafe")  # 0 / -1 (all bits set), widened on the fly
        np.bitwise_and(out, Xb, out=out)
    elif _is_zero_scalar(Xb):
        np.subtract(ones, np.int8(1), out=out, casting="unsafe")  # the mask of where Y is taken
        np.bitwise_and(out, Yb, out=out)
    else:
        np.bitwise_xor(Xb, Yb, out=out)
        np.bitwise_and(out, np.negative(ones), out=out)
        np.bitwise_xor(out, Yb, out=out)
    return out.view(X.dtype)
