"""Gradient rules of the nn family (odt_ops/grad/rules/conv.py, normalization.py).

Each rule against float64 central finite differences (tests/odt_ops/gradcheck.py) over
hypothesis-drawn shapes and attributes; the float32 gradient graphs executed by
onnxruntime against odt_ops' Plan; a small CNN's gradients against torch.autograd.
gradcheck asserts every gradient graph is standard ai.onnx passing the full checker.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from onnx import helper, numpy_helper

from odt_ops.grad import build_gradients
from odt_ops.kernels.geometry import window_counts, window_geometry
from tests.odt_ops.gradcheck import EXECUTORS, check_gradients, compile_model, error_report, make_model, numeric_gradients, training_model, with_projection_loss

SETTINGS = settings(deadline=None, max_examples=8, database=None, suppress_health_check=list(HealthCheck))
FEW = settings(SETTINGS, max_examples=4)

ERRORS: dict[str, float] = defaultdict(float)  # op -> largest finite-difference error seen


report_errors = error_report(ERRORS, "op")


def build(op, inputs, *, initializers=None, outputs=("Y",), symbolic=("X",), opset=21, **attrs):
    """A one-node model; outputs shape inference cannot type are declared like X."""
    node = helper.make_node(op, [*inputs, *(initializers or {})], list(outputs), name=op, **attrs)
    model = make_model([node], inputs, ["Y"], initializers=initializers, symbolic=symbolic, opset=opset)
    if not model.graph.output[0].type.HasField("tensor_type"):  # GroupNormalization-21 (onnx infers no type)
        declared = model.graph.value_info.add()
        declared.name = "Y"
        declared.type.CopyFrom(model.graph.input[0].type)
    return model


def check(op, inputs, wrt=None, **kwargs):
    """Finite-difference check of one ``op`` node; wrt defaults to every input."""
    model = build(op, inputs, **kwargs)
    fallbacks = EXECUTORS["onnx.reference"]
    errors = check_gradients(model, inputs, list(wrt or inputs))
    assert EXECUTORS["onnx.reference"] == fallbacks, "the gradient graph needs an op odt_ops has no kernel for"
    ERRORS[op] = max(ERRORS[op], *errors.values())
    return errors


def seeds():
    return st.integers(0, 2**32 - 1)


def distinct(rng, shape):
    """Values at least 0.05 apart, so no max or kink is within a finite-difference step."""
    size = int(np.prod(shape))
    return (rng.permutation(size) * 0.05 - size * 0.025 + 0.01).reshape(shape)


# ---------------------------------------------------------------- window strategies


@st.composite
def windows(draw, *, rank, pool=False, max_kernel=3):
    """(spatial shape, attributes) of a sliding window that leaves at least one output."""
    kernel = [draw(st.integers(1, max_kernel)) for _ in range(rank)]
    strides = [draw(st.integers(1, 3)) for _ in range(rank)]
    dilations = [draw(st.integers(1, 2)) for _ in range(rank)]
    extents = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    auto_pad = draw(st.sampled_from(["NOTSET", "NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"]))
    attrs = {"strides": strides, "dilations": dilations, "auto_pad": auto_pad}
    pads = [0] * (2 * rank)
    if auto_pad == "NOTSET":
        # pools keep pads inside the window, as onnxruntime requires
        pads = [draw(st.integers(0, k - 1 if pool else 2)) for k in kernel * 2]
        attrs["pads"] = pads
    spatial = [draw(st.integers(max(1, e - pads[i] - pads[rank + i]), e + 3)) for i, e in enumerate(extents)]
    if auto_pad == "VALID":
        spatial = [max(n, e) for n, e in zip(spatial, extents)]
    if pool:
        attrs["kernel_shape"] = kernel
        if auto_pad == "NOTSET":
            attrs["ceil_mode"] = draw(st.integers(0, 1))
    return tuple(spatial), attrs, kernel


@st.composite
def channels(draw):
    """(N, group, C, M)"""
    group = draw(st.integers(1, 3))
    depthwise = draw(st.booleans())
    per_in = 1 if depthwise else draw(st.integers(1, 2))
    return draw(st.integers(1, 2)), group, group * per_in, group * draw(st.integers(1, 2))


# ---------------------------------------------------------------- Conv and ConvTranspose


@SETTINGS
@given(window=st.integers(1, 2).flatmap(lambda r: windows(rank=r)), chans=channels(), bias=st.booleans(), seed=seeds())
def test_conv(window, chans, bias, seed):
    spatial, attrs, kernel = window
    n, group, c, m = chans
    rng = np.random.default_rng(seed)
    inputs = {"X": rng.standard_normal((n, c, *spatial)), "W": rng.standard_normal((m, c // group, *kernel))}
    if bias:
        inputs["B"] = rng.standard_normal(m)
    check("Conv", inputs, group=group, **attrs)


@st.composite
def transpose_windows(draw, *, rank):
    """(input spatial shape, attributes, kernel) of a ConvTranspose."""
    kernel = [draw(st.integers(1, 3)) for _ in range(rank)]
    strides = [draw(st.integers(1, 3)) for _ in range(rank)]
    dilations = [draw(st.integers(1, 2)) for _ in range(rank)]
    spatial = [draw(st.integers(1, 3)) for _ in range(rank)]
    full = [s * (n - 1) + (k - 1) * d + 1 for s, n, k, d in zip(strides, spatial, kernel, dilations)]
    attrs = {"strides": strides, "dilations": dilations}
    how = draw(st.sampled_from(["pads", "output_shape", "SAME_UPPER", "SAME_LOWER"]))
    if how == "pads":
        adjust = [draw(st.integers(0, s - 1)) for s in strides]
        room = [f + a - 1 for f, a in zip(full, adjust)]  # at least one output position
        begin = [draw(st.integers(0, min(2, r))) for r in room]
        attrs.update(output_padding=adjust, pads=begin + [draw(st.integers(0, min(2, r - b))) for r, b in zip(room, begin)])
    elif how == "output_shape":  # shorter or longer than the columns reach
        # (onnx shape inference loses the spatial dims of outputs shorter than s * (n - 1) + 1)
        attrs["output_shape"] = [draw(st.integers(max(s * (n - 1) + 1, f - 2), f + 2))
                                 for f, s, n in zip(full, strides, spatial)]
    else:
        # an output n * s longer than the columns reach is padded by the spec's reference (and
        # odt_ops) but not by onnxruntime and onnx shape inference: keep the window >= the stride
        attrs["auto_pad"] = how
        kernel = [max(k, -(-(s - 1) // d) + 1) for k, s, d in zip(kernel, strides, dilations)]
    return tuple(spatial), attrs, kernel


@SETTINGS
@given(window=st.integers(1, 2).flatmap(lambda r: transpose_windows(rank=r)), chans=channels(), bias=st.booleans(),
       seed=seeds())
def test_conv_transpose(window, chans, bias, seed):
    spatial, attrs, kernel = window
    n, group, c, m = chans
    rng = np.random.default_rng(seed)
    inputs = {"X": rng.standard_normal((n, c, *spatial)), "W": rng.standard_normal((c, m // group, *kernel))}
    if bias:
        inputs["B"] = rng.standard_normal(m)
    check("ConvTranspose", inputs, group=group, **attrs)


def test_conv_3d():
    rng = np.random.default_rng(0)
    inputs = {"X": rng.standard_normal((1, 2, 3, 4, 3)), "W": rng.standard_normal((2, 1, 2, 2, 2))}
    check("Conv", inputs, group=2, strides=[1, 2, 1], pads=[1, 0, 0, 0, 1, 1])


# ---------------------------------------------------------------- pools


def assume_regular_pool(spatial, attrs):
    """Every window holds an input element (else the max is -inf and the average 0/0), and no
    ceil_mode window starts past the input (the kernels drop it, as onnxruntime does; onnx shape
    inference keeps it)."""
    window = {k: attrs.get(k) for k in ("strides", "dilations", "pads")}
    geo = window_geometry(spatial, attrs["kernel_shape"], auto_pad=attrs["auto_pad"], ceil_mode=attrs.get("ceil_mode", 0), **window)
    assume((window_counts(spatial, geo, False) > 0).all())
    kept = [-(-(n + b + e - x) // s) + 1 for n, b, e, x, s in zip(spatial, geo.begin, geo.end, geo.extents, geo.strides)]
    assume(not attrs.get("ceil_mode") or list(geo.out) == kept)


@SETTINGS
@given(window=st.integers(1, 2).flatmap(lambda r: windows(rank=r, pool=True)), storage_order=st.integers(0, 1),
       seed=seeds())
def test_max_pool(window, storage_order, seed):
    spatial, attrs, _ = window
    assume_regular_pool(spatial, attrs)
    x = distinct(np.random.default_rng(seed), (2, 2, *spatial))
    check("MaxPool", {"X": x}, storage_order=storage_order, **attrs)


@SETTINGS
@given(window=st.integers(1, 2).flatmap(lambda r: windows(rank=r, pool=True)), include_pad=st.integers(0, 1),
       seed=seeds())
def test_average_pool(window, include_pad, seed):
    spatial, attrs, _ = window
    assume_regular_pool(spatial, attrs)
    x = np.random.default_rng(seed).standard_normal((2, 2, *spatial))
    check("AveragePool", {"X": x}, count_include_pad=include_pad, **attrs)


@FEW
@given(window=windows(rank=2, pool=True), p=st.integers(1, 3), seed=seeds())
def test_lp_pool(window, p, seed):
    spatial, attrs, _ = window
    assume_regular_pool(spatial, attrs)
    x = distinct(np.random.default_rng(seed), (1, 2, *spatial))  # away from 0, where |x|^p kinks
    check("LpPool", {"X": x}, p=p, **attrs)


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@FEW
@given(spatial=st.lists(st.integers(1, 4), min_size=1, max_size=3), seed=seeds())
def test_global_pools(op, spatial, seed):
    check(op, {"X": distinct(np.random.default_rng(seed), (2, 3, *spatial))})


# ---------------------------------------------------------------- normalizations


def normalization_inputs(rng, shape, params, *, positive=()):
    inputs = {"X": rng.standard_normal(shape)}
    for name, size in params.items():
        inputs[name] = rng.uniform(0.5, 2, size) if name in positive else rng.standard_normal(size)
    return inputs


@SETTINGS
@given(shape=st.lists(st.integers(1, 3), min_size=0, max_size=2).map(lambda s: (3, 2, *s)), training=st.booleans(),
       seed=seeds())
def test_batch_normalization(shape, training, seed):
    rng = np.random.default_rng(seed)
    c = shape[1]
    inputs = normalization_inputs(rng, shape, {"scale": c, "B": c, "mean": c, "var": c}, positive=("var",))
    if training:  # the running statistics are buffers: no gradient reaches input_mean/var
        check("BatchNormalization", inputs, ["X", "scale", "B"], outputs=("Y", "running_mean", "running_var"),
              training_mode=1, momentum=0.8)
    else:
        check("BatchNormalization", inputs, epsilon=0.01)


@SETTINGS
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data(), seed=seeds())
def test_layer_normalization(shape, data, seed):
    rank = len(shape)
    axis = data.draw(st.integers(-rank, rank - 1))
    normalized = tuple(shape[axis:])
    scale_shape = data.draw(st.sampled_from([normalized, normalized[-1:], (1,) * len(normalized)]))
    rng = np.random.default_rng(seed)
    inputs = {"X": rng.standard_normal(shape), "Scale": rng.standard_normal(scale_shape)}
    if data.draw(st.booleans()):
        inputs["B"] = rng.standard_normal(normalized)
    # a double stash (the float statistics would make the forward float32-precise) has no Mean
    # output type in the spec: the rule recomputes the statistics
    check("LayerNormalization", inputs, axis=axis, stash_type=onnx.TensorProto.DOUBLE, epsilon=0.1)


def test_layer_normalization_reuses_the_forward_statistics():
    """float32 statistics are the forward's Mean/InvStdDev outputs: the float32 gradient equals the
    float64 one (checked above) to float32 precision, and onnxruntime agrees with the Plan."""
    rng = np.random.default_rng(1)
    inputs = {"X": rng.standard_normal((3, 4, 5)), "Scale": rng.standard_normal(5), "B": rng.standard_normal(5)}
    want = gradients(build("LayerNormalization", inputs, stash_type=onnx.TensorProto.DOUBLE), inputs)
    single = {k: v.astype(np.float32) for k, v in inputs.items()}
    model = build("LayerNormalization", single)
    full, _ = training_model(with_projection_loss(model, single), list(single))
    assert any(n.op_type == "LayerNormalization" and len(n.output) == 3 for n in full.graph.node)
    got = gradients(model, single)
    for name in inputs:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name)
    ort_matches_plan(model, single)


@FEW
@given(shape=st.lists(st.integers(1, 3), min_size=1, max_size=2).map(lambda s: (2, 3, *s)), seed=seeds())
def test_instance_normalization(shape, seed):
    rng = np.random.default_rng(seed)
    check("InstanceNormalization", normalization_inputs(rng, shape, {"scale": 3, "B": 3}), epsilon=0.01)


@SETTINGS
@given(groups=st.integers(1, 3), per_group=st.integers(1, 2), spatial=st.lists(st.integers(1, 3), max_size=2), seed=seeds())
def test_group_normalization(groups, per_group, spatial, seed):
    c = groups * per_group
    inputs = normalization_inputs(np.random.default_rng(seed), (2, c, *spatial), {"scale": c, "bias": c})
    # a double stash keeps the forward float64-precise
    check("GroupNormalization", inputs, num_groups=groups, epsilon=0.1, stash_type=onnx.TensorProto.DOUBLE)


def test_group_normalization_18_scales_per_group():
    """Opset 18-20 GroupNormalization has one scale and bias per group. onnx.checker rejects that
    (deprecated) version, so this checks the gradient graph without it."""
    rng = np.random.default_rng(0)
    feeds = normalization_inputs(rng, (2, 6, 3), {"scale": 3, "bias": 3})
    loss_model = with_projection_loss(build("GroupNormalization", feeds, opset=18, num_groups=3, epsilon=0.1), feeds)
    nodes, initializers, grads = build_gradients(loss_model, "loss", list(feeds))
    loss_model.graph.node.extend(nodes)
    loss_model.graph.initializer.extend(initializers)
    got = compile_model(loss_model, list(feeds), [grads[p] for p in feeds])(feeds)
    want = numeric_gradients(compile_model(loss_model, list(feeds), ["loss"]), feeds, list(feeds))
    for name, g in zip(feeds, got):
        np.testing.assert_allclose(g, want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        ERRORS["GroupNormalization"] = max(ERRORS["GroupNormalization"], float(np.abs(g - want[name]).max()))


@SETTINGS
@given(size=st.integers(1, 5), c=st.integers(1, 5), spatial=st.lists(st.integers(1, 3), max_size=2), seed=seeds())
def test_lrn(size, c, spatial, seed):
    x = np.random.default_rng(seed).standard_normal((2, c, *spatial))
    check("LRN", {"X": x}, size=size, alpha=0.4, beta=0.75, bias=1.5)


# ---------------------------------------------------------------- Resize, DepthToSpace, SpaceToDepth

RESIZE_MODES = [("nearest", m) for m in ("asymmetric", "half_pixel", "align_corners", "tf_crop_and_resize")] + [
    (mode, m) for mode in ("linear", "cubic")
    for m in ("half_pixel", "half_pixel_symmetric", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_crop_and_resize")]


@SETTINGS
@given(modes=st.sampled_from(RESIZE_MODES), nearest=st.sampled_from(["round_prefer_floor", "round_prefer_ceil", "floor", "ceil"]),
       spatial=st.lists(st.integers(1, 4), min_size=1, max_size=2), data=st.data(), seed=seeds())
def test_resize(modes, nearest, spatial, data, seed):
    mode, transform = modes
    rank = len(spatial) + 2
    by_sizes = data.draw(st.booleans())
    attrs = {"mode": mode, "coordinate_transformation_mode": transform, "axes": list(range(2, rank))}
    if mode == "nearest":
        attrs["nearest_mode"] = nearest
    else:
        attrs.update(antialias=data.draw(st.integers(0, 1)), exclude_outside=data.draw(st.integers(0, 1)))
    consts = {"roi": np.array([0.1] * len(spatial) + [0.8] * len(spatial), dtype=np.float32)}
    if by_sizes:
        consts["scales"] = np.zeros(0, dtype=np.float32)
        consts["sizes"] = np.array([data.draw(st.integers(1, 7)) for _ in spatial], dtype=np.int64)
    else:
        consts["scales"] = np.array([data.draw(st.sampled_from([0.5, 0.75, 1.0, 1.5, 2.0, 3.0])) for _ in spatial], dtype=np.float32)
        if all(np.floor(s * n) < 1 for s, n in zip(consts["scales"], spatial)):
            consts["scales"][:] = 2.0
    x = np.random.default_rng(seed).standard_normal((2, 2, *spatial))
    check("Resize", {"X": x}, initializers=consts, **attrs)


def test_resize_integer_nearest_upsampling_is_a_sum_pool():
    """2x/3x nearest upsampling is a sum pool of dY, no interpolation matrix."""
    x = np.random.default_rng(0).standard_normal((2, 3, 2, 3))
    consts = {"roi": np.zeros(0, dtype=np.float32), "scales": np.array([2.0, 3.0], dtype=np.float32)}
    check("Resize", {"X": x}, initializers=consts, mode="nearest", axes=[2, 3])
    model = with_projection_loss(build("Resize", {"X": x}, initializers=consts, mode="nearest", axes=[2, 3]), {"X": x})
    full, _ = training_model(model, ["X"])
    gradient_ops = [n.op_type for n in full.graph.node[len(model.graph.node):]]
    assert "MatMul" not in gradient_ops
    assert "AveragePool" in gradient_ops


@pytest.mark.parametrize("mode,scale", [("linear", 2.0), ("cubic", 0.75), ("nearest", 0.5), ("linear", 0.3)])
def test_resize_long_axes_gather_their_few_taps(mode, scale):
    """An axis much longer than the outputs each input feeds is not a dense MatMul: a few Gathers."""
    x = np.random.default_rng(0).standard_normal((1, 1, 2, 70))
    consts = {"roi": np.zeros(0, dtype=np.float32), "scales": np.array([1.0, scale], dtype=np.float32)}
    attrs = dict(mode=mode, axes=[2, 3], antialias=int(scale < 1) if mode != "nearest" else 0)
    check("Resize", {"X": x}, initializers=consts, **attrs)
    model = with_projection_loss(build("Resize", {"X": x}, initializers=consts, **attrs), {"X": x})
    full, _ = training_model(model, ["X"])
    gradient_ops = [n.op_type for n in full.graph.node[len(model.graph.node):]]
    assert "Gather" in gradient_ops
    assert "MatMul" not in gradient_ops
    ort_matches_plan(build("Resize", {"X": x.astype(np.float32)}, initializers=consts, **attrs), {"X": x.astype(np.float32)})


@pytest.mark.parametrize("op,mode", [("DepthToSpace", "DCR"), ("DepthToSpace", "CRD"), ("SpaceToDepth", None)])
@FEW
@given(block=st.integers(1, 3), c=st.integers(1, 2), h=st.integers(1, 2), w=st.integers(1, 2), seed=seeds())
def test_depth_space(op, mode, block, c, h, w, seed):
    rng = np.random.default_rng(seed)
    shape = (2, c * block * block, h, w) if op == "DepthToSpace" else (2, c, h * block, w * block)
    check(op, {"X": rng.standard_normal(shape)}, blocksize=block, **({"mode": mode} if mode else {}))


# ---------------------------------------------------------------- onnxruntime executes the gradient graphs


def gradients(model, feeds):
    """{input: d loss / d input} from the Plan, for the projected loss of ``model``."""
    full, grads = training_model(with_projection_loss(model, feeds), list(feeds))
    run = compile_model(full, list(feeds), [grads[p] for p in feeds])
    assert run.executor == "odt_ops"
    return dict(zip(feeds, run(feeds)))


def ort_matches_plan(model, feeds):
    """The gradient graph of ``model`` gives the same loss and gradients in onnxruntime and the Plan."""
    ort = pytest.importorskip("onnxruntime")
    full, grads = training_model(with_projection_loss(model, feeds), list(feeds))
    names = ["loss", *[grads[p] for p in feeds]]
    run = compile_model(full, list(feeds), names)
    assert run.executor == "odt_ops"
    ours = run(feeds)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    theirs = ort.InferenceSession(full.SerializeToString(), options, providers=["CPUExecutionProvider"]).run(names, feeds)
    for name, a, b in zip(names, ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=name)


ORT_CASES = {
    "conv grouped strided": ("Conv", {"X": (2, 4, 6, 5), "W": (6, 2, 3, 2), "B": (6,)},
                             dict(group=2, strides=[2, 1], pads=[1, 0, 0, 1], dilations=[1, 2])),
    "conv depthwise same": ("Conv", {"X": (2, 3, 7, 6), "W": (3, 1, 3, 3)}, dict(group=3, strides=[2, 2], auto_pad="SAME_UPPER")),
    "conv depthwise stride 1": ("Conv", {"X": (2, 3, 6, 5), "W": (3, 1, 3, 2), "B": (3,)},
                                dict(group=3, pads=[1, 0, 2, 1], dilations=[2, 1])),
    "conv 1d unread tail": ("Conv", {"X": (2, 2, 8), "W": (3, 2, 3)}, dict(strides=[3])),
    "conv transpose": ("ConvTranspose", {"X": (2, 4, 3, 4), "W": (4, 3, 3, 2), "B": (6,)},
                       dict(group=2, strides=[2, 1], pads=[1, 0, 0, 1], output_padding=[1, 0])),
    "conv transpose output_shape": ("ConvTranspose", {"X": (2, 2, 3, 3), "W": (2, 3, 3, 3)}, dict(strides=[2, 2], output_shape=[6, 7])),
    "max pool overlapping": ("MaxPool", {"X": (2, 3, 7, 6)}, dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "max pool column-major": ("MaxPool", {"X": (2, 3, 5, 4)}, dict(kernel_shape=[2, 3], strides=[1, 1], storage_order=1)),
    "max pool ceil": ("MaxPool", {"X": (2, 3, 5, 5)}, dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    "average pool exclude pad": ("AveragePool", {"X": (2, 3, 6, 5)}, dict(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 1, 1, 0])),
    "average pool include pad": ("AveragePool", {"X": (2, 3, 6, 5)},
                                 dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], count_include_pad=1)),
    "average pool stride 1": ("AveragePool", {"X": (2, 3, 6, 5)}, dict(kernel_shape=[3, 2], pads=[1, 0, 2, 1])),
    "lp pool": ("LpPool", {"X": (2, 3, 5, 5)}, dict(kernel_shape=[2, 2], strides=[1, 2], p=2)),
    "global average pool": ("GlobalAveragePool", {"X": (2, 3, 4, 5)}, {}),
    "global max pool": ("GlobalMaxPool", {"X": (2, 3, 4, 5)}, {}),
    "batch norm training": ("BatchNormalization", {"X": (4, 3, 3, 2), "scale": (3,), "B": (3,), "mean": (3,), "var": (3,)},
                            dict(training_mode=1, outputs=("Y", "rm", "rv"))),
    "batch norm inference": ("BatchNormalization", {"X": (4, 3, 3, 2), "scale": (3,), "B": (3,), "mean": (3,), "var": (3,)}, {}),
    "instance norm": ("InstanceNormalization", {"X": (2, 3, 4, 3), "scale": (3,), "B": (3,)}, {}),
    "group norm": ("GroupNormalization", {"X": (2, 6, 3, 2), "scale": (6,), "bias": (6,)}, dict(num_groups=3)),
    "lrn": ("LRN", {"X": (2, 5, 3, 2)}, dict(size=3, alpha=0.4, beta=0.75, bias=1.5)),
    "depth to space": ("DepthToSpace", {"X": (2, 8, 2, 3)}, dict(blocksize=2, mode="CRD")),
    "space to depth": ("SpaceToDepth", {"X": (2, 2, 4, 6)}, dict(blocksize=2)),
}


@pytest.mark.parametrize("case", sorted(ORT_CASES))
def test_onnxruntime_runs_the_gradient_graph(case):
    op, shapes, attrs = ORT_CASES[case]
    attrs = dict(attrs)
    rng = np.random.default_rng(0)
    feeds = {n: (distinct(rng, s) if n == "X" else rng.uniform(0.5, 2, s)).astype(np.float32) for n, s in shapes.items()}
    ort_matches_plan(build(op, feeds, outputs=attrs.pop("outputs", ("Y",)), **attrs), feeds)


@pytest.mark.parametrize("mode,transform", [("nearest", "asymmetric"), ("linear", "half_pixel"), ("cubic", "align_corners")])
def test_onnxruntime_runs_the_resize_gradient(mode, transform):
    # scales exact in binary on lengths they divide: onnxruntime's forward then matches the reference
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    consts = {"roi": np.zeros(0, dtype=np.float32), "scales": np.array([1, 1, 2, 1.5], dtype=np.float32)}
    ort_matches_plan(build("Resize", {"X": x}, initializers=consts, mode=mode, coordinate_transformation_mode=transform), {"X": x})


# ---------------------------------------------------------------- a small CNN against torch.autograd


def cnn(dtype, rng):
    """Conv -> BatchNormalization (training) -> Relu -> MaxPool -> Conv -> AveragePool -> Flatten -> Gemm."""
    params = {
        "W1": rng.standard_normal((4, 3, 3, 3)) * 0.5, "B1": rng.standard_normal(4),
        "gamma": rng.uniform(0.5, 1.5, 4), "beta": rng.standard_normal(4),
        "W2": rng.standard_normal((6, 4, 3, 3)) * 0.3, "B2": rng.standard_normal(6),
        "W3": rng.standard_normal((5, 24)) * 0.3, "B3": rng.standard_normal(5),
    }
    buffers = {"mean": np.zeros(4), "var": np.ones(4)}
    nodes = [
        helper.make_node("Conv", ["X", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "gamma", "beta", "mean", "var"], ["bn", "rm", "rv"], training_mode=1),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p", "W2", "B2"], ["c2"], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("AveragePool", ["c2"], ["a"], kernel_shape=[2, 2], strides=[1, 1]),
        helper.make_node("Flatten", ["a"], ["f"]),
        helper.make_node("Gemm", ["f", "W3", "B3"], ["Y"], transB=1),
    ]
    feeds = {"X": rng.standard_normal((2, 3, 12, 12)), **params}
    feeds = {k: v.astype(dtype) for k, v in feeds.items()}
    model = make_model(nodes, feeds, ["Y"], initializers={k: v.astype(dtype) for k, v in buffers.items()}, symbolic=["X"])
    return model, feeds


def test_cnn_against_torch_autograd():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    model, feeds = cnn(np.float64, np.random.default_rng(0))
    loss_model = with_projection_loss(model, feeds)
    projection = next(numpy_helper.to_array(t) for t in loss_model.graph.initializer if t.name == "Y/projection")
    got = gradients(model, feeds)

    t = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    h = F.conv2d(t["X"], t["W1"], t["B1"], padding=1)
    h = F.batch_norm(h, torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), t["gamma"], t["beta"],
                     training=True, eps=1e-5)
    h = F.max_pool2d(F.relu(h), 2, 2)
    h = F.avg_pool2d(F.conv2d(h, t["W2"], t["B2"], stride=2, padding=1), 2, 1)
    y = F.linear(h.flatten(1), t["W3"], t["B3"])
    (y * torch.tensor(projection)).sum().backward()
    for name, value in t.items():
        np.testing.assert_allclose(got[name], value.grad.numpy(), rtol=1e-9, atol=1e-10, err_msg=name)


def test_cnn_on_onnxruntime():
    model, feeds = cnn(np.float32, np.random.default_rng(1))
    ort_matches_plan(model, feeds)


def test_group_normalization_21_feeding_a_broadcast_trains_as_pytorch(tmp_path):
    """onnx infers no output type for GroupNormalization-21; the broadcasting Add after it needs
    one to unbroadcast its gradient. The loader gives Y the type of X, as the spec defines it."""
    torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle here")
    from odt_ops import artifacts
    from odt_ops.api import CheckpointState, Module

    rng = np.random.default_rng(0)
    weights = {"scale": rng.standard_normal(4), "bias": rng.standard_normal(4), "shift": rng.standard_normal((4, 1, 1))}
    weights = {n: a.astype(np.float32) for n, a in weights.items()}
    graph = helper.make_graph(
        [helper.make_node("GroupNormalization", ["x", "scale", "bias"], ["g"], num_groups=2, epsilon=1e-5),
         helper.make_node("Add", ["g", "shift"], ["y"])], "gn",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4, 3, 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4, 3, 3])],
        [numpy_helper.from_array(a, n) for n, a in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    artifacts.generate_artifacts(model, requires_grad=list(weights), loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    x, target = rng.standard_normal((2, 4, 3, 3)).astype(np.float32), rng.standard_normal((2, 4, 3, 3)).astype(np.float32)
    loss = Module(tmp_path / "training_model.onnx", state)(x, target)

    t = {n: torch.tensor(a, requires_grad=True) for n, a in weights.items()}
    y = torch.nn.functional.group_norm(torch.tensor(x), 2, t["scale"], t["bias"], eps=1e-5) + t["shift"]
    want = torch.nn.functional.mse_loss(y, torch.tensor(target))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    for name, p in t.items():
        np.testing.assert_allclose(state.parameters[name].grad, p.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("exporter", [17, 20, "dynamo"])
def test_resize_to_sizes_exported_with_a_fixed_batch_trains_at_any_batch(tmp_path, exporter):
    """F.interpolate(size=...) exports a Resize whose sizes, once folded, hold the export's batch
    size. The batch is symbolic once loaded, so the Resize must leave it alone: the loss and the
    gradients at another batch size equal PyTorch's."""
    torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle here")
    import io
    import warnings

    from odt_ops import artifacts
    from odt_ops.api import CheckpointState, Module

    class Upsampler(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.head = torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Linear(3 * 8 * 8, 2)

        def forward(self, x):
            return self.head(torch.nn.functional.interpolate(self.conv(x), size=(8, 8), mode="bilinear").flatten(1))

    torch.manual_seed(0)
    net = Upsampler()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":  # it bakes the batch into its Reshapes as well: trained at the export's batch
            model, batch = torch.onnx.export(net, (torch.randn(1, 2, 4, 4),), dynamo=True, input_names=["x"], verbose=False).model_proto, 1
        else:
            buffer = io.BytesIO()
            torch.onnx.export(net, (torch.randn(1, 2, 4, 4),), buffer, opset_version=exporter, input_names=["x"], dynamo=False)
            model, batch = onnx.load_from_string(buffer.getvalue()), 3
    artifacts.generate_artifacts(model, requires_grad=["conv.weight", "head.weight"], loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    x, y = torch.randn(batch, 2, 4, 4), torch.randint(0, 2, (batch,))
    loss = Module(tmp_path / "training_model.onnx", state)(x.numpy(), y.numpy())
    want = torch.nn.functional.cross_entropy(net(x), y)
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    for name in ("conv.weight", "head.weight"):
        np.testing.assert_allclose(state.parameters[name].grad, dict(net.named_parameters())[name].grad.numpy(), rtol=1e-4, atol=1e-6)
