"""Conv, ConvTranspose and the pools against onnxruntime, on one-node models with random window geometry.

The strategies stay inside what onnxruntime accepts; where it departs from the spec the
comments say how, and the spec's own node tests (test_node_conformance) cover the rest.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

import odt_ops
from odt_ops.errors import KernelError
from odt_ops.kernels.pool import max_pool
from odt_ops.runtime.plan import Plan

SETTINGS = settings(deadline=None, max_examples=25)
ort.set_default_logger_severity(3)  # errors surface as exceptions; keep the console quiet
OPSET = 22


def _model(op: str, feeds: dict[str, np.ndarray], attrs: dict, out_shapes: list[tuple[int, ...]] | None,
           n_outputs: int) -> onnx.ModelProto:
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
              for n, a in feeds.items()]
    out_types = [onnx.TensorProto.FLOAT, onnx.TensorProto.INT64]
    outputs = [helper.make_tensor_value_info(f"out{i}", out_types[i], None if out_shapes is None else out_shapes[i])
               for i in range(n_outputs)]
    node = helper.make_node(op, list(feeds), [o.name for o in outputs], **attrs)
    graph = helper.make_graph([node], op, inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=10)


def check(op: str, feeds: dict[str, np.ndarray], attrs: dict, *, n_outputs: int = 1, atol: float = 1e-4) -> None:
    """Run the node through onnxruntime and odt_ops and compare dtype, shape and values."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(_model(op, feeds, attrs, None, n_outputs).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    # the odt model declares the output shapes: the loader runs onnx.checker
    got = odt_ops.InferenceSession(_model(op, feeds, attrs, [w.shape for w in want], n_outputs),
                                   normalize=False).run(None, feeds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype, f"dtype {g.dtype} != {w.dtype}"
        assert g.shape == w.shape, f"shape {g.shape} != {w.shape}"
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=atol)


def rand(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-2, 2, size=shape).astype(np.float32)


seeds = st.integers(0, 2**32 - 1)


@st.composite
def windows(draw, *, rank=None, max_kernel=3, max_stride=3, max_dilation=2, pad_below_kernel=False,
            auto_pads=("NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID")):
    """Spatial shape and window attributes that leave at least one output position."""
    rank = rank or draw(st.integers(1, 3))
    kernel = draw(st.lists(st.integers(1, max_kernel), min_size=rank, max_size=rank))
    strides = draw(st.lists(st.integers(1, max_stride), min_size=rank, max_size=rank))
    auto_pad = draw(st.sampled_from(auto_pads))
    # onnxruntime refuses dilations with SAME_* padding
    dilation = st.integers(1, 1 if auto_pad.startswith("SAME") else max_dilation)
    dilations = draw(st.lists(dilation, min_size=rank, max_size=rank))
    extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if auto_pad.startswith("SAME"):
        # a window shorter than the stride makes the SAME padding negative: onnxruntime's pools
        # refuse it or shift the windows by it, where its Conv and odt_ops clamp it at 0
        strides = [min(s, e) for s, e in zip(strides, extents)]
    attrs = {"kernel_shape": kernel, "strides": strides, "dilations": dilations}
    if auto_pad == "NOTSET":
        # onnxruntime's pools insist on pads smaller than the kernel
        pads = [draw(st.integers(0, k - 1 if pad_below_kernel else 2)) for k in kernel * 2]
        attrs["pads"] = pads
    else:
        attrs["auto_pad"] = auto_pad
    spatial = [e + draw(st.integers(0, 4)) for e in extents]
    return spatial, attrs


@SETTINGS
@given(windows(), st.integers(1, 3), st.integers(1, 3), st.integers(1, 3), st.integers(1, 2), st.booleans(), seeds)
def test_conv(geometry, group, in_per_group, out_per_group, batch, bias, seed):
    spatial, attrs = geometry
    C, M = group * in_per_group, group * out_per_group
    feeds = {"X": rand(seed, batch, C, *spatial), "W": rand(seed + 1, M, in_per_group, *attrs["kernel_shape"])}
    if bias:
        feeds["B"] = rand(seed + 2, M)
    check("Conv", feeds, {**attrs, "group": group})


@pytest.mark.parametrize(("spatial", "attrs"), [
    ((6, 7), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    ((6, 7), {"kernel_shape": [3, 3], "pads": [2, 2, 0, 0]}),  # shifted left: wraps on one side only
    ((6, 7), {"kernel_shape": [3, 3], "pads": [0, 0, 0, 2]}),
    ((5, 9), {"kernel_shape": [5, 3], "pads": [2, 1, 2, 1]}),
    ((5, 9), {"kernel_shape": [3, 3], "pads": [0, 1, 3, 1]}),  # more output rows than input rows
    ((8, 8), {"kernel_shape": [3, 3], "dilations": [2, 2], "pads": [2, 2, 2, 2]}),
    ((4, 5), {"kernel_shape": [2, 4], "auto_pad": "SAME_UPPER"}),
    ((4, 5), {"kernel_shape": [2, 4], "auto_pad": "SAME_LOWER"}),
    ((3, 2), {"kernel_shape": [3, 5], "pads": [1, 2, 1, 2]}),  # the kernel is wider than the row
    ((7,), {"kernel_shape": [3], "pads": [1, 1]}),
    ((7,), {"kernel_shape": [4], "pads": [0, 0]}),
    ((3, 4, 5), {"kernel_shape": [3, 3, 3], "pads": [1, 1, 1, 1, 1, 1]}),
    ((3, 4, 5), {"kernel_shape": [2, 3, 2], "pads": [0, 2, 1, 1, 0, 0]}),
])
@pytest.mark.parametrize(("group", "in_per_group", "out_per_group"), [(1, 1, 8), (1, 8, 16), (2, 3, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_conv_keeping_the_row_length(spatial, attrs, group, in_per_group, out_per_group, bias):
    """Stride 1 with every output axis but the first as long as the input's: the im2col reads the
    unpadded planes at flat offsets and clears what wraps across row ends (``row_windows``)."""
    from odt_ops.kernels.conv import _conv_geometry
    from odt_ops.kernels.windows import keeps_rows

    C, M = group * in_per_group, group * out_per_group
    feeds = {"X": rand(len(spatial), 3, C, *spatial), "W": rand(7, M, in_per_group, *attrs["kernel_shape"])}
    if bias:
        feeds["B"] = rand(8, M)
    window = {k: attrs.get(k) for k in ("strides", "dilations", "pads")}
    geo = _conv_geometry(feeds["X"], feeds["W"], None, group, auto_pad=attrs.get("auto_pad", "NOTSET"), **window)
    assert keeps_rows(feeds["X"], geo)
    check("Conv", feeds, {**attrs, "group": group})


@SETTINGS
@given(st.one_of(windows(rank=2, max_stride=1), windows(rank=3, max_stride=1)), st.integers(8, 12), st.integers(1, 8),
       st.integers(1, 3), st.booleans(), seeds)
def test_conv_by_kernel_taps(geometry, C, M, batch, bias, seed):
    """Stride 1, one group, at least as many input channels as outputs: one GEMM per kernel tap
    over the flat padded planes (``_conv_taps``), against onnxruntime. The small images here have
    fewer output columns than the taps take in production (``_TAP_MIN_COLUMNS``): lowered to 1."""
    from unittest import mock

    from hypothesis import assume

    import odt_ops.kernels.conv as conv_kernels

    spatial, attrs = geometry
    feeds = {"X": rand(seed, batch, C, *spatial), "W": rand(seed + 1, M, C, *attrs["kernel_shape"])}
    if bias:
        feeds["B"] = rand(seed + 2, M)
    window = {k: attrs.get(k) for k in ("strides", "dilations", "pads")}
    geo = conv_kernels._conv_geometry(feeds["X"], feeds["W"], None, 1, auto_pad=attrs.get("auto_pad", "NOTSET"), **window)
    with mock.patch.object(conv_kernels, "_TAP_MIN_COLUMNS", 1):
        assume(conv_kernels._takes_taps(feeds["X"], feeds["W"], geo, 1))  # a 1x1 kernel is a plain GEMM instead
        check("Conv", feeds, attrs)


@pytest.mark.parametrize("images_per_block", [1, 2, 3])
def test_conv_by_kernel_taps_in_image_blocks_is_unchanged(monkeypatch, images_per_block):
    """Blocks of images (the cache budget of ``_conv_taps``) give the very same bits as one block,
    the last block shorter than the others included."""
    import odt_ops.kernels.conv as conv_kernels

    monkeypatch.setattr(conv_kernels, "_TAP_MIN_COLUMNS", 1)  # taps at 11 output columns, here in both runs
    X, W, B = rand(1, 5, 16, 9, 11), rand(2, 12, 16, 3, 3), rand(3, 12)
    attrs = {"pads": [1, 0, 2, 1], "dilations": [1, 2]}
    whole = conv_kernels.conv(X, W, B, **attrs)[0]
    geo = conv_kernels._conv_geometry(X, W, None, 1, strides=None, dilations=[1, 2], pads=[1, 0, 2, 1], auto_pad="NOTSET")
    monkeypatch.setattr(conv_kernels, "_TAP_BLOCK_BYTES", images_per_block * conv_kernels._tap_bytes(X, 12, geo))
    assert conv_kernels._takes_taps(X, W, geo, 1)
    blocked = conv_kernels.conv(X, W, B, **attrs)[0]
    assert blocked.dtype == whole.dtype
    assert blocked.tobytes() == whole.tobytes()


@SETTINGS
@given(windows(rank=2, max_kernel=5, max_stride=2), st.integers(1, 4), st.integers(1, 3), seeds)
def test_conv_depthwise(geometry, channels, multiplier, seed):
    spatial, attrs = geometry
    M = channels * multiplier
    feeds = {"X": rand(seed, 2, channels, *spatial), "W": rand(seed + 1, M, 1, *attrs["kernel_shape"]),
             "B": rand(seed + 2, M)}
    check("Conv", feeds, {**attrs, "group": channels})


@st.composite
def transpose_windows(draw):
    rank = draw(st.integers(1, 3))
    kernel = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    strides = draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank))
    dilations = draw(st.lists(st.integers(1, 2), min_size=rank, max_size=rank))
    spatial = draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))
    mode = draw(st.sampled_from(["pads", "SAME_UPPER", "SAME_LOWER", "VALID", "output_shape"]))
    if mode.startswith("SAME"):
        # onnxruntime clamps a negative SAME padding (window shorter than the stride) to 0, where
        # the spec keeps output = input * stride; and onnx shape inference adds output_padding
        # to SAME outputs, where onnxruntime and the spec do not: keep clear of both
        strides = [min(s, (k - 1) * d + 1) for s, k, d in zip(strides, kernel, dilations)]
        output_padding = [0] * rank
    else:
        # the spec allows output_padding below the stride or the dilation; onnxruntime only below the stride
        output_padding = [draw(st.integers(0, s - 1)) for s in strides]
    attrs = {"kernel_shape": kernel, "strides": strides, "dilations": dilations, "output_padding": output_padding}
    full = [s * (n - 1) + a + (k - 1) * d + 1
            for s, n, a, k, d in zip(strides, spatial, output_padding, kernel, dilations)]
    if mode == "pads":
        begin = [draw(st.integers(0, (f - 1) // 2)) for f in full]
        attrs["pads"] = begin + [draw(st.integers(0, (f - 1) // 2)) for f in full]
    elif mode == "output_shape":
        # no larger than the uncropped size: onnxruntime refuses the zero margin the spec adds then;
        # no smaller than the input: onnx shape inference (1.23) silently truncates the shape there
        attrs["output_shape"] = [draw(st.integers(n, f)) for n, f in zip(spatial, full)]
    else:
        attrs["auto_pad"] = mode
    return spatial, attrs


@SETTINGS
@given(transpose_windows(), st.integers(1, 2), st.integers(1, 3), st.integers(1, 3), st.booleans(), seeds)
def test_conv_transpose(geometry, group, in_per_group, out_per_group, bias, seed):
    spatial, attrs = geometry
    C, M = group * in_per_group, group * out_per_group
    feeds = {"X": rand(seed, 2, C, *spatial), "W": rand(seed + 1, C, out_per_group, *attrs["kernel_shape"])}
    if bias:
        feeds["B"] = rand(seed + 2, M)
    check("ConvTranspose", feeds, {**attrs, "group": group})


@SETTINGS
@given(windows(pad_below_kernel=True), st.integers(0, 1), st.integers(0, 1), st.integers(1, 2), seeds)
def test_max_pool(geometry, ceil_mode, storage_order, n_outputs, seed):
    spatial, attrs = geometry
    if "auto_pad" in attrs:
        ceil_mode = 0  # onnxruntime computes SAME/VALID shapes with floor only
    X = rand(seed, 2, 3, *spatial)
    if seed % 2:  # ties: the index of the first maximum in row-major order wins
        X = np.round(X)
    check("MaxPool", {"X": X}, {**attrs, "ceil_mode": ceil_mode, "storage_order": storage_order}, n_outputs=n_outputs)


@SETTINGS
@given(windows(pad_below_kernel=True), st.integers(0, 1), st.integers(0, 1), seeds)
def test_average_pool(geometry, ceil_mode, count_include_pad, seed):
    spatial, attrs = geometry
    if "auto_pad" in attrs:
        ceil_mode = 0
    check("AveragePool", {"X": rand(seed, 2, 3, *spatial)},
          {**attrs, "ceil_mode": ceil_mode, "count_include_pad": count_include_pad})


@SETTINGS
@given(windows(pad_below_kernel=True), st.sampled_from([1, 2, 3]), seeds)
def test_lp_pool(geometry, p, seed):
    spatial, attrs = geometry
    check("LpPool", {"X": rand(seed, 2, 3, *spatial)}, {**attrs, "p": p})


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("spatial", [(5,), (4, 3), (2, 3, 4)])
def test_global_pools(op, spatial):
    check(op, {"X": rand(0, 2, 3, *spatial)}, {})


def test_max_pool_uint8_indices_skip_padding():
    # zeros tie with the uint8 padding value; the index must still point at a real element
    # (onnxruntime has no uint8 MaxPool with Indices, so this checks the definition directly)
    Y, I = max_pool(np.zeros((1, 1, 3, 3), dtype=np.uint8), kernel_shape=[2, 2], pads=[1, 1, 1, 1], _num_outputs=2)
    assert Y.dtype == np.uint8
    assert Y.shape == (1, 1, 4, 4)
    np.testing.assert_array_equal(I, [[[[0, 0, 1, 2], [0, 0, 1, 2], [3, 3, 4, 5], [6, 6, 7, 8]]]])


@pytest.mark.parametrize(
    ("op", "attrs", "message"),
    [
        ("Conv", {"group": 2}, "group 2 must divide"),
        ("Conv", {"pads": [1, 1]}, "pads"),
        ("Conv", {"auto_pad": "SAME"}, "auto_pad"),
        ("MaxPool", {"kernel_shape": [9, 9]}, "does not fit"),
        ("AveragePool", {"kernel_shape": [2, 2], "strides": [0, 1]}, "strides"),
    ],
)
def test_bad_attributes_name_the_node(op, attrs, message):
    feeds = {"X": rand(0, 1, 3, 4, 4)}
    if op == "Conv":
        feeds["W"] = rand(1, 2, 3, 3, 3)
    # a bare plan: the loader's checker would already refuse some of these models
    plan = Plan(_model(op, feeds, attrs, None, 1).graph, {"": OPSET}, {}, list(feeds), ["out0"])
    with pytest.raises(KernelError, match=f"{op} node.*{message}"):
        plan.run(list(feeds.values()))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int64])
@pytest.mark.parametrize(("spatial", "kernel"), [
    ((8, 8), (2, 2)), ((9, 7), (2, 2)), ((6, 9), (3, 3)), ((4, 6), (1, 2)), ((4, 6), (2, 1)), ((5, 5), (1, 1)),
    ((10,), (2,)), ((11,), (3,)), ((4, 6, 6), (2, 3, 2)), ((5, 7, 4), (2, 2, 2)),
])
@pytest.mark.parametrize("storage_order", [0, 1])
def test_max_pool_tiled_indices_match_the_general_path(dtype, spatial, kernel, storage_order):
    """Windows that tile the input take the tap-major path: same values (bit for bit) and indices as the
    general separable path, on ties, NaNs (two payloads), -0.0 and infinities, with cropped edges;
    and the same in batch slices."""
    import odt_ops.kernels.windows as window_kernels
    from odt_ops.kernels.pool import _lowest, _max_with_indices, _pool_geometry
    from odt_ops.kernels.windows import pad_for_windows

    rng = np.random.default_rng(sum(spatial) * 31 + sum(kernel) * 7 + storage_order)
    for trial in range(6):
        X = rng.integers(-3, 4, size=(3, 2, *spatial)).astype(dtype)  # few distinct values: many ties
        if np.dtype(dtype).kind == "f":
            X = X + X.dtype.type(0.5) * rng.standard_normal(X.shape).astype(dtype) * (trial % 3 == 0)
            specials = np.array([np.nan, -0.0, 0.0, np.inf, -np.inf], dtype=dtype)
            mask = rng.random(X.shape) < (0.05 if trial < 3 else 0.4)
            X[mask] = rng.choice(specials, size=int(mask.sum()))
            nan_bits = X.view(f"u{X.itemsize}")
            nan_bits[rng.random(X.shape) < 0.03] = np.array(-np.nan, dtype).view(nan_bits.dtype) | 1  # another payload
        before = X.copy()
        Y, I = max_pool(X, kernel_shape=list(kernel), strides=list(kernel), storage_order=storage_order, _num_outputs=2)
        saved = window_kernels.CACHE_BYTES
        try:
            window_kernels.CACHE_BYTES = 1  # one image a slice: the same bits
            sliced = max_pool(X, kernel_shape=list(kernel), strides=list(kernel), storage_order=storage_order,
                              _num_outputs=2)
        finally:
            window_kernels.CACHE_BYTES = saved
        assert sliced[0].tobytes() == Y.tobytes()
        assert sliced[1].tobytes() == I.tobytes()
        geo = _pool_geometry(X, "MaxPool", list(kernel), strides=list(kernel), dilations=None, pads=None,
                             auto_pad="NOTSET", ceil_mode=0)
        want_Y, want_I = _max_with_indices(X, pad_for_windows(X, geo, _lowest(X.dtype)), geo, storage_order)
        assert Y.dtype == want_Y.dtype
        assert Y.shape == want_Y.shape
        assert Y.tobytes() == want_Y.tobytes()
        assert I.dtype == np.int64
        assert I.flags.c_contiguous
        np.testing.assert_array_equal(I, want_I)
        assert X.tobytes() == before.tobytes()


@SETTINGS
@given(windows(max_stride=2), transpose_windows(), st.integers(1, 2), st.integers(1, 2), st.integers(1, 2),
       st.sampled_from([1, 3000]), seeds)
def test_conv_in_batch_slices_is_unchanged(geometry, transposed, group, in_per_group, out_per_group, budget, seed):
    """Conv and ConvTranspose through ``batch_steps`` slices (a tiny cache budget) give the very same
    bits as in one go: the column buffer is reused, the bias row and zero guard must survive."""
    import odt_ops.kernels.conv as conv_kernels
    import odt_ops.kernels.windows as window_kernels

    C, M = group * in_per_group, group * out_per_group
    rng = np.random.default_rng(seed)
    cases = []
    spatial, attrs = geometry
    cases.append((conv_kernels.conv, rng.standard_normal((5, C, *spatial)).astype(np.float32),
                  rng.standard_normal((M, in_per_group, *attrs["kernel_shape"])).astype(np.float32), attrs))
    spatial, attrs = transposed
    cases.append((conv_kernels.conv_transpose, rng.standard_normal((5, C, *spatial)).astype(np.float32),
                  rng.standard_normal((C, out_per_group, *attrs["kernel_shape"])).astype(np.float32), attrs))
    B = rng.standard_normal(M).astype(np.float32)
    for fn, X, W, attrs in cases:
        whole = fn(X, W, B, group=group, **attrs)[0]
        saved = window_kernels.CACHE_BYTES
        try:
            window_kernels.CACHE_BYTES = budget
            sliced = fn(X, W, B, group=group, **attrs)[0]
        finally:
            window_kernels.CACHE_BYTES = saved
        assert sliced.dtype == whole.dtype
        assert sliced.tobytes() == whole.tobytes()
