"""Every gradient rule against float64 central finite differences (tests/odt_ops/gradcheck.py),
over randomized shapes and attributes, plus the walker's chores: broadcasting, fan-out,
frozen and integer inputs, coverage errors. Every gradient graph is checked to be
standard ai.onnx that passes onnx.checker's full check."""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

from odt_ops.errors import GradientError, UnsupportedOpError
from odt_ops.grad import build_gradients, missing_gradients, registered_gradients
from tests.odt_ops.gradcheck import check_gradients, error_report, make_model, with_projection_loss

SETTINGS = settings(deadline=None, max_examples=8, database=None, suppress_health_check=list(HealthCheck))
FEW = settings(SETTINGS, max_examples=4)

ERRORS: dict[str, float] = defaultdict(float)  # family -> largest error seen


report_errors = error_report(ERRORS, "family")


def node(op, inputs, outputs=("Y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), name=f"{op}_{'_'.join(outputs)}", **attrs)


def check(family, nodes, inputs, wrt=None, *, initializers=None, symbolic=(), outputs=None, **tol):
    """Gradient check of ``nodes``; wrt defaults to every float input."""
    nodes = nodes if isinstance(nodes, list) else [nodes]
    model = make_model(nodes, inputs, outputs, initializers=initializers, symbolic=symbolic)
    wrt = wrt if wrt is not None else [n for n, v in inputs.items() if v.dtype.kind == "f"]
    errors = check_gradients(model, inputs, wrt, **tol)
    ERRORS[family] = max(ERRORS[family], *errors.values(), 0.0)
    return errors


def seeds():
    return st.integers(0, 2**32 - 1)


def shapes(min_rank=1, max_rank=3, max_side=4):
    return st.lists(st.integers(1, max_side), min_size=min_rank, max_size=max_rank).map(tuple)


def normal(rng, shape):
    return rng.standard_normal(shape)


def away_from(rng, shape, points=(0.0,), gap=0.1):
    """Random values at least ``gap`` from every kink in ``points``."""
    x = rng.uniform(-3, 3, shape)
    for p in points:
        near = np.abs(x - p) < gap
        x = np.where(near, p + np.sign(x - p + 1e-12) * gap * 2, x)
    return x


@st.composite
def broadcast_pair(draw, max_rank=4):
    """Two shapes that broadcast together (leading axes dropped, axes set to 1), in either order."""
    full = draw(shapes(1, max_rank))
    drop = draw(st.integers(0, len(full)))
    other = [1 if draw(st.booleans()) else d for d in full[drop:]]
    pair = (full, tuple(other))
    return pair if draw(st.booleans()) else pair[::-1]


# ----- unary elementwise -----

SMOOTH = lambda rng, s: normal(rng, s)
KINK0 = lambda rng, s: away_from(rng, s)
POSITIVE = lambda rng, s: rng.uniform(0.2, 3, s)
UNIT = lambda rng, s: rng.uniform(-0.9, 0.9, s)

UNARY = {
    "Neg": (SMOOTH, {}),
    "Abs": (KINK0, {}),
    "Reciprocal": (KINK0, {}),
    "Sqrt": (POSITIVE, {}),
    "Exp": (SMOOTH, {}),
    "Log": (POSITIVE, {}),
    "Tanh": (SMOOTH, {}),
    "Sigmoid": (SMOOTH, {}),
    "Relu": (KINK0, {}),
    "LeakyRelu": (KINK0, {"alpha": 0.07}),
    "Elu": (KINK0, {"alpha": 0.7}),
    "Celu": (KINK0, {"alpha": 1.3}),
    "Selu": (KINK0, {}),
    "ThresholdedRelu": (lambda rng, s: away_from(rng, s, (0.5,)), {"alpha": 0.5}),
    "Softplus": (SMOOTH, {}),
    "Softsign": (KINK0, {}),
    "Erf": (SMOOTH, {}),
    "Gelu": (SMOOTH, {}),
    "Mish": (SMOOTH, {}),
    "HardSigmoid": (lambda rng, s: away_from(rng, s, (-2.5, 2.5)), {"alpha": 0.2, "beta": 0.5}),
    "HardSwish": (lambda rng, s: away_from(rng, s, (-3.0, 3.0)) * 1.5, {}),
    "Sin": (SMOOTH, {}),
    "Cos": (SMOOTH, {}),
    "Tan": (lambda rng, s: rng.uniform(-1.2, 1.2, s), {}),
    "Atan": (SMOOTH, {}),
    "Asin": (UNIT, {}),
    "Acos": (UNIT, {}),
    "Sinh": (SMOOTH, {}),
    "Cosh": (SMOOTH, {}),
    "Asinh": (SMOOTH, {}),
    "Acosh": (lambda rng, s: rng.uniform(1.2, 3, s), {}),
    "Atanh": (UNIT, {}),
    "Identity": (SMOOTH, {}),
    "Floor": (lambda rng, s: away_from(rng, s, range(-3, 4)), {}),
    "Ceil": (lambda rng, s: away_from(rng, s, range(-3, 4)), {}),
    "Round": (lambda rng, s: away_from(rng, s, np.arange(-3.5, 4)), {}),
    "Sign": (KINK0, {}),
    "Shrink": (lambda rng, s: away_from(rng, s, (-0.5, 0.5)), {"lambd": 0.5, "bias": 0.3}),
}


FLOAT32_ONLY = {"Celu"}  # the spec types Celu for float only


@pytest.mark.parametrize("op", sorted(UNARY))
@FEW
@given(shape=shapes(), seed=seeds())
def test_unary(op, shape, seed):
    values, attrs = UNARY[op]
    x = values(np.random.default_rng(seed), shape)
    if op in FLOAT32_ONLY:  # finite differences in float32 need a larger step and tolerance
        check("elementwise (float32)", node(op, ["X"], **attrs), {"X": x.astype(np.float32)}, eps=1e-2, rtol=1e-2, atol=1e-3)
    else:
        check("elementwise", node(op, ["X"], **attrs), {"X": x})


@SETTINGS
@given(shape=shapes(), seed=seeds(), approximate=st.sampled_from(["none", "tanh"]))
def test_gelu_approximations(shape, seed, approximate):
    check("elementwise", node("Gelu", ["X"], approximate=approximate), {"X": normal(np.random.default_rng(seed), shape)})


# ----- binary and variadic elementwise, with broadcasting -----

BINARY = {
    "Add": (SMOOTH, SMOOTH),
    "Sub": (SMOOTH, SMOOTH),
    "Mul": (SMOOTH, SMOOTH),
    "Div": (SMOOTH, KINK0),
    "Pow": (POSITIVE, SMOOTH),
    "Max": (SMOOTH, SMOOTH),
    "Min": (SMOOTH, SMOOTH),
}


@pytest.mark.parametrize("op", sorted(BINARY))
@SETTINGS
@given(pair=broadcast_pair(), seed=seeds(), batch=st.booleans())
def test_binary_broadcasting(op, pair, seed, batch):
    rng = np.random.default_rng(seed)
    fa, fb = BINARY[op]
    a, b = fa(rng, pair[0]), fb(rng, pair[1])
    symbolic = {"A"} if batch and len(pair[0]) > len(pair[1]) else set()
    check("elementwise", node(op, ["A", "B"]), {"A": a, "B": b}, symbolic=symbolic)


@SETTINGS
@given(shape=shapes(), seed=seeds(), fmod=st.sampled_from([0, 1]))
def test_mod_away_from_its_jumps(shape, seed, fmod):
    """Mod jumps where A/B is a whole number; A is drawn so that A/B keeps a fractional part
    in [0.2, 0.8], where finite differences are exact (both the C and the Python remainder)."""
    rng = np.random.default_rng(seed)
    b = rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    quotient = rng.integers(-3, 4, shape) + rng.uniform(0.2, 0.8, shape) * rng.choice([-1.0, 1.0], shape)
    check("elementwise", node("Mod", ["A", "B"], fmod=fmod), {"A": quotient * b, "B": b})


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
@SETTINGS
@given(pair=broadcast_pair(max_rank=3), n=st.integers(1, 3), seed=seeds())
def test_variadic(op, pair, n, seed):
    rng = np.random.default_rng(seed)
    inputs = {f"X{i}": normal(rng, pair[i % 2]) for i in range(n)}
    check("elementwise", node(op, list(inputs)), inputs)


@SETTINGS
@given(seed=seeds(), exponent=st.sampled_from([2.0, 3.0, 0.5, -1.0, 1.0]))
def test_pow_constant_exponent(seed, exponent):
    rng = np.random.default_rng(seed)
    check("elementwise", node("Pow", ["X", "E"]), {"X": POSITIVE(rng, (2, 3))}, initializers={"E": np.array(exponent)})


@SETTINGS
@given(seed=seeds())
def test_pow_integer_exponent_is_not_differentiated(seed):
    rng = np.random.default_rng(seed)
    check("elementwise", node("Pow", ["X", "E"]), {"X": normal(rng, (2, 3)), "E": np.array([2, 3, 1], dtype=np.int64)})


@SETTINGS
@given(pair=broadcast_pair(max_rank=3), seed=seeds())
def test_where(pair, seed):
    rng = np.random.default_rng(seed)
    cond = rng.random(pair[0]) > 0.5
    check("elementwise", node("Where", ["C", "A", "B"]), {"C": cond, "A": normal(rng, pair[0]), "B": normal(rng, pair[1])})


@SETTINGS
@given(shape=shapes(2, 4), seed=seeds(), per_channel=st.booleans())
def test_prelu(shape, seed, per_channel):
    rng = np.random.default_rng(seed)
    slope_shape = (shape[1],) + (1,) * (len(shape) - 2) if per_channel else (1,)
    check("elementwise", node("PRelu", ["X", "S"]), {"X": KINK0(rng, shape), "S": rng.uniform(0.1, 0.5, slope_shape)})


@SETTINGS
@given(shape=shapes(), seed=seeds(), lo=st.booleans(), hi=st.booleans())
def test_clip(shape, seed, lo, hi):
    rng = np.random.default_rng(seed)
    inits = {}
    if lo:
        inits["lo"] = np.array(-0.5)
    if hi:
        inits["hi"] = np.array(0.7)
    x = away_from(rng, shape, (-0.5, 0.7))
    check("elementwise", node("Clip", ["X", "lo" if lo else "", "hi" if hi else ""]), {"X": x}, initializers=inits)


@SETTINGS
@given(shape=shapes(), seed=seeds())
def test_cast_float_to_float_and_integer_stop(shape, seed):
    """A float cast passes the gradient; a cast through int64 stops it (zero gradient)."""
    x = away_from(np.random.default_rng(seed), shape, range(-3, 4))
    nodes = [
        node("Cast", ["X"], ["F"], to=onnx.TensorProto.DOUBLE),
        node("Cast", ["X"], ["I"], to=onnx.TensorProto.INT64),
        node("Cast", ["I"], ["G"], to=onnx.TensorProto.DOUBLE),
        node("Add", ["F", "G"]),
    ]
    check("elementwise", nodes, {"X": x})


@SETTINGS
@given(shape=shapes(), seed=seeds())
def test_cast_like(shape, seed):
    rng = np.random.default_rng(seed)
    check("elementwise", node("CastLike", ["X", "T"]), {"X": normal(rng, shape), "T": np.zeros(1)}, wrt=["X"])


@SETTINGS
@given(shape=shapes(), seed=seeds(), ratio=st.sampled_from([0.0, 0.3, 0.5]), mode=st.sampled_from(["constant", "input", "off"]))
def test_dropout(shape, seed, ratio, mode):
    """Training mode reuses the forward mask (the same seeded draw in both graphs)."""
    rng = np.random.default_rng(seed)
    inputs = {"X": normal(rng, shape)}
    inits = {"ratio": np.array(ratio)}
    if mode == "constant":
        inits["training"] = np.array(True)
    elif mode == "input":
        inputs["training"] = np.array(bool(seed % 2))
    train = "" if mode == "off" else "training"
    check("elementwise", node("Dropout", ["X", "ratio", train], ["Y"]), inputs, wrt=["X"], initializers=inits)


@SETTINGS
@given(shape=shapes(), seed=seeds())
def test_dropout_ratio_as_input(shape, seed):
    rng = np.random.default_rng(seed)
    inputs = {"X": normal(rng, shape), "ratio": np.array(0.25)}
    check("elementwise", node("Dropout", ["X", "ratio", "training"], ["Y", "mask"]), inputs, wrt=["X"],
          initializers={"training": np.array(True)}, outputs=["Y"])


# ----- linalg -----


@SETTINGS
@given(m=st.integers(1, 4), k=st.integers(1, 4), n=st.integers(1, 4), ra=st.integers(1, 4), rb=st.integers(1, 4),
       batch=shapes(0, 2, 3), seed=seeds(), data=st.data())
def test_matmul(m, k, n, ra, rb, batch, seed, data):
    rng = np.random.default_rng(seed)
    batch_a = tuple(d if data.draw(st.booleans()) else 1 for d in batch)[len(batch) - max(0, min(len(batch), ra - 2)):]
    batch_b = tuple(d if data.draw(st.booleans()) else 1 for d in batch)[len(batch) - max(0, min(len(batch), rb - 2)):]
    a_shape = (k,) if ra == 1 else (*batch_a, m, k)
    b_shape = (k,) if rb == 1 else (*batch_b, k, n)
    check("linalg", node("MatMul", ["A", "B"]), {"A": normal(rng, a_shape), "B": normal(rng, b_shape)})


@SETTINGS
@given(m=st.integers(1, 4), k=st.integers(1, 4), n=st.integers(1, 4), ta=st.integers(0, 1), tb=st.integers(0, 1),
       alpha=st.sampled_from([1.0, 0.5]), beta=st.sampled_from([1.0, -2.0]), c=st.sampled_from(["none", "scalar", "row", "col", "full"]),
       seed=seeds())
def test_gemm(m, k, n, ta, tb, alpha, beta, c, seed):
    rng = np.random.default_rng(seed)
    inputs = {"A": normal(rng, (k, m) if ta else (m, k)), "B": normal(rng, (n, k) if tb else (k, n))}
    c_shape = {"scalar": (1,), "row": (n,), "col": (m, 1), "full": (m, n)}.get(c)
    if c_shape:
        inputs["C"] = normal(rng, c_shape)
    nodes = node("Gemm", list(inputs), transA=ta, transB=tb, alpha=alpha, beta=beta)
    check("linalg", nodes, inputs, symbolic={"A"} if not ta else set())


EINSUM = [
    ("ij,jk->ik", [(2, 3), (3, 4)]),
    ("bij,bjk->bik", [(2, 2, 3), (2, 3, 4)]),
    ("ij->", [(2, 3)]),
    ("ij->ji", [(2, 3)]),
    ("ij->i", [(2, 3)]),
    ("i,i->", [(3,), (3,)]),
    ("i,j->ij", [(3,), (2,)]),
    ("ij,j->i", [(2, 3), (3,)]),
    ("ij,ik->jk", [(2, 3), (2, 4)]),
    ("bij,jk", [(2, 2, 3), (3, 4)]),
    ("...ij,...jk->...ik", [(2, 2, 3), (2, 3, 4)]),
    ("ijk,k->ij", [(2, 3, 4), (4,)]),
    ("ab,bc,cd->ad", [(2, 3), (3, 2), (2, 4)]),
    # repeated labels read diagonals
    ("ii->i", [(3, 3)]),
    ("ii", [(3, 3)]),
    ("iij,jk->ik", [(2, 2, 3), (3, 4)]),
    ("bii->bi", [(2, 3, 3)]),
    ("iji->j", [(2, 3, 2)]),
    ("iii->", [(2, 2, 2)]),
]


@pytest.mark.parametrize("equation,shapes_", EINSUM, ids=[e for e, _ in EINSUM])
@FEW
@given(seed=seeds())
def test_einsum(equation, shapes_, seed):
    rng = np.random.default_rng(seed)
    inputs = {f"X{i}": normal(rng, s) for i, s in enumerate(shapes_)}
    check("linalg", node("Einsum", list(inputs), equation=equation), inputs)


# ----- reductions, softmax family, cumulative sum, TopK -----

REDUCTIONS = {
    "ReduceSum": SMOOTH,
    "ReduceMean": SMOOTH,
    "ReduceMax": SMOOTH,
    "ReduceMin": SMOOTH,
    "ReduceProd": lambda rng, s: rng.uniform(0.5, 1.5, s) * np.sign(away_from(rng, s)),
    "ReduceL1": KINK0,
    "ReduceL2": SMOOTH,
    "ReduceSumSquare": SMOOTH,
    "ReduceLogSum": POSITIVE,
    "ReduceLogSumExp": SMOOTH,
}


@st.composite
def reduction_axes(draw, rank):
    """None (reduce all) or a non-empty subset of the axes, possibly negative."""
    if draw(st.booleans()):
        return None
    axes = draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    return [a - rank if draw(st.booleans()) else a for a in axes]


@pytest.mark.parametrize("op", sorted(REDUCTIONS))
@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), keepdims=st.integers(0, 1), data=st.data())
def test_reduce(op, shape, seed, keepdims, data):
    rng = np.random.default_rng(seed)
    axes = data.draw(reduction_axes(len(shape)))
    inits = {} if axes is None else {"axes": np.array(axes, dtype=np.int64)}
    n = node(op, ["X", "axes" if axes is not None else ""], keepdims=keepdims)
    check("reduce", n, {"X": REDUCTIONS[op](rng, shape)}, initializers=inits)


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds())
def test_reduce_noop_with_empty_axes(shape, seed):
    x = normal(np.random.default_rng(seed), shape)
    check("reduce", node("ReduceSum", ["X", "axes"], noop_with_empty_axes=1), {"X": x}, initializers={"axes": np.zeros(0, np.int64)})


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), exclusive=st.integers(0, 1), reverse=st.integers(0, 1), data=st.data())
def test_cumsum(shape, seed, exclusive, reverse, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = normal(np.random.default_rng(seed), shape)
    check("reduce", node("CumSum", ["X", "axis"], exclusive=exclusive, reverse=reverse), {"X": x}, initializers={"axis": np.array(axis)})


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax", "Hardmax"])
@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), data=st.data())
def test_softmax(op, shape, seed, data):
    """Hardmax is piecewise constant: away from ties (normal draws never tie) its gradient is 0."""
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    check("reduce", node(op, ["X"], axis=axis), {"X": normal(np.random.default_rng(seed), shape)})


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), p=st.sampled_from([1, 2]), data=st.data())
def test_lp_normalization(shape, seed, p, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = away_from(np.random.default_rng(seed), shape)
    if p == 1:  # onnx.reference sums x**p without abs: keep the signs alike for it to agree
        x = np.abs(x)
    check("reduce", node("LpNormalization", ["X"], axis=axis, p=p), {"X": x})


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), largest=st.integers(0, 1), data=st.data())
def test_topk(shape, seed, largest, data):
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    k = data.draw(st.integers(1, shape[axis]))
    x = normal(np.random.default_rng(seed), shape)
    check("reduce", node("TopK", ["X", "K"], ["V", "I"], axis=axis, largest=largest), {"X": x}, initializers={"K": np.array([k])})


# ----- shape and indexing -----


# a parameter, not a draw: every run checks each op (the session's finite-difference record
# holds every rule to one, tests/fd_coverage.py)
@pytest.mark.parametrize("op", ["Reshape", "Flatten", "Squeeze", "Unsqueeze"])
@FEW
@given(shape=shapes(1, 4), seed=seeds(), data=st.data())
def test_reshape_family(op, shape, seed, data):
    rng = np.random.default_rng(seed)
    x = normal(rng, shape)
    if op == "Reshape":
        check("shape", node("Reshape", ["X", "S"]), {"X": x}, initializers={"S": np.array([-1], np.int64)})
    elif op == "Flatten":
        check("shape", node("Flatten", ["X"], axis=data.draw(st.integers(0, len(shape)))), {"X": x})
    elif op == "Squeeze":
        x = x.reshape(1, *shape)
        check("shape", node("Squeeze", ["X", "A"]), {"X": x}, initializers={"A": np.array([0], np.int64)})
    else:
        check("shape", node("Unsqueeze", ["X", "A"]), {"X": x}, initializers={"A": np.array([-1, 0], np.int64)})


@SETTINGS
@given(shape=shapes(1, 4), seed=seeds(), data=st.data())
def test_transpose(shape, seed, data):
    perm = data.draw(st.permutations(range(len(shape))))
    attrs = {"perm": list(perm)} if data.draw(st.booleans()) else {}
    check("shape", node("Transpose", ["X"], **attrs), {"X": normal(np.random.default_rng(seed), shape)})


@SETTINGS
@given(pair=broadcast_pair(max_rank=3), seed=seeds())
def test_expand(pair, seed):
    small, big = sorted(pair, key=len)
    target = np.broadcast_shapes(small, big)
    check("shape", node("Expand", ["X", "S"]), {"X": normal(np.random.default_rng(seed), small)},
          initializers={"S": np.array(target, np.int64)})


@SETTINGS
@given(shape=shapes(1, 3), n=st.integers(2, 4), seed=seeds())
def test_concat_of_equal_symbolic_parts(shape, n, seed):
    """Parts concatenated along their symbolic batch (a recurrence's steps): an even Split back."""
    rng = np.random.default_rng(seed)
    inputs = {f"X{i}": normal(rng, shape) for i in range(n)}
    check("shape", node("Concat", list(inputs), axis=0), inputs, symbolic=set(inputs))


@SETTINGS
@given(shape=shapes(1, 3), n=st.integers(1, 3), seed=seeds(), data=st.data())
def test_concat(shape, n, seed, data):
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    inputs = {}
    for i in range(n):
        s = list(shape)
        s[axis] = data.draw(st.integers(1, 3))
        inputs[f"X{i}"] = normal(rng, s)
    symbolic = {"X0"} if axis not in (0, -len(shape)) and data.draw(st.booleans()) else set()
    check("shape", node("Concat", list(inputs), axis=axis), inputs, symbolic=symbolic)


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), data=st.data())
def test_split(shape, seed, data):
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(0, len(shape) - 1))
    shape = list(shape)
    shape[axis] += 2
    sizes = [1, shape[axis] - 2, 1]
    used = data.draw(st.lists(st.sampled_from(["A", "B", "C"]), min_size=1, unique=True))
    nodes = [node("Split", ["X", "S"], ["A", "B", "C"], axis=axis)] + [node("Identity", [u], [f"out{u}"]) for u in used]
    check("shape", nodes, {"X": normal(rng, shape)}, initializers={"S": np.array(sizes, np.int64)}, outputs=[f"out{u}" for u in used])


@st.composite
def slice_args(draw, shape):
    axes = draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, max_size=len(shape), unique=True))
    unit = draw(st.booleans())
    starts, ends, steps = [], [], []
    for a in axes:
        d = shape[a]
        step = 1 if unit else draw(st.sampled_from([1, 2, -1, -2]))
        starts.append(draw(st.integers(-d - 1, d + 1)))
        ends.append(draw(st.integers(-d - 1, d + 1)))
        steps.append(step)
    return axes, starts, ends, steps


@SETTINGS
@given(shape=shapes(1, 3, 5), seed=seeds(), data=st.data())
def test_slice(shape, seed, data):
    axes, starts, ends, steps = data.draw(slice_args(shape))
    x = normal(np.random.default_rng(seed), shape)
    inits = {k: np.array(v, np.int64) for k, v in dict(starts=starts, ends=ends, axes=axes, steps=steps).items()}
    check("shape", node("Slice", ["X", "starts", "ends", "axes", "steps"]), {"X": x}, initializers=inits)


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), data=st.data())
def test_slice_runtime_bounds(shape, seed, data):
    """Starts and ends fed at run time: the scatter-back path."""
    axes, starts, ends, steps = data.draw(slice_args(shape))
    x = normal(np.random.default_rng(seed), shape)
    feeds = {"X": x, "starts": np.array(starts, np.int64), "ends": np.array(ends, np.int64)}
    check("shape", node("Slice", ["X", "starts", "ends", "axes", "steps"]), feeds, wrt=["X"],
          initializers={"axes": np.array(axes, np.int64), "steps": np.array(steps, np.int64)})


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), data=st.data())
def test_gather_of_one_constant_index(shape, seed, data):
    """A constant scalar index (attention's q, k, v = qkv[i]): the gradient pads dY back to X's shape."""
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    index = np.array(data.draw(st.integers(-shape[axis], shape[axis] - 1)), np.int64)
    check("shape", node("Gather", ["X", "I"], axis=axis), {"X": normal(rng, shape)}, initializers={"I": index})


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), index_shape=shapes(0, 2), data=st.data())
def test_gather(shape, seed, index_shape, data):
    """Indices repeat and may be negative: the gradient adds the repeats up."""
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    d = shape[axis]
    indices = rng.integers(-d, d, index_shape).astype(np.int64)
    check("shape", node("Gather", ["X", "I"], axis=axis), {"X": normal(rng, shape), "I": indices})


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), data=st.data())
def test_gather_elements(shape, seed, data):
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(0, len(shape) - 1))
    index_shape = list(shape)
    index_shape[axis] = data.draw(st.integers(1, 4))
    indices = rng.integers(0, shape[axis], index_shape).astype(np.int64)
    check("shape", node("GatherElements", ["X", "I"], axis=axis), {"X": normal(rng, shape), "I": indices})


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), data=st.data())
def test_gather_nd(shape, seed, data):
    rng = np.random.default_rng(seed)
    k = data.draw(st.integers(1, len(shape)))
    n = data.draw(st.integers(1, 4))
    indices = np.stack([rng.integers(0, shape[i], n) for i in range(k)], axis=-1).astype(np.int64)
    check("shape", node("GatherND", ["X", "I"]), {"X": normal(rng, shape), "I": indices})


@SETTINGS
@given(batch=shapes(1, 2, max_side=3), rest=shapes(1, 2), seed=seeds(), data=st.data())
def test_gather_nd_with_batch_dims(batch, rest, seed, data):
    rng = np.random.default_rng(seed)
    k = data.draw(st.integers(1, len(rest)))
    n = data.draw(st.integers(1, 3))
    indices = np.stack([rng.integers(0, rest[i], (*batch, n)) for i in range(k)], axis=-1).astype(np.int64)
    check("shape", node("GatherND", ["X", "I"], batch_dims=len(batch)), {"X": normal(rng, (*batch, *rest)), "I": indices},
          symbolic={"X", "I"})  # the batch dim symbolic, as in a real model


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), reduction=st.sampled_from(["none", "add"]), data=st.data())
def test_scatter_elements(shape, seed, reduction, data):
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(0, len(shape) - 1))
    n = data.draw(st.integers(1, shape[axis]))
    # distinct positions along the axis for every other coordinate: a permutation prefix
    perm = np.argsort(rng.random((*shape[:axis], shape[axis], *shape[axis + 1:])), axis=axis)
    indices = np.take(perm, np.arange(n), axis=axis).astype(np.int64)
    updates = normal(rng, indices.shape)
    check("shape", node("ScatterElements", ["X", "I", "U"], axis=axis, reduction=reduction),
          {"X": normal(rng, shape), "I": indices, "U": updates})


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), data=st.data())
def test_scatter_nd(shape, seed, data):
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(1, shape[0]))
    indices = rng.permutation(shape[0])[:n].reshape(n, 1).astype(np.int64)
    check("shape", node("ScatterND", ["X", "I", "U"]), {"X": normal(rng, shape), "I": indices, "U": normal(rng, (n, *shape[1:]))})


def spaced(rng, shape, offset=0.0):
    """Values at least 0.05 apart (no tie within a finite-difference step), away from 0."""
    size = int(np.prod(shape))
    return (rng.permutation(size) * 0.05 + 0.5 + offset).reshape(shape) * rng.choice([-1.0, 1.0])


@pytest.mark.parametrize("reduction", ["mul", "max", "min"])
@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), duplicates=st.booleans(), data=st.data())
def test_scatter_elements_reductions(reduction, shape, seed, duplicates, data):
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(0, len(shape) - 1))
    n = data.draw(st.integers(1, 3))
    index_shape = (*shape[:axis], n, *shape[axis + 1:])
    indices = rng.integers(0, shape[axis], index_shape) if duplicates else \
        np.take(np.argsort(rng.random(shape), axis=axis), np.arange(min(n, shape[axis])), axis=axis)
    indices = indices.astype(np.int64)
    x = spaced(rng, shape)
    u = spaced(rng, indices.shape, offset=0.025) if reduction != "mul" else rng.uniform(0.5, 1.5, indices.shape)
    check("shape", node("ScatterElements", ["X", "I", "U"], axis=axis, reduction=reduction), {"X": x, "I": indices, "U": u})


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), duplicates=st.booleans(), data=st.data())
def test_scatter_nd_reductions(reduction, shape, seed, duplicates, data):
    rng = np.random.default_rng(seed)
    n = data.draw(st.integers(1, 3))
    rows = rng.integers(0, shape[0], n) if duplicates else rng.permutation(shape[0])[:n]
    indices = rows.reshape(-1, 1).astype(np.int64)
    x = spaced(rng, shape)
    u = spaced(rng, (len(rows), *shape[1:]), offset=0.025) if reduction != "mul" else rng.uniform(0.5, 1.5, (len(rows), *shape[1:]))
    check("shape", node("ScatterND", ["X", "I", "U"], reduction=reduction), {"X": x, "I": indices, "U": u})


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), runtime=st.booleans(), data=st.data())
def test_tile(shape, seed, runtime, data):
    rng = np.random.default_rng(seed)
    repeats = np.array(data.draw(st.lists(st.integers(1, 3), min_size=len(shape), max_size=len(shape))), np.int64)
    feeds = {"X": normal(rng, shape)}
    if runtime:
        check("shape", node("Tile", ["X", "R"]), {**feeds, "R": repeats}, wrt=["X"])
    else:
        check("shape", node("Tile", ["X", "R"]), feeds, initializers={"R": repeats})


@SETTINGS
@given(shape=shapes(1, 3, 5), seed=seeds(), mode=st.sampled_from(["constant", "reflect", "edge", "wrap"]), data=st.data())
def test_pad(shape, seed, mode, data):
    rng = np.random.default_rng(seed)
    rank = len(shape)
    low = {"constant": -1, "reflect": 0, "edge": 0, "wrap": 0}[mode]
    high = 2 if mode != "reflect" else 1
    pads = data.draw(st.lists(st.integers(low, high), min_size=2 * rank, max_size=2 * rank))
    if mode == "reflect" and min(shape) < 2:
        pads = [0] * (2 * rank)
    pads = [max(p, -(shape[i % rank] - 1) // 2) for i, p in enumerate(pads)]
    check("shape", node("Pad", ["X", "pads"], mode=mode), {"X": normal(rng, shape)}, initializers={"pads": np.array(pads, np.int64)})


@SETTINGS
@given(shape=shapes(2, 3), seed=seeds())
def test_pad_axes_and_runtime_pads(shape, seed):
    rng = np.random.default_rng(seed)
    feeds = {"X": normal(rng, shape), "pads": np.array([1, -1 if shape[-1] > 1 else 0, 2, 1], np.int64)}
    check("shape", node("Pad", ["X", "pads", "", "axes"]), feeds, wrt=["X"], initializers={"axes": np.array([0, -1], np.int64)})


@SETTINGS
@given(shape=shapes(1, 3), seed=seeds(), data=st.data())
def test_compress(shape, seed, data):
    rng = np.random.default_rng(seed)
    axis = data.draw(st.sampled_from([None, *range(len(shape))]))
    n = int(np.prod(shape)) if axis is None else shape[axis]
    cond = rng.random(n) > 0.4
    attrs = {} if axis is None else {"axis": axis}
    check("shape", node("Compress", ["X", "C"], **attrs), {"X": normal(rng, shape)}, initializers={"C": cond})


@SETTINGS
@given(batch=st.integers(1, 3), time=st.integers(1, 4), seed=seeds())
def test_reverse_sequence(batch, time, seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, time + 1, batch).astype(np.int64)
    check("shape", node("ReverseSequence", ["X", "L"], batch_axis=1, time_axis=0), {"X": normal(rng, (time, batch, 2)), "L": lens})


@SETTINGS
@given(shape=shapes(2, 3), seed=seeds(), upper=st.integers(0, 1), k=st.integers(-2, 2))
def test_trilu(shape, seed, upper, k):
    check("shape", node("Trilu", ["X", "k"], upper=upper), {"X": normal(np.random.default_rng(seed), shape)}, initializers={"k": np.array(k)})


# ----- losses -----


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@SETTINGS
@given(n=st.integers(1, 4), c=st.integers(2, 4), extra=shapes(0, 2, 2), seed=seeds(),
       reduction=st.sampled_from(["mean", "sum", "none"]), weighted=st.booleans(), ignore=st.sampled_from([None, 0, -1]))
def test_losses(op, n, c, extra, seed, reduction, weighted, ignore):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, c, (n, *extra)).astype(np.int64)
    if ignore is not None:
        labels = np.where(rng.random(labels.shape) < 0.3, ignore, labels)
        labels.reshape(-1)[0] = 1  # at least one counted position keeps 'mean' finite
    inputs = {"S": normal(rng, (n, c, *extra)), "L": labels}
    if weighted:
        inputs["W"] = rng.uniform(0.5, 2, c)
    attrs = {"reduction": reduction} | ({} if ignore is None else {"ignore_index": ignore})
    check("loss", node(op, list(inputs), ["loss_out"], **attrs), inputs, wrt=["S"])


@SETTINGS
@given(n=st.integers(1, 3), c=st.integers(2, 4), seed=seeds())
def test_softmax_cross_entropy_log_prob_output(n, c, seed):
    """Both outputs used: the loss gradient and the log_prob gradient add up."""
    rng = np.random.default_rng(seed)
    inputs = {"S": normal(rng, (n, c)), "L": rng.integers(0, c, n).astype(np.int64)}
    check("loss", node("SoftmaxCrossEntropyLoss", ["S", "L"], ["loss_out", "log_prob"]), inputs, wrt=["S"])


# ----- the walker: broadcasting, fan-out, frozen and integer inputs, coverage -----


@SETTINGS
@given(seed=seeds(), batch=st.integers(1, 3))
def test_fan_out_and_chain(seed, batch):
    """X feeds three nodes; W is used twice; gradients of every path are summed."""
    rng = np.random.default_rng(seed)
    nodes = [
        node("MatMul", ["X", "W"], ["H"]),
        node("Tanh", ["H"], ["T"]),
        node("Mul", ["X", "X"], ["Q"]),
        node("MatMul", ["Q", "W"], ["P"]),
        node("Add", ["T", "P"], ["S"]),
        node("Add", ["S", "X2"], ["Y"]),
        node("Sigmoid", ["X"], ["X2"]),
    ]
    nodes = nodes[:5] + [nodes[6], nodes[5]]
    check("walker", nodes, {"X": normal(rng, (batch, 3)), "W": normal(rng, (3, 3))}, symbolic={"X"})


def _producers_of(nodes, name):
    """The gradient nodes ``name`` is computed from, itself included (walking inputs back)."""
    made = {o: n for n in nodes for o in n.output}
    seen, stack, found = set(), [name], []
    while stack:
        value = stack.pop()
        node = made.get(value)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        stack.extend(node.input)
    return found


@SETTINGS
@given(seed=seeds(), rows=st.lists(st.integers(1, 4), min_size=2, max_size=4), symbolic=st.booleans())
def test_weight_shared_by_products_totals_as_one_gemm(seed, rows, symbolic):
    """W multiplies k inputs (a recurrence's weight at every step): its gradient is one Gemm of the
    stacked inputs and output gradients, not k Gemms and a Sum, and matches finite differences."""
    rng = np.random.default_rng(seed)
    if symbolic:  # one symbolic batch names one size: the steps of a recurrence
        rows = [rows[0]] * len(rows)
    inputs = {f"X{i}": normal(rng, (r, 3)) for i, r in enumerate(rows)}
    nodes = [node("MatMul", [x, "W"], [f"P{i}"]) for i, x in enumerate(inputs)]
    nodes.append(node("Sum", [f"P{i}" for i in range(len(rows))], ["Y"]) if len(set(rows)) == 1 else
                 node("Concat", [f"P{i}" for i in range(len(rows))], ["Y"], axis=0))
    feeds = {**inputs, "W": normal(rng, (3, 5))}
    check("walker", nodes, feeds, symbolic=set(inputs) if symbolic else ())
    loss_model = with_projection_loss(make_model(nodes, feeds), feeds)
    grad_nodes, _, grads = build_gradients(loss_model, "loss", ["W"])
    ops = [n.op_type for n in _producers_of(grad_nodes, grads["W"])]
    assert ops.count("Gemm") == 1, ops
    assert "Sum" not in ops, ops


@SETTINGS
@given(seed=seeds(), cuts=st.sampled_from([(0, 2, 5, 6), (0, 1, 6), (0, 3, 4, 5, 6)]), axis=st.sampled_from([0, 1]),
       order=st.randoms(use_true_random=False))
def test_slices_that_tile_a_tensor_total_as_their_concat(seed, cuts, axis, order):
    """W cut into slices read in another order (an exporter reordering LSTM gates): the zero-padded
    slice gradients tile W, so its gradient is their Concat in place order, with no Pad and no Sum."""
    rng = np.random.default_rng(seed)
    shape = (6, 6)
    parts = list(zip(cuts[:-1], cuts[1:]))
    order.shuffle(parts)
    nodes, names = [], []
    for i in range(len(parts)):
        consts = [f"s{i}", f"e{i}", "axis"]
        nodes.append(node("Slice", ["W", *consts], [f"S{i}"]))
        names.append(f"S{i}")
    nodes.append(node("Concat", names, ["C"], axis=axis))
    nodes.append(node("Mul", ["C", "Z"], ["Y"]))
    inits = {"axis": np.array([axis], np.int64)}
    for i, (lo, hi) in enumerate(parts):
        inits[f"s{i}"], inits[f"e{i}"] = np.array([lo], np.int64), np.array([hi], np.int64)
    feeds = {"W": normal(rng, shape), "Z": normal(rng, shape)}
    check("walker", nodes, feeds, wrt=["W"], initializers=inits)
    loss_model = with_projection_loss(make_model(nodes, feeds, initializers=inits), feeds)
    grad_nodes, _, grads = build_gradients(loss_model, "loss", ["W"])
    ops = [n.op_type for n in _producers_of(grad_nodes, grads["W"])]
    assert "Pad" not in ops, ops
    assert "Sum" not in ops, ops
    assert "Concat" in ops, ops


@SETTINGS
@given(seed=seeds(), cuts=st.sampled_from([((0, 3), (2, 6)), ((0, 2), (3, 6)), ((0, 6), (1, 2))]))
def test_slices_that_overlap_or_leave_gaps_keep_the_sum(seed, cuts):
    """Slices that overlap, or leave part of W unread, do not tile it: their padded gradients are summed."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], {"axis": np.array([0], np.int64)}
    for i, (lo, hi) in enumerate(cuts):
        nodes.append(node("Slice", ["W", f"s{i}", f"e{i}", "axis"], [f"S{i}"]))
        inits[f"s{i}"], inits[f"e{i}"] = np.array([lo], np.int64), np.array([hi], np.int64)
    nodes.append(node("Concat", ["S0", "S1"], ["Y"], axis=0))
    feeds = {"W": normal(rng, (6, 4))}
    check("walker", nodes, feeds, wrt=["W"], initializers=inits)
    loss_model = with_projection_loss(make_model(nodes, feeds, initializers=inits), feeds)
    grad_nodes, _, grads = build_gradients(loss_model, "loss", ["W"])
    ops = [n.op_type for n in _producers_of(grad_nodes, grads["W"])]
    assert ops.count("Pad") == 2, ops
    assert "Sum" in ops, ops


@SETTINGS
@given(seed=seeds())
def test_frozen_parameter_is_skipped(seed):
    """W is an initializer not asked for: no gradient node reads into its gradient."""
    rng = np.random.default_rng(seed)
    model = make_model([node("Gemm", ["X", "W", "B"], ["Y"], transB=1)], {"X": normal(rng, (2, 3))},
                       initializers={"W": normal(rng, (4, 3)), "B": normal(rng, (4,))})
    check_gradients(model, {"X": model_input(model)}, ["B"])
    loss_model = with_projection_loss(model, {"X": model_input(model)})
    nodes, _, grads = build_gradients(loss_model, "loss", ["B"])
    assert set(grads) == {"B"}
    assert not any(n.op_type == "Gemm" for n in nodes), "the frozen W and the input X need no Gemm gradient"


def model_input(model):
    return np.random.default_rng(0).standard_normal([d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim])


def test_parameter_as_initializer():
    rng = np.random.default_rng(1)
    w = normal(rng, (3, 2))
    model = make_model([node("MatMul", ["X", "W"], ["Y"])], {"X": normal(rng, (2, 3))}, initializers={"W": w})
    check_gradients(model, {"X": model_input(model)}, ["W"], params={"W": w})


def test_unused_parameter_gets_zero_gradient():
    rng = np.random.default_rng(2)
    model = make_model([node("Relu", ["X"], ["Y"])], {"X": normal(rng, (2, 3)), "U": normal(rng, (4,))}, outputs=["Y"])
    loss_model = with_projection_loss(model, {"X": normal(rng, (2, 3)), "U": normal(rng, (4,))})
    nodes, inits, grads = build_gradients(loss_model, "loss", ["X", "U"])
    zero = [n for n in nodes if grads["U"] in n.output]
    assert zero
    assert zero[0].op_type == "ConstantOfShape"


def test_bias_unbroadcast_with_symbolic_batch_is_static():
    """The batch axis is the same symbol on both sides: plain ReduceSum with constant axes."""
    model = make_model([node("Add", ["X", "B"], ["H"]), node("ReduceSum", ["H"], ["L"], keepdims=0)],
                       {"X": np.zeros((3, 4)), "B": np.zeros(4)}, symbolic={"X"})
    nodes, inits, grads = build_gradients(model, "L", ["B"])
    ops = [n.op_type for n in nodes]
    assert "Compress" not in ops, ops
    assert "Equal" not in ops, ops  # no run-time axis search
    assert ops.count("ReduceSum") == 1


def test_gemm_and_relu_gradients_are_lean():
    """Gemm's gradients are Gemms (no Transpose); Relu's mask comes from the forward output."""
    model = make_model([node("Gemm", ["X", "W", "B"], ["H"], transB=1), node("Relu", ["H"], ["R"]), node("ReduceSum", ["R"], ["L"], keepdims=0)],
                       {"X": np.zeros((3, 4)), "W": np.zeros((5, 4)), "B": np.zeros(5)}, symbolic={"X"})
    nodes, _, _ = build_gradients(model, "L", ["X", "W", "B"])
    ops = [n.op_type for n in nodes]
    assert "Transpose" not in ops, ops
    assert ops.count("Gemm") == 2, ops
    mask = next(n for n in nodes if n.op_type == "Greater")
    assert mask.input[0] == "R"


def test_integer_parameter_is_rejected():
    model = make_model([node("Gather", ["X", "I"], ["Y"])], {"X": np.zeros((3, 2)), "I": np.zeros(2, np.int64)})
    with pytest.raises(GradientError, match="not floating-point"):
        build_gradients(model, "Y", ["I"])


def test_missing_rules_are_listed_all_at_once():
    model = make_model(
        [node("Det", ["X"], ["D1"]), node("Det", ["X"], ["D2"]), node("MeanVarianceNormalization", ["X"], ["N"], axes=[0, 1]), node("Add", ["D1", "D2"], ["S"]),
         node("ReduceSum", ["N"], ["R"], keepdims=0), node("Add", ["S", "R"], ["Y"])],
        {"X": np.ones((3, 3))})
    missing = missing_gradients(model, ["X"])
    assert {op for (_, op, _) in missing} == {"Det", "MeanVarianceNormalization"}
    assert sorted(missing[("", "Det", 21)]) == ["Det_D1", "Det_D2"]
    with pytest.raises(UnsupportedOpError) as info:
        build_gradients(model, "Y", ["X"])
    assert "Det" in str(info.value)
    assert "MeanVarianceNormalization" in str(info.value)
    assert "Det_D2" in str(info.value)


def test_rule_failures_are_listed_all_at_once():
    # Resize is differentiated only for constant scales; here they are computed
    nodes = [node("Abs", ["S"], ["T"]), node("Resize", ["X", "", "T"], ["A"]), node("Resize", ["X", "", "T"], ["B"]), node("Add", ["A", "B"])]
    model = make_model(nodes, {"X": np.ones((1, 1, 2, 2)), "S": np.full(4, 2.0)})
    with pytest.raises(GradientError) as info:
        build_gradients(model, "Y", ["X"])
    assert "Resize_A" in str(info.value)
    assert "Resize_B" in str(info.value)


def test_off_path_nodes_need_no_rule():
    """Det only sees a frozen input: it is not on the differentiable path."""
    model = make_model([node("Det", ["F"], ["D"]), node("Mul", ["X", "D"])], {"X": np.ones((2, 2)), "F": np.eye(2)})
    assert missing_gradients(model, ["X"]) == {}
    check_gradients(model, {"X": np.arange(4.0).reshape(2, 2), "F": np.eye(2) * 2}, ["X"])


def test_gradient_names_and_old_opsets():
    model = make_model([node("Relu", ["X"], ["Y"])], {"X": np.ones((2, 2))})
    _, _, grads = build_gradients(model, "Y", ["X"], grad_names={"X": "dX"})
    assert grads == {"X": "dX"}
    old = make_model([node("Relu", ["X"], ["Y"])], {"X": np.ones((2, 2))}, opset=13)
    with pytest.raises(GradientError, match="opset"):
        build_gradients(old, "Y", ["X"])


def test_registry_lists_the_priority_ops():
    wanted = set(["Add", "Sub", "Mul", "Div", "Neg", "Pow", "Sqrt", "Exp", "Log", "Abs", "Reciprocal", "Tanh", "Sigmoid", "Relu", "LeakyRelu", "Elu", "Selu", "Softplus", "Erf", "Gelu", "Mish", "HardSigmoid", "HardSwish", "PRelu", "Sin", "Cos", "Atan", "Clip", "Where", "Max", "Min", "Sum", "Mean", "Cast", "Identity", "Dropout", "MatMul", "Gemm", "Einsum", "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceLogSumExp", "CumSum", "Softmax", "LogSoftmax", "Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Concat", "Split", "Slice", "Gather", "GatherElements", "GatherND", "Expand", "Tile", "Pad", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
    assert wanted <= set(registered_gradients()), sorted(wanted - set(registered_gradients()))


def test_loss_must_depend_on_a_parameter():
    model = make_model([node("Relu", ["X"], ["Y"]), node("Relu", ["Z"], ["L"])], {"X": np.ones((2, 2)), "Z": np.ones((2, 2))}, outputs=["Y", "L"])
    with pytest.raises(GradientError, match="does not depend"):
        build_gradients(model, "L", ["X"])


def test_optional_forward_outputs_are_added_and_named():
    """Dropout's mask is reused, not recomputed: the forward node gains a readable output."""
    model = make_model([node("Dropout", ["X", "", "T"], ["Y"])], {"X": np.ones((2, 2))}, initializers={"T": np.array(True)})
    nodes, _, _ = build_gradients(model, "Y", ["X"])
    forward = model.graph.node[0]
    assert list(forward.output) == ["Y", "Dropout_Y/mask"]
    assert any("Dropout_Y/mask" in n.input for n in nodes)


# ----- a second executor: the gradient graphs are plain ONNX, so onnxruntime runs them too -----


def _mlp(rng):
    nodes = [node("Gemm", ["X", "W1", "B1"], ["H"], transB=1), node("Relu", ["H"], ["R"]),
             node("Gemm", ["R", "W2", "B2"], ["S"]), node("SoftmaxCrossEntropyLoss", ["S", "L"], ["Y"])]
    feeds = {"X": rng.standard_normal((4, 3)), "W1": rng.standard_normal((5, 3)), "B1": rng.standard_normal(5),
             "W2": rng.standard_normal((5, 2)), "B2": rng.standard_normal(2), "L": rng.integers(0, 2, 4)}
    return nodes, feeds, ["W1", "B1", "W2", "B2"]


def _elementwise(rng):
    nodes = [node("Mul", ["X", "A"], ["M"]), node("Div", ["M", "P"], ["D"]), node("Sigmoid", ["D"], ["S"]),
             node("Pow", ["P", "A"], ["Q"]), node("Sub", ["S", "Q"], ["T"]), node("Max", ["T", "X"], ["U"]),
             node("Where", ["C", "U", "A"], ["V"]), node("Clip", ["V", "lo"], ["Y"])]
    feeds = {"X": rng.standard_normal((3, 4)), "A": rng.standard_normal(4), "P": rng.uniform(0.5, 2, (1, 4)),
             "C": rng.random((3, 4)) > 0.5, "lo": np.array(-0.3)}
    return nodes, feeds, ["X", "A", "P"]


def _shapes(rng):
    nodes = [node("Reshape", ["X", "s"], ["R"]), node("Transpose", ["R"], ["T"], perm=[1, 0, 2]),
             node("Slice", ["T", "st", "en", "ax", "sp"], ["S"]), node("Pad", ["S", "pads"], ["P"], mode="reflect"),
             node("Gather", ["P", "idx"], ["G"], axis=2), node("Concat", ["G", "G"], ["C"], axis=0),
             node("Softmax", ["C"], ["Y"], axis=1)]
    feeds = {"X": rng.standard_normal((2, 12)), "s": np.array([2, 3, 4]), "st": np.array([3]), "en": np.array([-5]),
             "ax": np.array([2]), "sp": np.array([-1]), "pads": np.array([0, 0, 1, 0, 0, 2]), "idx": np.array([0, 2, 2, 1])}
    return nodes, feeds, ["X"]


@pytest.mark.parametrize("build", [_mlp, _elementwise, _shapes], ids=["mlp", "elementwise", "shapes"])
def test_gradient_graphs_run_in_onnxruntime(build):
    ort = pytest.importorskip("onnxruntime")
    from tests.odt_ops.gradcheck import compile_model, training_model

    nodes, feeds, wrt = build(np.random.default_rng(0))
    feeds = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds.items()}
    model = make_model(nodes, feeds, symbolic={"X"})
    full, grads = training_model(with_projection_loss(model, feeds), wrt)
    names = ["loss", *[grads[p] for p in wrt]]
    ours = compile_model(full, list(feeds), names)(feeds)
    session = ort.InferenceSession(full.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = session.run(names, feeds)
    for name, a, b in zip(names, ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_parameter_read_only_inside_a_subgraph_is_on_the_gradient_path():
    """An If whose branches read W by name (no input of the node) depends on W: left as a node
    (not lowered at load), it is reported as lacking a rule, never given a silent zero gradient."""
    from onnx import TensorProto

    then_branch = helper.make_graph([helper.make_node("Mul", ["X", "W"], ["t"])], "then", [],
                                    [helper.make_tensor_value_info("t", TensorProto.DOUBLE, [2, 2])])
    else_branch = helper.make_graph([helper.make_node("Identity", ["X"], ["e"])], "else", [],
                                    [helper.make_tensor_value_info("e", TensorProto.DOUBLE, [2, 2])])
    model = make_model([node("If", ["C"], ["Y"], then_branch=then_branch, else_branch=else_branch)],
                       {"X": np.ones((2, 2)), "W": np.ones((2, 2)), "C": np.array(True)})
    with pytest.raises(UnsupportedOpError, match="If"):
        build_gradients(model, "Y", ["W"])
