"""DequantizeLinear's gradient with respect to its scale (LSQ learns scales through it).

Y = (X - zero_point) * scale, so dscale = sum of dY * (X - zero_point) over every axis the
scale is broadcast along (all of them for a per-tensor scale, all but ``axis`` per-axis). X
and the zero point are integers: no gradient flows to them (the straight-through estimator
beside each Quantize/DequantizeLinear pair carries x's, odt_ops/quant/qat.py).
"""
from __future__ import annotations

import onnx

from odt_ops.grad.registry import gradient


@gradient("DequantizeLinear")
def dequantize_linear_grad(ctx, dY):
    """dscale = ReduceSum(dY * (X - zero_point)) over the axes the scale broadcasts along"""
    if not ctx.needs(1):
        return ()
    b = ctx.b
    x, scale, zero_point = ctx.inputs[:3]
    if ctx.attrs.get("block_size", 0):
        raise ctx.fail("a blocked scale (block_size) is not learned; keep it fixed (qat=True, not 'lsq')")
    rank = ctx.rank(x)
    elem = onnx.helper.np_dtype_to_tensor_dtype(ctx.dtype(dY))
    centered = b.Cast(x, to=elem)
    scale_shape = ctx.shape(scale)
    per_axis = scale_shape is not None and len(scale_shape) == 1 and scale_shape[0] != 1
    axis = ctx.attrs.get("axis", 1) % rank if rank else 0
    placed = [1] * rank
    if per_axis:
        placed[axis] = -1
    if zero_point:
        zp = b.Cast(zero_point, to=elem)
        centered = b.Sub(centered, b.Reshape(zp, ctx.ints(placed)) if per_axis else zp)
    product = b.Mul(dY, centered)
    axes = [i for i in range(rank) if not (per_axis and i == axis)]
    if not axes:
        return (None, product)
    total = b.ReduceSum(product, ctx.ints(axes), keepdims=0)
    if scale_shape is not None and not per_axis and len(scale_shape) == 1:  # a [1] scale
        total = b.Reshape(total, ctx.ints([1]))
    return (None, total)


__all__ = ["dequantize_linear_grad"]
