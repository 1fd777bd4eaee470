"""Kernels: elementwise math, activations, comparisons and logic (Erf and Cast have their own modules).

Scalars (attributes, constants) enter arithmetic as ``X.dtype.type(v)`` so a float32
tensor stays float32: numpy would promote it through an np.float64 scalar.
Temporaries a kernel created itself are updated in place (``y *= a``) to spare
allocations; inputs never are.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from odt_ops.kernels._fast import BITS, select_bits, with_scalar
from odt_ops.kernels.erf import erf_values
from odt_ops.kernels.parallel import elementwise
from odt_ops.kernels.registry import kernel


def _s(X: np.ndarray, v: float):
    """``v`` as a scalar of X's dtype."""
    return X.dtype.type(v)


def _fresh(v) -> np.ndarray:
    """A ufunc result as an array (0-d inputs give numpy scalars, which ``out=`` refuses)."""
    return v if isinstance(v, np.ndarray) else np.asarray(v)


def _half_in_float32(fn):
    """Run a float kernel in float32 for float16/bfloat16 input and round once at the end.

    Numpy's half arithmetic rounds every step, and the float32 attributes, to 11 or 8 bits
    (and converts to float32 inside each ufunc anyway, so one conversion is also faster).
    """

    @functools.wraps(fn)
    def run(X, *args, **kwargs):
        if X.dtype.itemsize != 2 or X.dtype.kind not in "fV":
            return fn(X, *args, **kwargs)
        return tuple(y.astype(X.dtype) for y in fn(X.astype(np.float32), *args, **kwargs))

    return run


# ---------------------------------------------------------------------------- arithmetic


@kernel("Add", since=7)
def add(A, B):
    return (np.add(A, B),)


@kernel("Sub", since=7)
def sub(A, B):
    return (np.subtract(A, B),)


@kernel("Mul", since=7)
def mul(A, B):
    return (np.multiply(A, B),)


def _trunc_divide(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Integer division rounding toward zero, as C does (numpy's // floors)."""
    q = np.floor_divide(A, B)
    if A.dtype.kind == "u":
        return q
    # floor and truncation differ exactly where the quotient is negative and inexact
    q += (np.remainder(A, B) != 0) & ((A < 0) != (B < 0))
    return q


@kernel("Div", since=7)
def div(A, B):
    if A.dtype.kind in "iu":
        return (_trunc_divide(A, B),)
    return (np.divide(A, B),)


@kernel("Mod", since=10)
def mod(A, B, *, fmod=0):
    # fmod=1: C's fmod, the sign of the dividend; fmod=0: the sign of the divisor, as Python's %
    # (the spec asks fmod=1 of floats, yet its own tests and onnx.reference give floats % too)
    if fmod:
        return (np.fmod(A, B),)
    with np.errstate(divide="ignore"):  # x mod 0 is undefined; numpy gives 0 and a warning
        return (np.remainder(A, B),)


def _int_power(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Integer power; a negative exponent truncates 1/x**|y| toward zero, as C's cast of pow does."""
    if Y.dtype.kind == "u" or not (Y < 0).any():
        return np.power(X, Y.astype(X.dtype, copy=False))
    r = np.power(X, np.abs(Y).astype(X.dtype))  # ±1 keep their power, larger |x| vanish
    return np.where((Y < 0) & (X != 1) & (X != -1), X.dtype.type(0), r)


@kernel("Pow", since=7)
def pow_(X, Y):
    # the output has the base's type whatever the exponent's
    if X.dtype.kind in "iu" and Y.dtype.kind in "iu":
        return (_int_power(X, Y),)
    if X.dtype.kind == "f":
        if Y.size == 1 and Y.ndim <= X.ndim and Y.reshape(()) == 2:  # the common square: no pow
            return (np.square(X),)
        if Y.dtype.kind in "iu":  # keep the computation in X's precision, not float64
            Y = Y.astype(X.dtype)
    return (np.power(X, Y).astype(X.dtype, copy=False),)


@kernel("Neg", since=6)
def neg(X):
    return (np.negative(X),)


@kernel("Abs", since=6)
def abs_(X):
    return (np.abs(X),)


@kernel("Sign", since=9)
def sign(input):
    return (np.sign(input),)


@kernel("Reciprocal", since=6)
def reciprocal(X):
    return (np.reciprocal(X),)


@kernel("Sqrt", since=6)
def sqrt(X):
    return (np.sqrt(X),)


# the transcendental and composite activations: worth splitting across threads when large (kernels/parallel.py)
@kernel("Exp", since=6)
@elementwise
def exp(input):
    return (np.exp(input),)


@kernel("Log", since=6)
def log(input):
    return (np.log(input),)


@kernel("Sin", since=7)
def sin(input):
    return (np.sin(input),)


@kernel("Cos", since=7)
def cos(input):
    return (np.cos(input),)


@kernel("Atan", since=7)
def atan(input):
    return (np.arctan(input),)


@kernel("Tan", since=7)
def tan(input):
    return (np.tan(input),)


@kernel("Asin", since=7)
def asin(input):
    return (np.arcsin(input),)


@kernel("Acos", since=7)
def acos(input):
    return (np.arccos(input),)


@kernel("Sinh", since=9)
def sinh(input):
    return (np.sinh(input),)


@kernel("Cosh", since=9)
def cosh(input):
    return (np.cosh(input),)


@kernel("Asinh", since=9)
def asinh(input):
    return (np.arcsinh(input),)


@kernel("Acosh", since=9)
def acosh(input):
    return (np.arccosh(input),)


@kernel("Atanh", since=9)
def atanh(input):
    return (np.arctanh(input),)


@kernel("Tanh", since=6)
@elementwise
def tanh(input):
    return (np.tanh(input),)


@kernel("Floor", since=6)
def floor(X):
    return (np.floor(X),)


@kernel("Ceil", since=6)
def ceil(X):
    return (np.ceil(X),)


@kernel("Round", since=11)
def round_(X):
    return (np.round(X),)  # half to even, as the spec asks


# ---------------------------------------------------------------------------- activations


def _sigmoid(X: np.ndarray) -> np.ndarray:
    # 1 / (1 + exp(-x)) with -x capped where exp would overflow: five passes and one exp (the
    # overflow-free exp(min(x, 0)) / (1 + exp(-|x|)) took seven and two, and SiLU, LSTM gates and
    # their gradients run it everywhere). Results keep their relative accuracy down to the
    # smallest normal number; below (x < -87 in float32) they are that tiny or zero.
    t = _fresh(np.negative(X))
    with_scalar(np.minimum, t, _exp_cap(t.dtype), out=t)
    np.exp(t, out=t)
    t += _s(X, 1)
    np.reciprocal(t, out=t)
    return t


@functools.lru_cache(maxsize=8)
def _exp_cap(dtype: np.dtype):
    """The largest whole number whose exp is finite in ``dtype``, less one."""
    return dtype.type(math.floor(math.log(float(np.finfo(dtype).max))) - 1)


def _softplus(X: np.ndarray) -> np.ndarray:
    # max(x, 0) + log1p(exp(-|x|)): nothing overflows (np.logaddexp is exact too but far slower)
    t = _fresh(np.abs(X))
    np.negative(t, out=t)
    np.exp(t, out=t)
    np.log1p(t, out=t)
    t += with_scalar(np.maximum, X, _s(X, 0))
    return t


@kernel("Sigmoid", since=6)
@_half_in_float32
@elementwise
def sigmoid(X):
    return (_sigmoid(X),)


@kernel("Softplus", since=1)
@_half_in_float32
def softplus(X):
    return (_softplus(X),)


@kernel("Shrink", since=9)
def shrink(input, *, bias=0.0, lambd=0.5):
    X = input
    # compared and shifted as the float attributes are, then brought back to X's type
    # (integer inputs too: the spec allows every numeric type)
    shifted = np.where(-lambd > X, X + bias, np.where(lambd < X, X - bias, 0))
    return (shifted.astype(X.dtype, copy=False),)


@kernel("Softsign", since=1)
@_half_in_float32
def softsign(input):
    d = _fresh(np.abs(input))
    d += _s(input, 1)
    np.divide(input, d, out=d)
    return (d,)


@kernel("Mish", since=18)
@_half_in_float32
def mish(X):
    t = _fresh(_softplus(X))
    np.tanh(t, out=t)
    t *= X
    return (t,)


@kernel("Relu", since=6)
def relu(X):
    return (with_scalar(np.maximum, X, X.dtype.type(0)),)


def relu_in_place(X: np.ndarray) -> np.ndarray:
    """The Relu kernel's values written over X (an array its caller owns and no one else reads)."""
    return with_scalar(np.maximum, X, X.dtype.type(0), out=X)


@kernel("LeakyRelu", since=6)
@_half_in_float32
def leaky_relu(X, *, alpha=0.01):
    a = _s(X, alpha)
    # for alpha <= 1 the larger of x and alpha*x is the answer on both sides of 0
    pick = np.maximum if alpha <= 1 else np.minimum
    return (pick(X, X * a),)


@kernel("PRelu", since=6)
def prelu(X, slope):
    y = _fresh(with_scalar(np.minimum, X, _s(X, 0)))  # max(x, 0) + slope * min(x, 0): no np.where
    y *= slope
    y += with_scalar(np.maximum, X, _s(X, 0))
    return (y,)


@kernel("ThresholdedRelu", since=10)
@_half_in_float32
def thresholded_relu(X, *, alpha=1.0):
    return (np.where(_s(X, alpha) < X, X, _s(X, 0)),)


def _elu(X: np.ndarray, alpha: float, divisor: float = 1.0) -> np.ndarray:
    """max(x, 0) + alpha * (exp(min(x, 0) / divisor) - 1)."""
    # expm1 only of the non-positive part: exact near 0 and never overflowing
    neg = _fresh(with_scalar(np.minimum, X, _s(X, 0)))
    if divisor != 1.0:
        neg /= _s(X, divisor)
    np.expm1(neg, out=neg)
    neg *= _s(X, alpha)
    neg += with_scalar(np.maximum, X, _s(X, 0))
    return neg


@kernel("Elu", since=6)
@_half_in_float32
def elu(X, *, alpha=1.0):
    return (_elu(X, alpha),)


@kernel("Selu", since=6)
@_half_in_float32
def selu(X, *, alpha=1.6732631921768188, gamma=1.0507010221481323):
    y = _fresh(_elu(X, alpha))
    y *= _s(X, gamma)
    return (y,)


@kernel("Celu", since=12)
@_half_in_float32
def celu(X, *, alpha=1.0):
    if alpha == 0:
        raise ValueError("Celu: alpha must be nonzero")
    return (_elu(X, alpha, alpha),)  # max(0, x) + min(0, alpha * (exp(x / alpha) - 1))


def _hard_sigmoid(X: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    y = _fresh(X * _s(X, alpha))
    y += _s(X, beta)
    np.clip(y, _s(X, 0), _s(X, 1), out=y)
    return y


@kernel("HardSigmoid", since=6)
@_half_in_float32
@elementwise
def hard_sigmoid(X, *, alpha=0.2, beta=0.5):
    return (_hard_sigmoid(X, alpha, beta),)


@kernel("HardSwish", since=14)
@_half_in_float32
@elementwise
def hard_swish(X):
    y = _hard_sigmoid(X, 1 / 6, 0.5)
    y *= X
    return (y,)


_SQRT_HALF = math.sqrt(0.5)
_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


@kernel("Gelu", since=20)
@_half_in_float32
def gelu(X, *, approximate="none"):
    if approximate == "none":
        t = _fresh(erf_values(X * _s(X, _SQRT_HALF)))  # erf(x / sqrt 2)
    elif approximate == "tanh":
        t = _fresh(X * X)
        t *= _s(X, 0.044715)
        t += _s(X, 1)
        t *= X
        t *= _s(X, _SQRT_2_OVER_PI)
        np.tanh(t, out=t)  # tanh(sqrt(2/pi) * (x + 0.044715 x^3))
    else:
        raise ValueError(f"Gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    t += _s(X, 1)
    t *= X
    t *= _s(X, 0.5)
    return (t,)


def _clip(X: np.ndarray, lo, hi) -> np.ndarray:
    # min(max(x, lo), hi), so lo > hi gives hi everywhere as the spec says; not np.clip,
    # which turns bfloat16 into float32
    def bound(ufunc, A, v, out=None):
        return with_scalar(ufunc, A, v, out) if np.size(v) == 1 else ufunc(A, v, out=out)

    if lo is None:
        return X if hi is None else bound(np.minimum, X, hi)
    y = _fresh(bound(np.maximum, X, lo))
    if hi is not None:
        bound(np.minimum, y, hi, out=y)
    return y


@kernel("Clip", since=6)
def clip_6(input, *, min=-3.4028234663852886e38, max=3.4028234663852886e38):
    info = np.finfo(input.dtype)  # the float32 defaults overflow narrower types
    lo, hi = (_s(input, np.clip(v, float(info.min), float(info.max))) for v in (min, max))
    return (_clip(input, lo, hi),)


@kernel("Clip", since=11)
def clip(input, min=None, max=None):
    return (_clip(input, min, max),)


# ---------------------------------------------------------------------------- variadic


def _fold(ufunc: np.ufunc, data: tuple) -> np.ndarray:
    """ufunc over all inputs with broadcasting, reusing the running result once it is ours."""
    if not data:
        raise ValueError("needs at least one input")
    out, own = data[0], False
    for d in data[1:]:
        if own and np.broadcast_shapes(out.shape, d.shape) == out.shape:
            ufunc(out, d, out=out)
        else:
            out, own = _fresh(ufunc(out, d)), True
    return out


@kernel("Max", since=6)
def max_(*data_0):
    return (_fold(np.maximum, data_0),)


@kernel("Min", since=6)
def min_(*data_0):
    return (_fold(np.minimum, data_0),)


@kernel("Sum", since=6)
def sum_(*data_0):
    return (_fold(np.add, data_0),)


@kernel("Mean", since=6)
def mean(*data_0):
    if len(data_0) == 1:
        return (data_0[0],)
    total = _fold(np.add, data_0)  # a fresh array: divide in place
    total /= _s(total, len(data_0))
    return (total,)


@kernel("Where", since=9)
def where(condition, X, Y):
    # below a few thousand elements np.where's mispredictions cost less than the select's setup
    large = max(condition.size, X.size, Y.size) >= 4096
    if large and condition.dtype == np.bool_ and X.dtype == Y.dtype and X.dtype.itemsize in BITS \
            and X.dtype.kind in "biufcV":
        return (select_bits(condition, X, Y),)
    return (np.where(condition, X, Y),)


# ---------------------------------------------------------------------------- comparisons and logic


@kernel("Equal", since=7)
def equal(A, B):
    return (np.equal(A, B),)


@kernel("Less", since=7)
def less(A, B):
    return (np.less(A, B),)


@kernel("Greater", since=7)
def greater(A, B):
    return (np.greater(A, B),)


@kernel("LessOrEqual", since=12)
def less_or_equal(A, B):
    return (np.less_equal(A, B),)


@kernel("GreaterOrEqual", since=12)
def greater_or_equal(A, B):
    return (np.greater_equal(A, B),)


@kernel("Not", since=1)
def not_(X):
    return (np.logical_not(X),)


@kernel("And", since=7)
def and_(A, B):
    return (np.logical_and(A, B),)


@kernel("Or", since=7)
def or_(A, B):
    return (np.logical_or(A, B),)


@kernel("Xor", since=7)
def xor(A, B):
    return (np.logical_xor(A, B),)


@kernel("IsNaN", since=9)
def is_nan(X):
    return (np.isnan(X),)


@kernel("IsInf", since=10)
def is_inf(X, *, detect_negative=1, detect_positive=1):
    if detect_negative and detect_positive:
        return (np.isinf(X),)
    if detect_positive:
        return (np.inf == X,)
    if detect_negative:
        return (-np.inf == X,)
    return (np.zeros(X.shape, dtype=bool),)
