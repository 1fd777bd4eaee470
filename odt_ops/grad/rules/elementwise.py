"""Gradient rules: elementwise arithmetic, activations, trigonometry, selection, casts.

Rules reuse the forward output Y wherever the derivative is a function of it
(Exp, Sigmoid, Tanh, Relu's mask, ...) instead of recomputing from X.
"""
from __future__ import annotations

import math

import numpy as np

from odt_ops.grad.registry import gradient
from odt_ops.grad.rules.cast import onnx_type

# ----- arithmetic (numpy broadcasting: the walker unbroadcasts) -----


@gradient("Add", broadcasting=True)
def add_grad(ctx, dY):
    """dA = dY, dB = dY"""
    return dY, dY


@gradient("Sub", broadcasting=True)
def sub_grad(ctx, dY):
    """dA = dY, dB = -dY"""
    return dY, ctx.b.Neg(dY) if ctx.needs(1) else None


@gradient("Mul", broadcasting=True)
def mul_grad(ctx, dY):
    """dA = dY * B, dB = dY * A"""
    A, B = ctx.inputs[:2]
    return (ctx.b.Mul(dY, B) if ctx.needs(0) else None, ctx.b.Mul(dY, A) if ctx.needs(1) else None)


@gradient("Div", broadcasting=True)
def div_grad(ctx, dY):
    """dA = dY / B, dB = -dA * Y"""
    b, (_a, B), (Y,) = ctx.b, ctx.inputs[:2], ctx.outputs
    dA = b.Div(dY, B)
    return dA, b.Neg(b.Mul(dA, Y)) if ctx.needs(1) else None


@gradient("Mod", broadcasting=True)
def mod_grad(ctx, dY):
    """Y = A - q * B with q = trunc(A / B) (fmod=1) or floor(A / B) (fmod=0): dA = dY, dB = -dY * q"""
    b, (A, B) = ctx.b, ctx.inputs[:2]
    dB = None
    if ctx.needs(1):
        quotient = b.Div(A, B)
        whole = b.Floor(quotient)
        if ctx.attrs["fmod"]:
            whole = b.Where(b.Less(quotient, ctx.const(0, like=A)), b.Ceil(quotient), whole)
        dB = b.Neg(b.Mul(dY, whole))
    return (dY if ctx.needs(0) else None, dB)


@gradient("Pow", broadcasting=True)
def pow_grad(ctx, dY):
    """dA = dY * B * A^(B-1), dB = dY * Y * log(A) (0 where A <= 0)"""
    b, (A, B), (Y,) = ctx.b, ctx.inputs[:2], ctx.outputs
    dA = dB = None
    if ctx.needs(0):
        exponent = ctx.value(B)
        if exponent is not None and exponent.size == 1:
            e = float(exponent.reshape(()))
            power = A if e == 2 else b.Pow(A, ctx.const(e - 1, like=A))
            dA = b.Mul(dY, b.Mul(power, ctx.const(e, like=A)))
        else:
            Bx = B if ctx.dtype(B) == ctx.dtype(A) else b.Cast(B, to=onnx_type(ctx.dtype(A)))
            dA = b.Mul(dY, b.Mul(Bx, b.Pow(A, b.Sub(Bx, ctx.const(1, like=A)))))
    if ctx.needs(1):
        zero = ctx.const(0, like=A)
        log_a = b.Where(b.Greater(A, zero), b.Log(b.Max(A, ctx.const(np.finfo(ctx.dtype(A)).tiny, like=A))), zero)
        dB = b.Mul(b.Mul(dY, Y), log_a)
        if ctx.dtype(B) != ctx.dtype(A):
            dB = b.Cast(dB, to=onnx_type(ctx.dtype(B)))
    return dA, dB


@gradient("Neg")
def neg_grad(ctx, dY):
    """dX = -dY"""
    return (ctx.b.Neg(dY),)


@gradient("Abs")
def abs_grad(ctx, dY):
    """dX = dY * sign(X)"""
    return (ctx.b.Mul(dY, ctx.b.Sign(ctx.inputs[0])),)


@gradient("Reciprocal")
def reciprocal_grad(ctx, dY):
    """dX = -dY * Y^2"""
    (Y,) = ctx.outputs
    return (ctx.b.Neg(ctx.b.Mul(dY, ctx.b.Mul(Y, Y))),)


@gradient("Sqrt")
def sqrt_grad(ctx, dY):
    """dX = dY * 0.5 / Y"""
    (Y,) = ctx.outputs
    return (ctx.b.Div(ctx.b.Mul(dY, ctx.const(0.5, like=Y)), Y),)


@gradient("Exp")
def exp_grad(ctx, dY):
    """dX = dY * Y"""
    return (ctx.b.Mul(dY, ctx.outputs[0]),)


@gradient("Log")
def log_grad(ctx, dY):
    """dX = dY / X"""
    return (ctx.b.Div(dY, ctx.inputs[0]),)


@gradient("Sum", broadcasting=True)
def sum_grad(ctx, dY):
    """dX_i = dY"""
    return (dY,) * len(ctx.node.input)


@gradient("Mean", broadcasting=True)
def mean_grad(ctx, dY):
    """dX_i = dY / n"""
    n = len(ctx.node.input)
    return (ctx.b.Mul(dY, ctx.const(1.0 / n, like=ctx.inputs[0])) if n > 1 else dY,) * n


def _extremum_grad(ctx, dY):
    """dX_i = dY where X_i == Y (every tied input gets the full gradient)"""
    b, (Y,) = ctx.b, ctx.outputs
    if len(ctx.node.input) == 1:
        return (dY,)
    zero = ctx.const(0, like=Y)
    return tuple(b.Where(b.Equal(X, Y), dY, zero) if ctx.needs(i) else None for i, X in enumerate(ctx.node.input))


gradient("Max", broadcasting=True)(_extremum_grad)
gradient("Min", broadcasting=True)(_extremum_grad)


# ----- activations -----


@gradient("Relu")
def relu_grad(ctx, dY):
    """dX = dY where Y > 0"""
    (Y,) = ctx.outputs
    zero = ctx.const(0, like=Y)
    return (ctx.b.Where(ctx.b.Greater(Y, zero), dY, zero),)


@gradient("LeakyRelu")
def leaky_relu_grad(ctx, dY):
    """dX = dY where X >= 0, alpha * dY elsewhere"""
    b, X = ctx.b, ctx.inputs[0]
    return (b.Where(b.Less(X, ctx.const(0, like=X)), b.Mul(dY, ctx.const(ctx.attrs["alpha"], like=X)), dY),)


@gradient("PRelu", broadcasting=True)
def prelu_grad(ctx, dY):
    """dX = dY where X >= 0, slope * dY elsewhere; dslope = dY * X where X < 0"""
    b, (X, slope) = ctx.b, ctx.inputs[:2]
    zero = ctx.const(0, like=X)
    negative = b.Less(X, zero)
    dX = b.Where(negative, b.Mul(dY, slope), dY) if ctx.needs(0) else None
    dslope = b.Where(negative, b.Mul(dY, X), zero) if ctx.needs(1) else None
    return dX, dslope


@gradient("ThresholdedRelu")
def thresholded_relu_grad(ctx, dY):
    """dX = dY where X > alpha"""
    X = ctx.inputs[0]
    return (ctx.b.Where(ctx.b.Greater(X, ctx.const(ctx.attrs["alpha"], like=X)), dY, ctx.const(0, like=X)),)


@gradient("Elu")
def elu_grad(ctx, dY):
    """dX = dY where X >= 0, dY * (Y + alpha) elsewhere"""
    b, X, (Y,) = ctx.b, ctx.inputs[0], ctx.outputs
    slope = b.Add(Y, ctx.const(ctx.attrs["alpha"], like=X))
    return (b.Where(b.Less(X, ctx.const(0, like=X)), b.Mul(dY, slope), dY),)


@gradient("Celu")
def celu_grad(ctx, dY):
    """dX = dY where X > 0, dY * (Y / alpha + 1) elsewhere"""
    b, X, (Y,) = ctx.b, ctx.inputs[0], ctx.outputs
    slope = b.Add(b.Mul(Y, ctx.const(1.0 / ctx.attrs["alpha"], like=X)), ctx.const(1, like=X))
    return (b.Where(b.Greater(X, ctx.const(0, like=X)), dY, b.Mul(dY, slope)),)


@gradient("Selu")
def selu_grad(ctx, dY):
    """dX = gamma * dY where X > 0, dY * (Y + gamma * alpha) elsewhere"""
    b, X, (Y,) = ctx.b, ctx.inputs[0], ctx.outputs
    gamma, alpha = ctx.attrs["gamma"], ctx.attrs["alpha"]
    negative = b.Mul(dY, b.Add(Y, ctx.const(gamma * alpha, like=X)))
    return (b.Where(b.Greater(X, ctx.const(0, like=X)), b.Mul(dY, ctx.const(gamma, like=X)), negative),)


@gradient("Shrink")
def shrink_grad(ctx, dY):
    """dX = dY where |X| > lambd"""
    b, X = ctx.b, ctx.inputs[0]
    lambd = ctx.attrs["lambd"]
    outside = b.Or(b.Less(X, ctx.const(-lambd, like=X)), b.Greater(X, ctx.const(lambd, like=X)))
    return (b.Where(outside, dY, ctx.const(0, like=X)),)


@gradient("Sigmoid")
def sigmoid_grad(ctx, dY):
    """dX = dY * Y * (1 - Y)"""
    b, (Y,) = ctx.b, ctx.outputs
    return (b.Mul(dY, b.Mul(Y, b.Sub(ctx.const(1, like=Y), Y))),)


@gradient("HardSigmoid")
def hard_sigmoid_grad(ctx, dY):
    """dX = alpha * dY where 0 < Y < 1"""
    b, (Y,) = ctx.b, ctx.outputs
    inside = b.And(b.Greater(Y, ctx.const(0, like=Y)), b.Less(Y, ctx.const(1, like=Y)))
    return (b.Where(inside, b.Mul(dY, ctx.const(ctx.attrs["alpha"], like=Y)), ctx.const(0, like=Y)),)


@gradient("HardSwish")
def hard_swish_grad(ctx, dY):
    """dX = dY * (0 if X < -3, 1 if X > 3, X / 3 + 1/2 between)"""
    b, X = ctx.b, ctx.inputs[0]
    middle = b.Add(b.Mul(X, ctx.const(1 / 3, like=X)), ctx.const(0.5, like=X))
    upper = b.Where(b.Greater(X, ctx.const(3, like=X)), ctx.const(1, like=X), middle)
    slope = b.Where(b.Less(X, ctx.const(-3, like=X)), ctx.const(0, like=X), upper)
    return (b.Mul(dY, slope),)


@gradient("Tanh")
def tanh_grad(ctx, dY):
    """dX = dY * (1 - Y^2)"""
    b, (Y,) = ctx.b, ctx.outputs
    return (b.Mul(dY, b.Sub(ctx.const(1, like=Y), b.Mul(Y, Y))),)


@gradient("Softplus")
def softplus_grad(ctx, dY):
    """dX = dY * sigmoid(X)"""
    return (ctx.b.Mul(dY, ctx.b.Sigmoid(ctx.inputs[0])),)


@gradient("Softsign")
def softsign_grad(ctx, dY):
    """dX = dY / (1 + |X|)^2"""
    b, X = ctx.b, ctx.inputs[0]
    d = b.Add(b.Abs(X), ctx.const(1, like=X))
    return (b.Div(dY, b.Mul(d, d)),)


@gradient("Gelu")
def gelu_grad(ctx, dY):
    """exact: dX = dY * (Phi(X) + X * phi(X));
    tanh: dX = dY * (0.5 (1 + t) + 0.5 X (1 - t^2) k (1 + 3c X^2)), t = tanh(k (X + c X^3))"""
    b, X = ctx.b, ctx.inputs[0]
    c = lambda v: ctx.const(v, like=X)
    x2 = b.Mul(X, X)
    if ctx.attrs["approximate"] == "tanh":
        k, a = math.sqrt(2 / math.pi), 0.044715
        t = b.Tanh(b.Mul(b.Mul(X, b.Add(b.Mul(x2, c(a)), c(1))), c(k)))
        left = b.Mul(b.Add(t, c(1)), c(0.5))
        right = b.Mul(b.Mul(X, b.Sub(c(1), b.Mul(t, t))), b.Add(b.Mul(x2, c(1.5 * a * k)), c(0.5 * k)))
        return (b.Mul(dY, b.Add(left, right)),)
    cdf = b.Mul(b.Add(b.Erf(b.Mul(X, c(1 / math.sqrt(2)))), c(1)), c(0.5))
    pdf = b.Mul(b.Exp(b.Mul(x2, c(-0.5))), c(1 / math.sqrt(2 * math.pi)))
    return (b.Mul(dY, b.Add(cdf, b.Mul(X, pdf))),)


@gradient("Mish")
def mish_grad(ctx, dY):
    """dX = dY * (t + X * sigmoid(X) * (1 - t^2)), t = tanh(softplus(X))"""
    b, X = ctx.b, ctx.inputs[0]
    t = b.Tanh(b.Softplus(X))
    slope = b.Add(t, b.Mul(b.Mul(X, b.Sigmoid(X)), b.Sub(ctx.const(1, like=X), b.Mul(t, t))))
    return (b.Mul(dY, slope),)


# ----- trigonometry -----


@gradient("Sin")
def sin_grad(ctx, dY):
    """dX = dY * cos(X)"""
    return (ctx.b.Mul(dY, ctx.b.Cos(ctx.inputs[0])),)


@gradient("Cos")
def cos_grad(ctx, dY):
    """dX = -dY * sin(X)"""
    return (ctx.b.Neg(ctx.b.Mul(dY, ctx.b.Sin(ctx.inputs[0]))),)


@gradient("Tan")
def tan_grad(ctx, dY):
    """dX = dY * (1 + Y^2)"""
    b, (Y,) = ctx.b, ctx.outputs
    return (b.Mul(dY, b.Add(b.Mul(Y, Y), ctx.const(1, like=Y))),)


@gradient("Sinh")
def sinh_grad(ctx, dY):
    """dX = dY * cosh(X)"""
    return (ctx.b.Mul(dY, ctx.b.Cosh(ctx.inputs[0])),)


@gradient("Cosh")
def cosh_grad(ctx, dY):
    """dX = dY * sinh(X)"""
    return (ctx.b.Mul(dY, ctx.b.Sinh(ctx.inputs[0])),)


def _over_sqrt(ctx, dY, sign_x2: float, constant: float, negate: bool = False):
    """dY / sqrt(sign_x2 * X^2 + constant), negated if asked"""
    b, X = ctx.b, ctx.inputs[0]
    x2 = b.Mul(X, X)
    radicand = b.Add(b.Mul(x2, ctx.const(sign_x2, like=X)) if sign_x2 != 1 else x2, ctx.const(constant, like=X))
    dX = b.Div(dY, b.Sqrt(radicand))
    return (b.Neg(dX) if negate else dX,)


@gradient("Asin")
def asin_grad(ctx, dY):
    """dX = dY / sqrt(1 - X^2)"""
    return _over_sqrt(ctx, dY, -1, 1)


@gradient("Acos")
def acos_grad(ctx, dY):
    """dX = -dY / sqrt(1 - X^2)"""
    return _over_sqrt(ctx, dY, -1, 1, negate=True)


@gradient("Asinh")
def asinh_grad(ctx, dY):
    """dX = dY / sqrt(X^2 + 1)"""
    return _over_sqrt(ctx, dY, 1, 1)


@gradient("Acosh")
def acosh_grad(ctx, dY):
    """dX = dY / sqrt(X^2 - 1)"""
    return _over_sqrt(ctx, dY, 1, -1)


@gradient("Atan")
def atan_grad(ctx, dY):
    """dX = dY / (1 + X^2)"""
    b, X = ctx.b, ctx.inputs[0]
    return (b.Div(dY, b.Add(b.Mul(X, X), ctx.const(1, like=X))),)


@gradient("Atanh")
def atanh_grad(ctx, dY):
    """dX = dY / (1 - X^2)"""
    b, X = ctx.b, ctx.inputs[0]
    return (b.Div(dY, b.Sub(ctx.const(1, like=X), b.Mul(X, X))),)


# ----- selection, casts, identity -----


@gradient("Clip")
def clip_grad(ctx, dY):
    """dX = dY where min <= X <= max (min and max get no gradient)"""
    b, (X, lo, hi) = ctx.b, ctx.inputs[:3]
    masks = [b.GreaterOrEqual(X, lo)] if lo else []
    masks += [b.LessOrEqual(X, hi)] if hi else []
    if not masks:
        return (dY,)
    mask = masks[0] if len(masks) == 1 else b.And(*masks)
    return (b.Where(mask, dY, ctx.const(0, like=X)),)


@gradient("Where", broadcasting=True)
def where_grad(ctx, dY):
    """dX = dY where condition, dY' = dY elsewhere"""
    b, (C, X, _y) = ctx.b, ctx.inputs[:3]
    zero = ctx.const(0, like=X)
    return (None, b.Where(C, dY, zero) if ctx.needs(1) else None, b.Where(C, zero, dY) if ctx.needs(2) else None)


def _zero_grad(ctx, *grads):
    """dX = 0 (piecewise constant)"""
    return ()


for _op in ("Floor", "Ceil", "Round", "Sign"):
    gradient(_op)(_zero_grad)
