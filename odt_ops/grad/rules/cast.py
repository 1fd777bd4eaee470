"""Gradient rules: Cast and CastLike (a float-to-float cast passes the gradient back in the input's
type; the walker stops at integer inputs)."""
from __future__ import annotations

import numpy as np
from onnx import helper

from odt_ops.grad.registry import gradient


@gradient("Cast")
def cast_grad(ctx, dY):
    """dX = cast(dY, X's type)"""
    return (ctx.b.Cast(dY, to=onnx_type(ctx.dtype(ctx.inputs[0]))),)


@gradient("CastLike")
def cast_like_grad(ctx, dY):
    """dX = cast(dY, X's type)"""
    return (ctx.b.CastLike(dY, ctx.inputs[0]), None)


def onnx_type(dtype: np.dtype) -> int:
    """The TensorProto type of a numpy dtype (the `to` of a Cast back to it)."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
