"""QuantizeLinear and DequantizeLinear, as the ONNX spec defines them (opset 10 to 21):
per-tensor, per-axis (``axis``) and blocked (``block_size``, opset 21) scales; int8, uint8,
int16, uint16, int4 and uint4 (int32 too for DequantizeLinear). Rounding is half to even,
as the spec and onnxruntime round."""
from __future__ import annotations

import numpy as np
from onnx import helper

from odt_ops.errors import KernelError
from odt_ops.kernels.registry import kernel


def integer_range(dtype: np.dtype) -> tuple[int, int]:
    info = np.iinfo(dtype) if dtype.kind in "iu" else None
    if info is not None:
        return int(info.min), int(info.max)
    name = dtype.name  # ml_dtypes' int4 / uint4
    return {"int4": (-8, 7), "uint4": (0, 15)}.get(name, (None, None))


def broadcast_param(param: np.ndarray, x_shape: tuple[int, ...], axis: int, block_size: int, what: str) -> np.ndarray:
    """A scale or zero point shaped to broadcast against x: a scalar, one value per channel
    along ``axis``, or (``block_size`` > 0) one value per block of ``axis`` repeated."""
    param = np.asarray(param)
    if param.ndim == 0 or param.size == 1 and block_size == 0:
        return param.reshape(())
    axis = axis + len(x_shape) if axis < 0 else axis
    if block_size > 0:
        if param.ndim != len(x_shape):
            raise KernelError(f"blocked {what} must have x's rank {len(x_shape)}, got shape {list(param.shape)}")
        return np.repeat(param, block_size, axis=axis).take(range(x_shape[axis]), axis=axis)
    if param.ndim != 1 or param.shape[0] != x_shape[axis]:
        raise KernelError(f"per-axis {what} must have {x_shape[axis]} values (x's axis {axis}), got shape {list(param.shape)}")
    shape = [1] * len(x_shape)
    shape[axis] = param.shape[0]
    return param.reshape(shape)


def quantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, dtype: np.dtype, *, axis: int = 1,
             block_size: int = 0) -> np.ndarray:
    """saturate(round_half_even(x / scale) + zero_point) as ``dtype``."""
    s = broadcast_param(scale, x.shape, axis, block_size, "y_scale")
    zp = 0 if zero_point is None else broadcast_param(zero_point, x.shape, axis, block_size, "y_zero_point").astype(np.float32)
    lo, hi = integer_range(np.dtype(dtype))
    q = np.rint(np.asarray(x, np.float32) / s.astype(np.float32)) + zp
    return np.clip(q, lo, hi).astype(dtype)


def dequantize(x: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, *, axis: int = 1, block_size: int = 0) -> np.ndarray:
    """(x - zero_point) * scale, in the scale's dtype."""
    s = broadcast_param(scale, x.shape, axis, block_size, "x_scale")
    xf = np.asarray(x).astype(np.float32)
    if zero_point is not None:
        xf = xf - broadcast_param(zero_point, x.shape, axis, block_size, "x_zero_point").astype(np.float32)
    return (xf * s.astype(np.float32)).astype(s.dtype)


@kernel("QuantizeLinear", since=10)
def quantize_linear(x, y_scale, y_zero_point=None, *, axis=1, block_size=0, output_dtype=0, saturate=1):
    if y_zero_point is not None:
        dtype = y_zero_point.dtype
    elif output_dtype:
        dtype = helper.tensor_dtype_to_np_dtype(output_dtype)
    else:
        dtype = np.dtype(np.uint8)
    if integer_range(np.dtype(dtype))[0] is None:
        raise KernelError(f"QuantizeLinear to {np.dtype(dtype)} is not supported; odt_ops quantizes to int8, uint8, int16, uint16, int4, uint4")
    return (quantize(x, y_scale, y_zero_point, dtype, axis=axis, block_size=block_size),)


@kernel("DequantizeLinear", since=10)
def dequantize_linear(x, x_scale, x_zero_point=None, *, axis=1, block_size=0):
    return (dequantize(x, x_scale, x_zero_point, axis=axis, block_size=block_size),)
