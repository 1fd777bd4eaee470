"""Gradient rule: Erf."""
from __future__ import annotations

import math

from odt_ops.grad.registry import gradient


@gradient("Erf")
def erf_grad(ctx, dY):
    """dX = dY * 2/sqrt(pi) * exp(-X^2)"""
    b, X = ctx.b, ctx.inputs[0]
    return (b.Mul(dY, b.Mul(b.Exp(b.Neg(b.Mul(X, X))), ctx.const(2 / math.sqrt(math.pi), like=X))),)
