"""Cast and CastLike: every TensorProto type numpy or ml_dtypes holds, float8 saturation,
float8e8m0 rounding modes and numeric strings, as the spec's tables say."""
from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import onnx

from odt_ops.kernels.registry import kernel

_DTYPES: dict[int, np.dtype] = {}
for _code in onnx.TensorProto.DataType.values():
    with contextlib.suppress(KeyError, ValueError, TypeError):  # UNDEFINED has no numpy dtype
        _DTYPES[_code] = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(_code))

_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
# the float8 types `saturate` applies to (clamping to +-max instead of inf/NaN)
_SATURATING = {np.dtype(t): float(ml_dtypes.finfo(t).max) for t in (
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz)}
_ROUND_MODES = ("up", "down", "nearest")


def _to_e8m0(x: np.ndarray, saturate: int, round_mode: str) -> np.ndarray:
    """Powers of two as float8e8m0 (biased exponent, code 255 is NaN); the sign is ignored."""
    a = np.abs(np.asarray(x, dtype=np.float64))  # float64 holds every narrower float as a normal number
    mant, e = np.frexp(a)  # a = mant * 2**e with mant in [0.5, 1)
    if round_mode == "up":  # away from zero: any fraction bumps the exponent
        bump = mant > 0.5
    elif round_mode == "nearest":  # the midpoint between 2**k and 2**(k+1) is 1.5 * 2**k
        bump = mant >= 0.75
    else:
        bump = False
    code = e.astype(np.int64) + 126 + bump
    overflow = (code > 254) | np.isinf(a)
    underflow = (code < 0) | (a == 0)
    code = np.where(overflow, 254 if saturate else 255, code)
    code = np.where(underflow, 0 if saturate else 255, code)
    code[np.isnan(a)] = 255
    return code.astype(np.uint8).view(_E8M0)


def _from_strings(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Parse numeric strings; "INF", "-INF", "NaN" in any case, as Python's float() does."""
    if dtype.kind in "iu":
        try:  # integer literals exactly, beyond float64's 53 bits
            return x.astype(dtype)
        except (ValueError, OverflowError):
            pass
    return x.astype(np.float64)


def _convert(x: np.ndarray, dtype: np.dtype, saturate: int, round_mode: str) -> np.ndarray:
    if round_mode not in _ROUND_MODES:
        raise ValueError(f"round_mode must be one of {_ROUND_MODES}, got {round_mode!r}")
    if dtype == object:
        return x.astype(np.str_).astype(object)  # shortest round-trip form, e.g. "314.15926"
    if x.dtype.kind in "OU":
        x = _from_strings(x, dtype)
    if dtype == _E8M0:
        return _to_e8m0(x, saturate, round_mode)
    if saturate and dtype in _SATURATING:
        m = _SATURATING[dtype]
        x = np.clip(x, -m, m)  # NaN passes through
    return x.astype(dtype, copy=False)


def _target(to: int) -> np.dtype:
    if to not in _DTYPES:
        raise ValueError(f"Cast: 'to'={to} is not a TensorProto data type")
    return _DTYPES[to]


@kernel("Cast", since=6)
def cast_6(input, *, to):
    return (_convert(input, _target(to), 1, "up"),)


@kernel("Cast", since=19)
def cast_19(input, *, to, saturate=1):
    return (_convert(input, _target(to), saturate, "up"),)


@kernel("Cast", since=24)
def cast(input, *, to, saturate=1, round_mode="up"):
    return (_convert(input, _target(to), saturate, round_mode),)


@kernel("CastLike", since=15)
def cast_like_15(input, target_type):
    return (_convert(input, target_type.dtype, 1, "up"),)


@kernel("CastLike", since=19)
def cast_like_19(input, target_type, *, saturate=1):
    return (_convert(input, target_type.dtype, saturate, "up"),)


@kernel("CastLike", since=24)
def cast_like(input, target_type, *, saturate=1, round_mode="up"):
    return (_convert(input, target_type.dtype, saturate, round_mode),)
