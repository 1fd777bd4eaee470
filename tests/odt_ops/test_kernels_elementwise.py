"""Elementwise kernels: what the ONNX spec's node cases do not check (accuracy, stability, dtypes)."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from odt_ops.kernels import lookup

OPSET = 22


def run(op: str, *inputs, opset: int = OPSET, **attrs) -> np.ndarray:
    entry = lookup("", op, opset)
    assert entry is not None, f"{op} has no kernel at opset {opset}"
    return entry.fn(*inputs, **attrs)[0]


_math_erf = np.frompyfunc(math.erf, 1, 1)


def _erf_grid() -> np.ndarray:
    dense = np.linspace(-7.0, 7.0, 280_001)
    tiny = np.geomspace(1e-30, 1e-2, 2_001)
    return np.concatenate([dense, tiny, -tiny])


def test_erf_float64_matches_math_erf():
    x = _erf_grid()
    want = _math_erf(x).astype(np.float64)
    got = run("Erf", x)
    assert got.dtype == np.float64
    assert np.max(np.abs(got - want)) < 1e-15
    small = (np.abs(x) < 1e-2) & (x != 0)  # erf(x) ~ 1.128 x: tiny inputs keep their relative digits
    assert np.max(np.abs(got[small] / want[small] - 1)) < 1e-14


def test_erf_float32_is_off_by_rounding_only():
    x = _erf_grid().astype(np.float32)
    want = _math_erf(x.astype(np.float64)).astype(np.float64)
    got = run("Erf", x)
    assert got.dtype == np.float32
    assert np.max(np.abs(got.astype(np.float64) - want)) < 1e-7
    small = (np.abs(x) < 1e-2) & (x != 0)
    assert np.max(np.abs(got[small] / want[small] - 1)) < 1.2e-7  # one float32 ulp


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_erf_special_values(dtype):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30], dtype)
    got = run("Erf", x)
    np.testing.assert_array_equal(got, np.array([np.nan, 1, -1, 0, -0.0, 1, -1], dtype))
    assert np.signbit(got[4])


# ops whose naive formula overflows exp for large |x|; (op, attributes, value at -1e4, value at +1e4)
LIMITS = [
    ("Sigmoid", {}, 0.0, 1.0),
    ("Softplus", {}, 0.0, 1e4),
    ("Mish", {}, 0.0, 1e4),
    ("Elu", {"alpha": 0.5}, -0.5, 1e4),
    ("Celu", {"alpha": 2.0}, -2.0, 1e4),
    ("Gelu", {}, 0.0, 1e4),
    ("Gelu", {"approximate": "tanh"}, 0.0, 1e4),
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize(("op", "attrs", "low", "high"), LIMITS, ids=[f"{o}-{a}" for o, a, _, _ in LIMITS])
def test_stable_at_large_magnitudes(op, attrs, low, high, dtype):
    x = np.array([-1e4, -88.0, -20.0, 0.0, 20.0, 88.0, 1e4], dtype)
    # exp underflowing to 0 is the right limit (numpy ignores underflow by default too)
    with warnings.catch_warnings(), np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
        warnings.simplefilter("error")
        got = run(op, x, **attrs)
    assert got.dtype == dtype
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[[0, -1]].astype(np.float64), [low, high], rtol=1e-3, atol=1e-30)


def test_sigmoid_keeps_relative_accuracy_in_the_tail():
    x = np.array([-20.0, -50.0, -80.0], np.float32)
    want = 1 / (1 + np.exp(-x.astype(np.float64)))
    np.testing.assert_allclose(run("Sigmoid", x), want, rtol=1e-6)
    np.testing.assert_allclose(run("Softplus", x), np.log1p(np.exp(x.astype(np.float64))), rtol=1e-6)


# every op with a float output, with how to call it on an input X
FLOAT_OPS = {
    "Add": lambda X: run("Add", X, X),
    "Sub": lambda X: run("Sub", X, X),
    "Mul": lambda X: run("Mul", X, X),
    "Div": lambda X: run("Div", X, X + X.dtype.type(3)),
    "Pow": lambda X: run("Pow", np.abs(X), X),
    "Pow-square": lambda X: run("Pow", X, np.array(2.0, X.dtype)),
    "Pow-int-exponent": lambda X: run("Pow", X, np.array([3], np.int64)),
    "Pow-float64-exponent": lambda X: run("Pow", np.abs(X), np.array(0.5)),
    "Neg": lambda X: run("Neg", X),
    "Abs": lambda X: run("Abs", X),
    "Sqrt": lambda X: run("Sqrt", np.abs(X)),
    "Reciprocal": lambda X: run("Reciprocal", X),
    "Exp": lambda X: run("Exp", X),
    "Log": lambda X: run("Log", np.abs(X)),
    "Erf": lambda X: run("Erf", X),
    "Sin": lambda X: run("Sin", X),
    "Cos": lambda X: run("Cos", X),
    "Atan": lambda X: run("Atan", X),
    "Tanh": lambda X: run("Tanh", X),
    "Sigmoid": lambda X: run("Sigmoid", X),
    "Relu": lambda X: run("Relu", X),
    "LeakyRelu": lambda X: run("LeakyRelu", X, alpha=0.1),
    "LeakyRelu-steep": lambda X: run("LeakyRelu", X, alpha=3.0),
    "Elu": lambda X: run("Elu", X, alpha=0.7),
    "Selu": lambda X: run("Selu", X),
    "Celu": lambda X: run("Celu", X, alpha=0.5),
    "Softplus": lambda X: run("Softplus", X),
    "Softsign": lambda X: run("Softsign", X),
    "PRelu": lambda X: run("PRelu", X, np.full(X.shape[-1:], 0.2, X.dtype)),
    "HardSigmoid": lambda X: run("HardSigmoid", X, alpha=0.3, beta=0.4),
    "HardSwish": lambda X: run("HardSwish", X),
    "ThresholdedRelu": lambda X: run("ThresholdedRelu", X, alpha=0.5),
    "Clip-6": lambda X: run("Clip", X, opset=6, min=-0.5, max=0.5),
    "Clip-6-defaults": lambda X: run("Clip", X, opset=6),
    "Clip": lambda X: run("Clip", X, np.array(-0.5, X.dtype), np.array(0.5, X.dtype)),
    "Clip-max-only": lambda X: run("Clip", X, None, np.array(0.5, X.dtype)),
    "Gelu": lambda X: run("Gelu", X),
    "Gelu-tanh": lambda X: run("Gelu", X, approximate="tanh"),
    "Mish": lambda X: run("Mish", X),
    "Where": lambda X: run("Where", X > 0, X, -X),
    "Max": lambda X: run("Max", X, X[:1], X),
    "Min": lambda X: run("Min", X, X[:1], X),
    "Sum": lambda X: run("Sum", X, X[:1], X),
    "Mean": lambda X: run("Mean", X, X[:1], X),
    "Sum-one": lambda X: run("Sum", X),
    "Sign": lambda X: run("Sign", X),
    "Floor": lambda X: run("Floor", X),
    "Ceil": lambda X: run("Ceil", X),
    "Round": lambda X: run("Round", X),
    "CastLike": lambda X: run("CastLike", X.astype(np.float64), X[:0]),
}


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(FLOAT_OPS))
def test_float_ops_keep_the_input_dtype(name, dtype):
    X = np.linspace(-3, 3, 24, dtype=np.float64).reshape(4, 6).astype(dtype)
    X_before = X.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        got = np.asarray(FLOAT_OPS[name](X))
    assert got.dtype == dtype, f"{name}: {dtype.__name__} in, {got.dtype} out"
    np.testing.assert_array_equal(X, X_before)  # kernels never write to their inputs
