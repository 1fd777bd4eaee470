"""Shape and indexing kernels against numpy and onnxruntime, beyond the spec's node cases.

The spec's cases pin a handful of fixed inputs; these draw random slice bounds, mix
negative indices into every gather/scatter, and push Reshape's 0/-1 rules, each on a
one-node model run through both engines.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import helper

import odt_ops
from odt_ops.kernels import shape as shape_kernels

OPSET = 18
INT64_MAX = np.iinfo(np.int64).max
INT64_MIN = np.iinfo(np.int64).min


def one_node(op: str, inputs: list[np.ndarray], n_outputs: int = 1, **attrs) -> tuple[onnx.ModelProto, dict]:
    """A model of one ``op`` node whose inputs are all graph inputs; output types are inferred."""
    names = [f"in{i}" for i in range(len(inputs))]
    graph = helper.make_graph(
        [helper.make_node(op, names, [f"out{i}" for i in range(n_outputs)], **attrs)],
        op.lower(),
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(names, inputs)],
        [helper.make_empty_tensor_value_info(f"out{i}") for i in range(n_outputs)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True), dict(zip(names, inputs))


def run_odt(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return odt_ops.InferenceSession(model, normalize=False).run(None, feeds)


def run_ort(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype, f"{g.dtype}{g.shape} != {w.dtype}{w.shape}"
        assert g.shape == w.shape, f"{g.dtype}{g.shape} != {w.dtype}{w.shape}"
        np.testing.assert_array_equal(g, w)


def check_against_ort(op: str, inputs: list[np.ndarray], **attrs) -> list[np.ndarray]:
    model, feeds = one_node(op, inputs, **attrs)
    snapshot = [a.copy() for a in inputs]
    got = run_odt(model, feeds)
    assert_same(got, run_ort(model, feeds))
    for before, after in zip(snapshot, inputs):
        np.testing.assert_array_equal(before, after, err_msg=f"{op} mutated an input")
    return got


def ints(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# ---------------------------------------------------------------- Slice

bounds = st.one_of(st.integers(-9, 9), st.sampled_from([INT64_MIN, INT64_MAX, INT64_MIN + 1, INT64_MAX - 1]))


@st.composite
def slice_cases(draw):
    shape = draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))
    rank = len(shape)
    axes = draw(st.permutations(list(range(rank))))[: draw(st.integers(1, rank))]
    axes = [a - rank if draw(st.booleans()) else a for a in axes]  # negative axes count from the back
    starts = [draw(bounds) for _ in axes]
    ends = [draw(bounds) for _ in axes]
    steps = [draw(st.sampled_from([-3, -2, -1, 1, 2, 3])) for _ in axes]
    omit_steps = draw(st.booleans())
    if omit_steps:
        steps = [1] * len(axes)
    data = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    inputs = [data, ints(*starts), ints(*ends), ints(*axes)] + ([] if omit_steps else [ints(*steps)])
    return data, axes, starts, ends, steps, inputs


@settings(deadline=None, max_examples=50)
@given(slice_cases())
def test_slice_matches_numpy_slicing(case):
    data, axes, starts, ends, steps, inputs = case
    # the one place ONNX and Python disagree: stepping backwards from before the front,
    # ONNX clamps start to 0 (keeping element 0) where Python yields nothing
    assume(not any(st < 0 and s + data.shape[a] < 0 for a, s, st in zip(axes, starts, steps)))
    index = [slice(None)] * data.ndim
    for a, s, e, step in zip(axes, starts, ends, steps):
        index[a] = slice(s, e, step)
    model, feeds = one_node("Slice", inputs)
    (got,) = run_odt(model, feeds)
    assert_same([got], [data[tuple(index)]])
    if got.size:  # the kernel itself hands out a view (sessions copy outputs that alias feeds)
        assert np.shares_memory(shape_kernels.slice_(*inputs)[0], data), "Slice should return a view"


@settings(deadline=None, max_examples=50)
@given(slice_cases())
def test_slice_matches_onnxruntime(case):
    _, _, _, ends, steps, inputs = case
    # onnxruntime reads end == INT_MAX as "to the far end" even when stepping backwards;
    # the spec (and onnx.reference) clamp it to dim - 1 like any other large end
    assume(not any(st < 0 and e in (INT64_MAX, 2**31 - 1) for e, st in zip(ends, steps)))
    check_against_ort("Slice", inputs)


def test_slice_backwards_from_before_the_front_keeps_element_zero():
    data = np.arange(5, dtype=np.float32)
    (got,) = check_against_ort("Slice", [data, ints(-8), ints(-10), ints(0), ints(-1)])
    assert got.tolist() == [0.0]


# ---------------------------------------------------------------- Gather family, negative indices

rng = np.random.default_rng(0)


def negative_mix(shape: tuple[int, ...], dim: int) -> np.ndarray:
    """Indices in [-dim, dim): about half of them negative."""
    return rng.integers(-dim, dim, size=shape).astype(np.int64)


@pytest.mark.parametrize(
    ("data_shape", "axis", "indices_shape"),
    [((5,), 0, ()), ((5,), 0, (7,)), ((4, 3), 0, (2, 3)), ((4, 3), 1, (5,)), ((4, 3), -1, ()),
     ((2, 5, 3), 1, (2, 2)), ((2, 5, 3), -2, (4,)), ((3, 4, 2), 2, ())],
)
def test_gather_negative_indices(data_shape, axis, indices_shape):
    data = rng.standard_normal(data_shape).astype(np.float32)
    check_against_ort("Gather", [data, negative_mix(indices_shape, data_shape[axis])], axis=axis)


@pytest.mark.parametrize(
    ("data_shape", "axis", "indices_shape"),
    [((5,), 0, (7,)), ((4, 3), 0, (6, 3)), ((4, 3), 1, (4, 5)), ((4, 3), -1, (2, 2)),
     ((3, 4, 5), 1, (2, 6, 5)), ((3, 4, 5), -3, (4, 1, 3))],
)
def test_gather_elements_negative_indices(data_shape, axis, indices_shape):
    # indices may be smaller than data off the axis (the last two cases)
    data = rng.standard_normal(data_shape).astype(np.float32)
    check_against_ort("GatherElements", [data, negative_mix(indices_shape, data_shape[axis])], axis=axis)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize(("data_shape", "axis", "indices_shape"), [((6,), 0, (4,)), ((4, 5), 1, (3, 3)), ((3, 4, 2), -2, (3, 2, 2))])
def test_scatter_elements_negative_indices(reduction, data_shape, axis, indices_shape):
    data = rng.standard_normal(data_shape).astype(np.float32)
    dim = data_shape[axis]
    if reduction == "none":
        # without a reduction duplicates are undefined: distinct indices per line, half negated
        full = list(indices_shape)
        full[axis] = dim
        distinct = np.argsort(rng.random(full), axis=axis)
        indices = np.take(distinct, np.arange(indices_shape[axis]), axis=axis)
        indices = np.where(rng.random(indices.shape) < 0.5, indices - dim, indices).astype(np.int64)
    else:
        indices = negative_mix(indices_shape, dim)  # duplicates included on purpose
    updates = rng.standard_normal(indices_shape).astype(np.float32)
    check_against_ort("ScatterElements", [data, indices, updates], axis=axis, reduction=reduction)


@pytest.mark.parametrize(
    ("data_shape", "indices_shape", "batch_dims"),
    [((5,), (3, 1), 0), ((4, 3), (2, 2), 0), ((4, 3), (2, 5, 1), 0), ((2, 4, 3), (2, 1), 1),
     ((2, 4, 3), (2, 3, 2), 1), ((2, 3, 4, 5), (2, 3, 2, 1), 2)],
)
def test_gather_nd_negative_indices(data_shape, indices_shape, batch_dims):
    data = rng.standard_normal(data_shape).astype(np.float32)
    k = indices_shape[-1]
    cols = [negative_mix(indices_shape[:-1], data_shape[batch_dims + j]) for j in range(k)]
    indices = np.stack(cols, axis=-1)
    check_against_ort("GatherND", [data, indices], batch_dims=batch_dims)


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
@pytest.mark.parametrize(("data_shape", "indices_shape"), [((6,), (5, 1)), ((4, 3), (6, 2)), ((4, 3, 2), (3, 1))])
def test_scatter_nd_reductions_negative_indices(reduction, data_shape, indices_shape):
    data = rng.standard_normal(data_shape).astype(np.float32)
    k = indices_shape[-1]
    indices = np.stack([negative_mix(indices_shape[:-1], data_shape[j]) for j in range(k)], axis=-1)
    updates = rng.standard_normal(indices_shape[:-1] + data_shape[k:]).astype(np.float32)
    check_against_ort("ScatterND", [data, indices, updates], reduction=reduction)


# ---------------------------------------------------------------- Reshape 0 and -1


@pytest.mark.parametrize(
    ("data_shape", "shape", "allowzero"),
    [((2, 3, 4), (0, -1), 0), ((2, 3, 4), (0, 0, -1), 0), ((2, 3, 4), (-1, 0), 0), ((2, 3, 4), (4, 0, 2), 0),
     ((2, 3, 4), (0, 12), 0), ((2, 3, 4), (-1,), 0), ((2, 3, 4), (2, -1, 2, 1), 0), ((2, 3, 4), (-1, 3, 2), 1),
     ((0, 3, 4), (3, 0, 4), 1), ((0, 3, 4), (3, -1), 0), ((0, 3), (3, 0), 1), ((2, 0, 4), (0, 0, 5), 0)],
)
def test_reshape_zero_and_minus_one(data_shape, shape, allowzero):
    data = np.arange(int(np.prod(data_shape)), dtype=np.float32).reshape(data_shape)
    (got,) = check_against_ort("Reshape", [data, ints(*shape)], allowzero=allowzero)
    if got.size:  # the kernel itself hands out a view (sessions copy outputs that alias feeds)
        view = shape_kernels.reshape(data, ints(*shape), allowzero=allowzero)[0]
        assert np.shares_memory(view, data), "Reshape of a contiguous array should be a view"


@pytest.mark.parametrize(
    ("data_shape", "shape"),
    [((2, 3), (6, 1, 0)),  # 0 copies a dimension the input lacks
     ((0, 3, 4), (0, -1)),  # -1 is ambiguous when another dimension is 0
     ((2, 3), (-1, -1))],
)
def test_reshape_rejects_bad_shapes(data_shape, shape):
    model, feeds = one_node("Reshape", [np.zeros(data_shape, dtype=np.float32), ints(*shape)])
    with pytest.raises(odt_ops.KernelError, match="Reshape"):
        run_odt(model, feeds)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize(("data_shape", "axis", "indices_shape"), [
    ((7,), 0, (5,)), ((5, 6), 0, (4, 6)), ((5, 6), 1, (3, 4)), ((4, 5, 6), 2, (4, 2, 3)), ((4, 5, 6), 1, (3, 5, 6)),
    ((4, 5, 6), -3, (2, 1, 6)), ((2, 3, 4, 5), 3, (2, 3, 4, 5)), ((3, 4), 1, (0, 4)),
])
@pytest.mark.parametrize("index_dtype", [np.int64, np.int32])
def test_scatter_elements_flat_index_matches_per_axis_indexing(reduction, data_shape, axis, indices_shape, index_dtype):
    """The flat-index scatter against the per-axis index tuple numpy applies directly (ufunc.at for
    the reductions, so duplicates accumulate in order), with negative indices and indices smaller
    than data off the axis; unique indices for reduction none, where duplicates are undefined."""
    local = np.random.default_rng(len(data_shape) * 100 + axis + len(indices_shape))
    data = local.standard_normal(data_shape).astype(np.float32)
    dim = data_shape[axis]
    if reduction == "none":
        full = list(indices_shape)
        full[axis] = dim
        indices = np.take(np.argsort(local.random(full), axis=axis), np.arange(indices_shape[axis]), axis=axis)
    else:
        indices = local.integers(0, dim, size=indices_shape)
    indices = np.where(local.random(indices.shape) < 0.5, indices - dim, indices).astype(index_dtype)
    updates = local.standard_normal(indices_shape).astype(np.float32)
    before = data.copy()
    (got,) = shape_kernels.scatter_elements(data, indices, updates, axis=axis, reduction=reduction)
    grid = list(np.ogrid[tuple(slice(n) for n in indices_shape)])
    grid[axis % len(data_shape)] = indices
    want = data.copy()
    if reduction == "none":
        want[tuple(grid)] = updates
    else:
        {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}[reduction].at(want, tuple(grid), updates)
    assert got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()
    assert data.tobytes() == before.tobytes()


@pytest.mark.parametrize("bad", [5, -6])
def test_scatter_elements_rejects_indices_past_the_axis(bad):
    # in a flat index, 5 on an axis of 5 would silently land on the next row
    indices = np.array([[0, bad]], dtype=np.int64)
    with pytest.raises((ValueError, IndexError)):
        shape_kernels.scatter_elements(np.zeros((3, 5), np.float32), indices, np.ones((1, 2), np.float32), axis=1)
