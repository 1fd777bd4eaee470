"""Reduce, linalg and loss kernels against onnxruntime, on one-node models with random shapes."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

import odt_ops
from odt_ops.errors import KernelError, LabelError

SETTINGS = settings(deadline=None, max_examples=25)


def one_node_model(op: str, feeds: dict[str, np.ndarray | None], attrs: dict, opset: int, n_outputs: int = 1) -> onnx.ModelProto:
    """A model of one ``op`` node; a feed of None is an omitted optional input."""
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in feeds.items() if a is not None]
    outputs = [helper.make_value_info(f"out{i}", onnx.TypeProto()) for i in range(n_outputs)]
    node = helper.make_node(op, [n if a is not None else "" for n, a in feeds.items()], [o.name for o in outputs], **attrs)
    model = helper.make_model(helper.make_graph([node], op, inputs, outputs), opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    return onnx.shape_inference.infer_shapes(model)  # fills in the outputs' element types


def ort_run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v for k, v in feeds.items() if v is not None})


def odt_run(model: onnx.ModelProto, feeds: dict, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for value, shape in zip(model.graph.output, shapes):  # onnx.checker wants output shapes
        value.type.tensor_type.ClearField("shape")
        value.type.tensor_type.shape.SetInParent()  # a scalar has a shape with no dims
        for d in shape:
            value.type.tensor_type.shape.dim.add().dim_value = d
    with np.errstate(all="ignore"):
        return odt_ops.InferenceSession(model, normalize=False).run(None, {k: v for k, v in feeds.items() if v is not None})


def check(op: str, feeds: dict, attrs: dict | None = None, *, opset: int, n_outputs: int = 1,
          rtol: float = 1e-5, atol: float = 1e-6, ort_model: onnx.ModelProto | None = None) -> list[np.ndarray]:
    """Run the node through both engines and compare dtype, shape and values."""
    model = one_node_model(op, feeds, attrs or {}, opset, n_outputs)
    want = ort_run(ort_model or model, feeds)
    got = odt_run(model, feeds, [w.shape for w in want])
    for g, w in zip(got, want):
        assert g.dtype == w.dtype, f"dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"shape {g.shape} != {w.shape}"
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    return got


def rand(rng: np.random.Generator, shape, dtype=np.float32, low=-2.0, high=2.0) -> np.ndarray:
    return rng.uniform(low, high, size=shape).astype(dtype)


seeds = st.integers(0, 2**32 - 1)
dims = st.integers(1, 5)


# ---------------------------------------------------------------------------- Gemm / MatMul

C_SHAPES = {
    "none": None,
    "scalar": lambda m, n: (),
    "single": lambda m, n: (1,),
    "row": lambda m, n: (n,),
    "row2d": lambda m, n: (1, n),
    "col": lambda m, n: (m, 1),
    "full": lambda m, n: (m, n),
}


@pytest.mark.parametrize("c_kind", list(C_SHAPES))
@pytest.mark.parametrize("transB", [0, 1])
@pytest.mark.parametrize("transA", [0, 1])
@SETTINGS
@given(seed=seeds, m=dims, k=dims, n=dims,
       alpha=st.sampled_from([1.0, 0.5, -1.75, 0.0]), beta=st.sampled_from([1.0, 2.5, -0.5, 0.0]),
       opset=st.sampled_from([7, 9, 11, 13]))
def test_gemm(transA, transB, c_kind, seed, m, k, n, alpha, beta, opset):
    rng = np.random.default_rng(seed)
    shape_c = C_SHAPES[c_kind]
    if shape_c is None:
        opset = max(opset, 11)  # C became optional in opset 11
    feeds = {"A": rand(rng, (k, m) if transA else (m, k)), "B": rand(rng, (n, k) if transB else (k, n))}
    if shape_c is not None:
        feeds["C"] = rand(rng, shape_c(m, n))
    check("Gemm", feeds, dict(alpha=alpha, beta=beta, transA=transA, transB=transB), opset=opset)


@SETTINGS
@given(seed=seeds, m=dims, k=dims, n=dims, transA=st.integers(0, 1), transB=st.integers(0, 1),
       c_kind=st.sampled_from(["scalar", "row", "col", "full"]))
def test_gemm_legacy_broadcast_attribute(seed, m, k, n, transA, transB, c_kind):
    # onnxruntime has no opset-6 Gemm: compare with its opset-7 form, which always broadcasts
    rng = np.random.default_rng(seed)
    feeds = {"A": rand(rng, (k, m) if transA else (m, k)), "B": rand(rng, (n, k) if transB else (k, n)), "C": rand(rng, C_SHAPES[c_kind](m, n))}
    attrs = dict(alpha=0.5, beta=2.0, transA=transA, transB=transB)
    check("Gemm", feeds, {**attrs, "broadcast": 1}, opset=6, ort_model=one_node_model("Gemm", feeds, attrs, 7))


def test_gemm_legacy_without_broadcast_needs_full_c():
    feeds = {"A": np.ones((2, 3), np.float32), "B": np.ones((3, 4), np.float32), "C": np.ones((4,), np.float32)}
    with pytest.raises(KernelError, match="broadcast=0"):
        odt_run(one_node_model("Gemm", feeds, {}, 6), feeds, [(2, 4)])


MATMUL_SHAPES = [((3,), (3,)), ((3,), (3, 4)), ((2, 3), (3,)), ((2, 3), (3, 4)), ((5, 2, 3), (3, 4)),
                 ((2, 3), (5, 3, 4)), ((2, 1, 2, 3), (5, 3, 4)), ((4,), (2, 5, 4, 3))]


@SETTINGS
@given(seed=seeds, shapes=st.sampled_from(MATMUL_SHAPES), dtype=st.sampled_from([np.float32, np.float64, np.int32]))
def test_matmul(seed, shapes, dtype):
    rng = np.random.default_rng(seed)
    a, b = (rand(rng, s, np.float32, -3, 3).round().astype(dtype) for s in shapes)
    check("MatMul", {"A": a, "B": b}, opset=13)


# ---------------------------------------------------------------------------- Einsum

EINSUM = {  # equation -> operand shapes, as functions of three sizes
    "bij,bjk->bik": lambda p, q, r: [(p, q, r), (p, r, q)],
    "bij, bjk -> bik": lambda p, q, r: [(p, q, r), (p, r, q)],
    "ij->ji": lambda p, q, r: [(p, q)],
    "ii->": lambda p, q, r: [(q, q)],
    "ii": lambda p, q, r: [(q, q)],
    "ij,jk": lambda p, q, r: [(p, q), (q, r)],
    "i,i": lambda p, q, r: [(p,), (p,)],
    "i,j->ij": lambda p, q, r: [(p,), (q,)],
    "...ij,...jk->...ik": lambda p, q, r: [(2, p, q, r), (2, p, r, q)],
    "...ii->...i": lambda p, q, r: [(p, r, r)],
    "bhqd,bhkd->bhqk": lambda p, q, r: [(2, p, q, r), (2, p, p, r)],
    "ij->": lambda p, q, r: [(p, q)],
    "Ab,bc->Ac": lambda p, q, r: [(p, q), (q, r)],
    "nchw,nchw->c": lambda p, q, r: [(p, q, r, 2), (p, q, r, 2)],  # a normalization's sums of products
    "ab, ab -> b": lambda p, q, r: [(p, q), (p, q)],
    "nch,nch->nc": lambda p, q, r: [(p, q, r), (p, q, r)],  # per-row sums of products: one BLAS dot per row
    "nchw,nchw->nc": lambda p, q, r: [(p, q, r, 3), (p, q, r, 3)],
}


@SETTINGS
@given(seed=seeds, equation=st.sampled_from(list(EINSUM)), p=dims, q=dims, r=dims)
def test_einsum(seed, equation, p, q, r):
    rng = np.random.default_rng(seed)
    feeds = {f"x{i}": rand(rng, s) for i, s in enumerate(EINSUM[equation](p, q, r))}
    check("Einsum", feeds, dict(equation=equation), opset=12, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("equation", ["nchw,nchw->c", "ab, ab -> b", "nch,nch->nc", "nchw,nchw->nc"])
def test_einsum_of_same_label_operands(equation):
    """The form that skips numpy's optimized path (a normalization's per-channel sums of products),
    on a batch large enough for the sums to be long (the per-row forms, from 64 elements a row, as
    BLAS dot products)."""
    rng = np.random.default_rng(5)
    feeds = {f"x{i}": rand(rng, s) for i, s in enumerate(EINSUM[equation](8, 16, 64))}
    check("Einsum", feeds, dict(equation=equation), opset=12, rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------------------- losses


@st.composite
def loss_case(draw):
    rng = np.random.default_rng(draw(seeds))
    n, c = draw(dims), draw(st.integers(2, 5))
    spatial = draw(st.sampled_from([(), (3,), (2, 3)]))  # 2-D, 3-D and 4-D scores
    labels = rng.integers(0, c, size=(n, *spatial)).astype(draw(st.sampled_from([np.int64, np.int32])))
    ignore = draw(st.sampled_from([None, "class", -1]))
    attrs = {"reduction": draw(st.sampled_from(["none", "sum", "mean"]))}
    if ignore is not None:
        attrs["ignore_index"] = int(rng.integers(0, c)) if ignore == "class" else -1
        labels.reshape(-1)[:: 3] = attrs["ignore_index"]  # ignored positions, at least one
    weights = rand(rng, (c,), low=0.1, high=2.0) if draw(st.booleans()) else None
    return rand(rng, (n, c, *spatial), low=-4, high=4), labels, weights, attrs


@SETTINGS
@given(case=loss_case(), log_prob=st.booleans())
def test_softmax_cross_entropy_loss(case, log_prob):
    scores, labels, weights, attrs = case
    check("SoftmaxCrossEntropyLoss", {"scores": scores, "labels": labels, "weights": weights}, attrs,
          opset=13, n_outputs=2 if log_prob else 1, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(case=loss_case())
def test_negative_log_likelihood_loss(case):
    scores, labels, weights, attrs = case
    check("NegativeLogLikelihoodLoss", {"input": scores, "target": labels, "weight": weights}, attrs, opset=13)


def test_labels_out_of_range_are_rejected():
    feeds = {"scores": np.zeros((2, 3), np.float32), "labels": np.array([0, 3], np.int64)}
    with pytest.raises(LabelError, match=r"label 3 at position \[1\] is outside \[0, 3\)"):
        odt_run(one_node_model("SoftmaxCrossEntropyLoss", feeds, {}, 13), feeds, [()])


# ---------------------------------------------------------------------------- reductions

REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape", "axes"), [
    ((64, 8, 28, 28), (0, 2, 3)), ((64, 8, 28, 28), (2, 3)), ((64, 8, 28, 28), (1, 2, 3)), ((8, 64, 784), (0, 2)),
    ((2000, 3, 100), (1, 2)), ((300, 7, 40), (0, 2)), ((40, 30, 50), (0, 1, 2)), ((3, 70000), (1,)),
    ((600, 7, 40), (1, 2)), ((600, 7, 40), (0, 2)),  # more leading rows than one gemv each: numpy sums
])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean"])
def test_reduce_sum_by_gemv_matches_numpy(dtype, shape, axes, keepdims, op):
    """Large float sums over a trailing axis go through gemv with ones: same shape and dtype as numpy,
    values within float rounding of an exact float64 sum (and fallbacks where gemv does not apply)."""
    from odt_ops.kernels.reduce import reduce_mean, reduce_sum

    X = np.random.default_rng(sum(shape)).standard_normal(shape).astype(dtype)
    (got,) = (reduce_sum if op == "ReduceSum" else reduce_mean)(X, np.array(axes), keepdims=keepdims)
    exact = (np.sum if op == "ReduceSum" else np.mean)(X.astype(np.float64), axis=axes, keepdims=bool(keepdims))
    assert got.dtype == dtype
    assert got.shape == exact.shape
    count = X.size // exact.size
    scale = np.sqrt(count) if op == "ReduceSum" else 1 / np.sqrt(count)  # the spread of a sum of N(0, 1)
    np.testing.assert_allclose(got, exact, rtol=0, atol=scale * (3e-6 if dtype == np.float32 else 1e-14) * 10)


@st.composite
def reduce_case(draw):
    rng = np.random.default_rng(draw(seeds))
    shape = tuple(draw(st.lists(dims, min_size=1, max_size=4)))
    axes = draw(st.lists(st.integers(0, len(shape) - 1), unique=True, max_size=len(shape)))
    axes = [a - len(shape) if draw(st.booleans()) else a for a in axes]  # negative axes too
    # positive data keeps ReduceLogSum defined
    return rand(rng, shape, low=0.25, high=1.5), axes, draw(st.integers(0, 1))


@SETTINGS
@given(op=st.sampled_from(REDUCE_OPS), case=reduce_case(), noop=st.integers(0, 1))
def test_reduce_axes_input(op, case, noop):
    data, axes, keepdims = case
    opset = 13 if op == "ReduceSum" else 18
    feeds = {"data": data, "axes": np.array(axes, np.int64)}
    check(op, feeds, dict(keepdims=keepdims, noop_with_empty_axes=noop), opset=opset, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(op=st.sampled_from(REDUCE_OPS), case=reduce_case())
def test_reduce_axes_attribute(op, case):
    data, axes, keepdims = case
    attrs = dict(keepdims=keepdims, **({"axes": axes} if axes else {}))
    check(op, {"data": data}, attrs, opset=11, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_default_axes_input_omitted(op):
    data = rand(np.random.default_rng(0), (2, 3, 4), low=0.25, high=1.5)
    check(op, {"data": data}, dict(keepdims=0), opset=13 if op == "ReduceSum" else 18, rtol=1e-5)


# ---------------------------------------------------------------------------- ArgMax, TopK, CumSum, softmax


@SETTINGS
@given(op=st.sampled_from(["ArgMax", "ArgMin"]), seed=seeds, shape=st.lists(dims, min_size=1, max_size=4),
       axis=st.integers(-4, 3), keepdims=st.integers(0, 1), last=st.integers(0, 1))
def test_arg_max_min_ties(op, seed, shape, axis, keepdims, last):
    data = np.random.default_rng(seed).integers(0, 3, size=shape).astype(np.float32)  # many ties
    axis = axis % len(shape)
    check(op, {"data": data}, dict(axis=axis, keepdims=keepdims, select_last_index=last), opset=13)


@SETTINGS
@given(seed=seeds, shape=st.lists(dims, min_size=1, max_size=3), axis=st.integers(-3, 2),
       largest=st.integers(0, 1), opset=st.sampled_from([10, 11]), dtype=st.sampled_from([np.float32, np.int64]))
def test_top_k_ties(seed, shape, axis, largest, opset, dtype):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 3, size=shape).astype(dtype if opset >= 11 else np.float32)  # integer X from opset 11
    axis = axis % len(shape)
    k = np.array([rng.integers(0, shape[axis] + 1)], np.int64)
    attrs = dict(axis=axis) if opset == 10 else dict(axis=axis, largest=largest)
    check("TopK", {"X": x, "K": k}, attrs, opset=opset, n_outputs=2)


def test_top_k_opset1_attribute():
    x = np.array([[3, 1, 3, 2], [0, 5, 5, 1]], np.float32)
    values, indices = odt_run(one_node_model("TopK", {"X": x}, dict(k=3), 1, 2), {"X": x}, [(2, 3), (2, 3)])
    np.testing.assert_array_equal(indices, [[0, 2, 3], [1, 2, 3]])
    np.testing.assert_array_equal(values, [[3, 3, 2], [5, 5, 1]])


@SETTINGS
@given(seed=seeds, shape=st.lists(dims, min_size=1, max_size=3), axis=st.integers(-3, 2),
       exclusive=st.integers(0, 1), reverse=st.integers(0, 1), dtype=st.sampled_from([np.float32, np.int32, np.int64]))
def test_cum_sum(seed, shape, axis, exclusive, reverse, dtype):
    x = np.random.default_rng(seed).integers(-5, 5, size=shape).astype(dtype)
    axis = np.array(axis % len(shape), np.int64)
    check("CumSum", {"x": x, "axis": axis}, dict(exclusive=exclusive, reverse=reverse), opset=14)


@SETTINGS
@given(op=st.sampled_from(["Softmax", "LogSoftmax", "Hardmax"]), seed=seeds, shape=st.lists(dims, min_size=1, max_size=4),
       axis=st.integers(-4, 3), opset=st.sampled_from([11, 13]))
def test_softmax_family(op, seed, shape, axis, opset):
    # opset 11 coerces the input to 2-D at axis; opset 13 normalizes along axis only
    rng = np.random.default_rng(seed)
    x = rand(rng, shape, low=-30, high=30)
    if op == "Hardmax":
        x = x.round()  # ties: the first maximum wins
    check(op, {"input": x}, dict(axis=axis % len(shape)), opset=opset, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_lp_normalization_keeps_zero_vectors_zero(p, axis):
    # onnx.reference sums x**p (not |x|**p) for p = 1, so onnxruntime is the oracle here
    x = rand(np.random.default_rng(p), (3, 4, 5))
    x[1, 2, :] = 0
    x[0, :, 1] = 0
    x[:, 0, 0] = 0
    got = check("LpNormalization", {"x": x}, {"axis": axis, "p": p}, opset=21)
    assert np.isfinite(got[0]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
def test_shrink_of_every_numeric_type(dtype):
    x = np.arange(-6, 7).astype(dtype) / (1 if np.dtype(dtype).kind == "i" else 2)
    check("Shrink", {"x": x.astype(dtype)}, {"bias": 1.5, "lambd": 1.5}, opset=21)


@given(seed=seeds, rows=st.integers(1, 300), cols=st.integers(1, 40), axis=st.sampled_from([0, 1, -1]),
       dtype=st.sampled_from([np.float32, np.float64]))
@SETTINGS
def test_sums_over_rows_and_down_columns(seed, rows, cols, axis, dtype):
    # the gemv paths (short rows of a softmax, a bias gradient's batch) against onnxruntime's sums
    x = rand(np.random.default_rng(seed), (rows, cols), dtype)
    check("ReduceSum", {"x": x, "axes": np.array([axis], np.int64)}, {"keepdims": 1}, opset=13, rtol=1e-5, atol=1e-5)
    check("Softmax", {"x": x}, {"axis": axis}, opset=13)
    check("LogSoftmax", {"x": x}, {"axis": axis}, opset=13, atol=1e-5)
