"""nn kernels beyond the spec's node cases.

The spec's cases fix one input each; these check BatchNormalization's training
outputs against a float64 formula written from the spec text, Dropout's seeding
contract and inference identity, and Resize on random shapes and scales against
onnxruntime, each on a one-node model.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

import odt_ops
from odt_ops.kernels import nn

IR_VERSION = 10  # onnxruntime 1.31 reads IR <= 13; onnx 1.23 would default to 14


def one_node(op, inputs, *, opset, constants=None, n_outputs=1, outputs=None, **attrs):
    """A model of one ``op`` node: ``inputs`` are fed, ``constants`` are initializers; both by input position.

    ``None`` in ``inputs`` leaves that optional input empty. Output types are inferred
    unless ``outputs`` gives (dtype, shape) per output (for forms onnx infers nothing for).
    """
    constants = constants or {}
    names, graph_inputs, initializers = [], [], []
    for i in range(max([len(inputs), *(k + 1 for k in constants)])):
        value = inputs[i] if i < len(inputs) else None
        if i in constants:
            initializers.append(numpy_helper.from_array(constants[i], f"c{i}"))
            names.append(f"c{i}")
        elif value is not None:
            elem_type = helper.np_dtype_to_tensor_dtype(value.dtype)
            graph_inputs.append(helper.make_tensor_value_info(f"in{i}", elem_type, value.shape))
            names.append(f"in{i}")
        else:
            names.append("")
    out_names = [f"out{i}" for i in range(len(outputs) if outputs else n_outputs)]
    if outputs:
        out_infos = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), s)
                     for n, (t, s) in zip(out_names, outputs)]
    else:
        out_infos = [helper.make_empty_tensor_value_info(n) for n in out_names]
    graph = helper.make_graph(
        [helper.make_node(op, names, out_names, **attrs)], op.lower(), graph_inputs, out_infos, initializers
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    feeds = {f"in{i}": v for i, v in enumerate(inputs) if v is not None and i not in constants}
    return (model if outputs else onnx.shape_inference.infer_shapes(model, strict_mode=True)), feeds


def run_odt(model, feeds, seed=0):
    return odt_ops.InferenceSession(model, normalize=False, seed=seed).run(None, feeds)


def run_ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


# ---------------------------------------------------------------- BatchNormalization


def bn_spec_formula(x, scale, b, mean, var, momentum, epsilon):
    """The opset-15 training-mode equations of the spec, in float64."""
    x, scale, b, mean, var = (np.asarray(a, dtype=np.float64) for a in (x, scale, b, mean, var))
    axes = tuple(i for i in range(x.ndim) if i != 1)  # all except the channel index
    shape = [1] * x.ndim
    shape[1] = -1
    current_mean = x.mean(axis=axes)
    # ReduceVar: population variance, sum((x - mean)^2) / N
    current_var = ((x - current_mean.reshape(shape)) ** 2).sum(axis=axes) / (x.size // x.shape[1])
    running_mean = mean * momentum + current_mean * (1 - momentum)
    running_var = var * momentum + current_var * (1 - momentum)
    normalized = (x - current_mean.reshape(shape)) / np.sqrt(current_var.reshape(shape) + epsilon)
    y = normalized * scale.reshape(shape) + b.reshape(shape)
    return y, running_mean, running_var, current_mean, current_var


def bn_inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = (rng.standard_normal(shape) * rng.uniform(0.5, 3) + rng.uniform(-2, 2)).astype(dtype)
    scale, b, mean = (rng.standard_normal(c).astype(dtype) for _ in range(3))
    var = rng.uniform(0.5, 2.0, c).astype(dtype)
    return [x, scale, b, mean, var]


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 7), (2, 4, 5, 6), (2, 2, 3, 2, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("momentum,epsilon", [(0.9, 1e-5), (0.3, 1e-2)])
def test_batchnorm_training_mode_matches_spec_formula(shape, dtype, momentum, epsilon):
    inputs = bn_inputs(shape, dtype, seed=len(shape))
    snapshot = [a.copy() for a in inputs]
    model, feeds = one_node("BatchNormalization", inputs, opset=15, n_outputs=3, training_mode=1,
                            momentum=momentum, epsilon=epsilon)
    y, running_mean, running_var = run_odt(model, feeds)
    want = bn_spec_formula(*inputs, np.float32(momentum), np.float32(epsilon))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    for got, expected in zip((y, running_mean, running_var), want):
        assert got.dtype == dtype
        np.testing.assert_allclose(got, expected, **tol)
    for before, after in zip(snapshot, inputs):
        np.testing.assert_array_equal(before, after, err_msg="BatchNormalization mutated an input")


def test_batchnorm_opset9_five_outputs_are_running_and_batch_stats():
    inputs = bn_inputs((3, 4, 5, 2), np.float32, seed=9)
    c = inputs[1].shape
    model, feeds = one_node("BatchNormalization", inputs, opset=9, momentum=0.8,
                            outputs=[(np.float32, inputs[0].shape)] + [(np.float32, c)] * 4)
    got = run_odt(model, feeds)
    want = bn_spec_formula(*inputs, np.float32(0.8), np.float32(1e-5))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset,attrs", [(9, {}), (15, {}), (15, {"training_mode": 0})])
def test_batchnorm_inference_uses_given_statistics(opset, attrs):
    x, scale, b, mean, var = bn_inputs((2, 3, 4, 4), np.float32, seed=1)
    model, feeds = one_node("BatchNormalization", [x, scale, b, mean, var], opset=opset, epsilon=1e-3, **attrs)
    (y,) = run_odt(model, feeds)
    s = (1, -1, 1, 1)
    want = (x - mean.reshape(s)) / np.sqrt(var.reshape(s) + np.float32(1e-3)) * scale.reshape(s) + b.reshape(s)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_batchnorm_rejects_running_outputs_in_inference_mode():
    # the loader's shape inference already refuses such a node; the kernel does too
    with pytest.raises(ValueError, match="training_mode"):
        nn.batch_normalization(*bn_inputs((2, 3, 4), np.float32, seed=2), _num_outputs=3)


# ---------------------------------------------------------------- Dropout


def dropout_model(x, ratio, training, n_outputs=2):
    constants = {1: np.array(ratio, dtype=np.float32)}
    if training is not None:
        constants[2] = np.array(training)
    return one_node("Dropout", [x], constants=constants, opset=13, n_outputs=n_outputs)


def test_dropout_same_seed_same_masks():
    x = np.random.default_rng(0).standard_normal((8, 16, 16)).astype(np.float32)
    model, feeds = dropout_model(x, 0.4, True)
    a, b, c = (odt_ops.InferenceSession(model, normalize=False, seed=s) for s in (7, 7, 8))
    first = [a.run(None, feeds) for _ in range(3)]
    second = [b.run(None, feeds) for _ in range(3)]
    for (ya, ma), (yb, mb) in zip(first, second):
        np.testing.assert_array_equal(ma, mb)
        np.testing.assert_array_equal(ya, yb)
    # the generator advances: successive runs of one session draw fresh masks
    assert not np.array_equal(first[0][1], first[1][1])
    assert not np.array_equal(first[0][1], c.run(None, feeds)[1])


def test_dropout_training_scales_kept_and_zeroes_dropped():
    ratio = 0.3
    x = np.random.default_rng(1).standard_normal((64, 128)).astype(np.float32)
    model, feeds = dropout_model(x, ratio, True)
    y, mask = run_odt(model, feeds, seed=3)
    assert y.dtype == np.float32
    assert mask.dtype == np.bool_
    assert mask.shape == x.shape
    np.testing.assert_allclose(y[mask], x[mask] / np.float32(1 - ratio), rtol=1e-6)
    assert not y[~mask].any()
    assert abs(mask.mean() - (1 - ratio)) < 0.02  # 8192 draws: 0.02 is about 4 standard deviations


@pytest.mark.parametrize("training", [None, False])
def test_dropout_inference_is_identity_with_all_true_mask(training):
    x = np.random.default_rng(2).standard_normal((4, 5)).astype(np.float32)
    model, feeds = dropout_model(x, 0.7, training)
    y, mask = run_odt(model, feeds)
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == np.bool_
    assert mask.shape == x.shape
    assert mask.all()


def test_dropout_zero_ratio_in_training_is_identity():
    x = np.random.default_rng(3).standard_normal((4, 5)).astype(np.float32)
    model, feeds = dropout_model(x, 0.0, True)
    y, mask = run_odt(model, feeds)
    np.testing.assert_array_equal(y, x)
    assert mask.all()


@pytest.mark.parametrize("opset", [7, 10])
def test_dropout_before_opset12_is_test_mode_identity(opset):
    x = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    mask_dtype = np.float32 if opset == 7 else np.bool_  # Dropout-7 types its mask like the data
    model, feeds = one_node("Dropout", [x], opset=opset, ratio=0.5,
                            outputs=[(np.float32, x.shape), (mask_dtype, x.shape)])
    y, mask = run_odt(model, feeds)
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == mask_dtype
    assert mask.all()


def test_dropout_rejects_ratio_one():
    x = np.ones((2, 2), dtype=np.float32)
    model, feeds = dropout_model(x, 1.0, True)
    with pytest.raises(odt_ops.KernelError, match="ratio"):
        run_odt(model, feeds)


# ---------------------------------------------------------------- Resize against onnxruntime
# Where onnxruntime departs from the spec's reference (which the engine follows) the
# strategies stay clear: it computes coordinates in float32 (so nearest sampling uses
# scales exact in binary, on lengths they divide, and no rounding tie depends on
# precision), divides by the integer output length where the reference uses the
# fractional one (exact scales make them equal), copies the input when the output
# shape equals it, and ignores the roi of an axis it does not resize (crop-and-resize
# resizes every axis it crops).

EXACT_SCALES = [0.25, 0.5, 0.75, 1.25, 1.5, 2.0, 2.5, 3.0]
COORDINATE_MODES = ["half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric"]
NEAREST_MODES = ["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]


def resize_model(x, *, scales=None, sizes=None, roi=None, **attrs):
    if scales is not None:
        constants = {2: np.asarray(scales, dtype=np.float32)}
    else:
        constants = {3: np.asarray(sizes, dtype=np.int64)}
    if roi is not None:
        constants[1] = np.asarray(roi, dtype=np.float32)
    return one_node("Resize", [x], constants=constants, opset=19, **attrs)


def assert_resize_matches_ort(x, **kwargs):
    model, feeds = resize_model(x, **kwargs)
    (got,) = run_odt(model, feeds)
    (want,) = run_ort(model, feeds)
    assert got.dtype == want.dtype, f"{got.dtype}{got.shape} != {want.dtype}{want.shape}"
    assert got.shape == want.shape, f"{got.dtype}{got.shape} != {want.dtype}{want.shape}"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def image(draw, h, w, dtype=np.float32):
    n, c = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    return np.random.default_rng(seed).standard_normal((n, c, h, w)).astype(dtype)


@st.composite
def exact_resizes(draw):
    """A 4-D image, per-axis exact scales on H and W, passed as scales or as the sizes they give."""
    h, w = (4 * draw(st.integers(1, 3)) for _ in range(2))
    sh, sw = (draw(st.sampled_from(EXACT_SCALES)) for _ in range(2))
    x = image(draw, h, w)
    if draw(st.booleans()):
        return x, dict(scales=[1.0, 1.0, sh, sw])
    return x, dict(sizes=[*x.shape[:2], int(h * sh), int(w * sw)])


@settings(deadline=None, max_examples=25)
@given(case=exact_resizes(), coordinate_mode=st.sampled_from(COORDINATE_MODES),
       nearest_mode=st.sampled_from(NEAREST_MODES))
def test_resize_nearest_matches_onnxruntime(case, coordinate_mode, nearest_mode):
    x, sampling = case
    assert_resize_matches_ort(x, mode="nearest", coordinate_transformation_mode=coordinate_mode,
                              nearest_mode=nearest_mode, **sampling)


@st.composite
def linear_resizes(draw):
    """Exact scales, or arbitrary target sizes (1..16) on H x W inputs of 1..8."""
    if draw(st.booleans()):
        return draw(exact_resizes())
    h, w = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    x = image(draw, h, w)
    return x, dict(sizes=[*x.shape[:2], draw(st.integers(1, 16)), draw(st.integers(1, 16))])


@settings(deadline=None, max_examples=25)
@given(case=linear_resizes(), coordinate_mode=st.sampled_from(COORDINATE_MODES))
def test_resize_linear_matches_onnxruntime(case, coordinate_mode):
    x, sampling = case
    assert_resize_matches_ort(x, mode="linear", coordinate_transformation_mode=coordinate_mode, **sampling)


@st.composite
def crops(draw):
    h, w = draw(st.integers(2, 8)), draw(st.integers(2, 8))
    x = image(draw, h, w)
    out_h = draw(st.integers(1, 16).filter(lambda v: v != h))
    out_w = draw(st.integers(1, 16).filter(lambda v: v != w))
    starts = [draw(st.floats(-0.3, 0.6)) for _ in range(2)]
    ends = [draw(st.floats(0.4, 1.3)) for _ in range(2)]
    for n_in, n_out, start, end in zip((h, w), (out_h, out_w), starts, ends):
        # a sample within rounding of the input's edge is inside in float64 and outside in
        # float32 (onnxruntime and the reference compute the crop in float32): skip the knife edge
        pos = np.float32(start) * (n_in - 1) + np.arange(n_out) * (np.float32(end) - np.float32(start)) * (n_in - 1) / max(n_out - 1, 1)
        assume(np.all(np.minimum(np.abs(pos), np.abs(pos - (n_in - 1))) > 1e-4))
    return x, [*x.shape[:2], out_h, out_w], [0.0, 0.0, *starts, 1.0, 1.0, *ends]


@settings(deadline=None, max_examples=25)
@given(case=crops(), extrapolation_value=st.sampled_from([0.0, -7.5]))
def test_resize_linear_crop_and_resize_matches_onnxruntime(case, extrapolation_value):
    x, sizes, roi = case
    assert_resize_matches_ort(x, mode="linear", coordinate_transformation_mode="tf_crop_and_resize",
                              sizes=sizes, roi=roi, extrapolation_value=extrapolation_value)


@settings(deadline=None, max_examples=25)
@given(case=linear_resizes(), coordinate_mode=st.sampled_from(COORDINATE_MODES),
       antialias=st.sampled_from([0, 1]), exclude_outside=st.sampled_from([0, 1]),
       cubic_coeff_a=st.sampled_from([-0.75, -0.5]))
def test_resize_cubic_matches_onnxruntime(case, coordinate_mode, antialias, exclude_outside, cubic_coeff_a):
    x, sampling = case
    assert_resize_matches_ort(x, mode="cubic", coordinate_transformation_mode=coordinate_mode, antialias=antialias,
                              exclude_outside=exclude_outside, cubic_coeff_a=cubic_coeff_a, **sampling)


@settings(deadline=None, max_examples=15)
@given(case=linear_resizes())
def test_resize_linear_antialias_matches_onnxruntime(case):
    x, sampling = case
    assert_resize_matches_ort(x, mode="linear", antialias=1, **sampling)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_opset10_matches_onnxruntime(mode):
    # Resize-10: asymmetric coordinates; nearest floors when upsampling, ceils when downsampling
    x = np.random.default_rng(5).standard_normal((1, 2, 8, 4)).astype(np.float32)
    model, feeds = one_node("Resize", [x], constants={1: np.array([1, 1, 0.75, 2.5], np.float32)}, opset=10, mode=mode)
    np.testing.assert_allclose(run_odt(model, feeds)[0], run_ort(model, feeds)[0], rtol=1e-5, atol=1e-6)


def test_resize_nearest_keeps_integer_dtype():
    x = np.arange(24, dtype=np.uint8).reshape(1, 2, 3, 4)
    assert_resize_matches_ort(x, mode="nearest", sizes=[1, 2, 7, 5])


# ---------------------------------------------------------------- Pad and GroupNormalization


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("pads", [[0, 1, 2, 1, 0, 2], [1, -1, 2, 0, 1, -2], [-1, 0, 0, 0, -2, 1]])
def test_pad_negative_pads_crop_like_onnxruntime(mode, pads):
    x = np.random.default_rng(6).standard_normal((3, 4, 5)).astype(np.float32)
    constants = {1: np.array(pads, np.int64), 2: np.array(1.5, np.float32)}
    model, feeds = one_node("Pad", [x], constants=constants, opset=19, mode=mode)
    np.testing.assert_array_equal(run_odt(model, feeds)[0], run_ort(model, feeds)[0])


def test_group_norm_18_scales_per_group_as_21_scales_per_channel():
    # the opset-18 form (deprecated; onnx.checker rejects it) takes one scale per group
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 6, 3, 3)).astype(np.float32)
    scale, bias = rng.standard_normal(3).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    (old,) = nn.group_normalization_18(x, scale, bias, num_groups=3)
    (new,) = nn.group_normalization(x, np.repeat(scale, 2), np.repeat(bias, 2), num_groups=3)
    np.testing.assert_allclose(old, new, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- per-channel arithmetic


@pytest.mark.parametrize("shape", [(8, 16, 4, 4), (3, 5, 7), (4, 6), (1, 4, 2, 2), (2, 3, 70, 70), (2, 3, 0, 4)])
@pytest.mark.parametrize("ufunc", [np.add, np.subtract, np.multiply, np.divide])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_per_channel_is_numpy_broadcasting_bit_for_bit(shape, ufunc, dtype):
    """per_channel spells the channel values out over one image: the result, written fresh or in
    place, must be numpy's broadcast of a (1, C, 1, ...) operand, bit for bit."""
    from odt_ops.kernels.channels import per_channel

    rng = np.random.default_rng(len(shape) * 7 + shape[1])
    x = rng.standard_normal(shape).astype(dtype)
    v = rng.standard_normal(shape[1]).astype(dtype)
    want = ufunc(x, v.reshape((1, -1) + (1,) * (x.ndim - 2)))
    got = per_channel(ufunc, x, v)
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
    in_place = x.copy()
    assert per_channel(ufunc, in_place, v, out=in_place) is not None
    np.testing.assert_array_equal(in_place, want)


def test_per_channel_takes_views_and_other_dtypes_as_numpy_does():
    from odt_ops.kernels.channels import per_channel

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 6, 5, 5)).astype(np.float32)[:, :, ::2]  # not contiguous
    v64 = rng.standard_normal(6)  # float64 values: numpy's promotion, not a float32 row
    np.testing.assert_array_equal(per_channel(np.multiply, x, v64), x * v64.reshape(1, -1, 1, 1))
    v = v64.astype(np.float32)
    np.testing.assert_array_equal(per_channel(np.add, x, v), x + v.reshape(1, -1, 1, 1))
