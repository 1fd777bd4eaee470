"""Elementwise kernels: what the ONNX spec's node cases do not check (accuracy, stability, dtypes)."""
from __future__ import annotations

import math
import warnings
import zlib

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
    # the outer lambda binds each op
    **{op: (lambda op: lambda X: run(op, X))(op) for op in ("Tan", "Asin", "Acos", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh")},  # noqa: B023
    "Shrink": lambda X: run("Shrink", X, bias=0.5, lambd=1.0),
    "LpNormalization": lambda X: run("LpNormalization", X, axis=1, p=1),
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


def _special_values(rng: np.random.Generator, dtype, shape) -> np.ndarray:
    """Random values of ``dtype`` laced with NaN (two payloads), +-0, +-inf and extremes."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
    x = rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "c":
        x = x + 1j * rng.standard_normal(shape).astype(dtype)
    flat = x.reshape(-1)
    specials = [np.nan, -0.0, 0.0, np.inf, -np.inf]
    picks = rng.integers(0, flat.size, size=min(flat.size, 3 * len(specials)))
    for i, at in enumerate(picks):
        flat[at] = specials[i % len(specials)]
    if dtype.kind == "f" and flat.size > 1:  # a NaN with another payload and sign
        bits = flat.view(f"u{dtype.itemsize}")
        bits[-1] = np.array(np.nan, dtype).view(bits.dtype) | 1
        flat[0] = -flat[-1]
    return x


WHERE_SHAPES = [  # condition, X, Y
    ((5, 7), (5, 7), ()),
    ((5, 7), (), (5, 7)),
    ((5, 7), (5, 7), (5, 7)),
    ((3, 1, 4), (1, 6, 1), (6, 4)),
    ((2, 3, 4), (4,), ()),
    ((), (3,), (3,)),
    ((), (), ()),
    ((4, 1), (1, 1), (1,)),
    ((64, 80), (64, 80), ()),  # large enough for the kernel to take the select
    ((70, 1, 64), (1, 3, 64), (3, 1)),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, "bfloat16", np.int8, np.uint8, np.int16,
                                   np.int32, np.int64, np.uint64, np.bool_, np.complex64, np.complex128])
@pytest.mark.parametrize("shapes", WHERE_SHAPES, ids=str)
@pytest.mark.parametrize("y_kind", ["random", "zero", "negative-zero", "nan"])
def test_where_is_bit_identical_to_np_where(dtype, shapes, y_kind):
    """The bitwise select (all fixed-width dtypes) against np.where: same bits, shape and dtype."""
    import ml_dtypes

    from odt_ops.kernels._fast import BITS as _BITS
    from odt_ops.kernels._fast import select_bits as _select_bits

    dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    rng = np.random.default_rng(zlib.crc32(repr((str(dtype), shapes, y_kind)).encode()))
    c_shape, x_shape, y_shape = shapes
    condition = rng.random(c_shape) < 0.5
    X = _special_values(rng, np.float32 if dtype.kind == "V" else dtype, x_shape).astype(dtype)
    Y = _special_values(rng, np.float32 if dtype.kind == "V" else dtype, y_shape).astype(dtype)
    if y_kind != "random" and dtype.kind in "fcV":
        Y = np.full(y_shape, {"zero": 0.0, "negative-zero": -0.0, "nan": np.nan}[y_kind], dtype=dtype)
    elif y_kind == "zero":
        Y = np.zeros(y_shape, dtype)
    for a, b in ((X, Y), (Y, X)):  # a zero scalar on either side
        want = np.where(condition, a, b)
        candidates = [run("Where", condition, a, b)]
        if dtype.itemsize in _BITS:  # the select itself, also below the size the kernel uses it from
            candidates.append(_select_bits(condition, a, b))
        for got in candidates:
            assert got.dtype == want.dtype
            assert got.shape == want.shape
            assert got.tobytes() == want.tobytes()


def test_where_on_strided_inputs():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((6, 8)).astype(np.float32)
    condition = rng.random((8, 6)) < 0.5
    got = run("Where", condition.T, X[:, ::-1], np.float32(-0.0) * X[::2].repeat(2, axis=0))
    want = np.where(condition.T, X[:, ::-1], np.float32(-0.0) * X[::2].repeat(2, axis=0))
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, "bfloat16", np.int8, np.int32, np.uint8])
@pytest.mark.parametrize("n", [100, 32768, 3 * 16384 + 17])
def test_max_min_against_a_scalar_are_bit_identical_to_numpy(dtype, n):
    """``_with_scalar`` (the scalar spelled out as a contiguous row) against numpy's own scalar loop,
    through Relu and Clip: same bits, with NaN payloads, -0.0 and infinities among the inputs."""
    import ml_dtypes

    from odt_ops.kernels._fast import with_scalar as _with_scalar

    dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    rng = np.random.default_rng(n)
    X = _special_values(rng, np.float32 if dtype.kind == "V" else dtype, (n,)).astype(dtype)
    for shape in [(n,), (1, n, 1)]:
        A = X.reshape(shape)
        low = 1 if dtype.kind == "u" else -1
        # -0.0 after 0.0 and NaN twice: the cached constant rows must not mistake one for another
        signed = [(np.maximum, 0.0), (np.maximum, -0.0), (np.minimum, -0.0), (np.maximum, np.nan), (np.maximum, np.nan)] \
            if dtype.kind in "fV" else []
        for ufunc, c in [(np.maximum, 0), (np.minimum, 0), (np.maximum, low), (np.minimum, 6), *signed]:
            want = ufunc(A, dtype.type(c))
            got = _with_scalar(ufunc, A, dtype.type(c))
            assert got.dtype == want.dtype
            assert got.shape == want.shape
            assert got.tobytes() == want.tobytes()
            out = np.empty_like(A)
            assert _with_scalar(ufunc, A, dtype.type(c), out=out) is not None
            assert out.tobytes() == want.tobytes()
    assert run("Relu", X).tobytes() == np.maximum(X, dtype.type(0)).tobytes()
    lo, hi = np.array(1 if dtype.kind == "u" else -1, dtype), np.array(6, dtype)
    assert run("Clip", X, lo, hi).tobytes() == np.minimum(np.maximum(X, lo), hi).tobytes()
    assert run("Clip", X[::-1], lo, hi).tobytes() == np.minimum(np.maximum(X[::-1], lo), hi).tobytes()
