"""The channels-last training graph (runtime/fusion/layout.py): the benchmark's depthwise CNNs'
training plans with the layout pass against the graph as written (loss, every gradient, the
updated BatchNormalization statistics), against onnxruntime running the same artifact graph,
and the channels-last kernels against PyTorch and the channels-first kernels."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from odt_ops import meta
from odt_ops.api import CheckpointState
from odt_ops.kernels import conv as conv_kernels
from odt_ops.kernels.channels import along_rows, batch_norm_grad_rows, batch_norm_inference_rows, batch_norm_rows, unbuffered_runs
from odt_ops.kernels.nn import batch_normalization
from odt_ops.runtime.fusion import DOMAIN, layout_ops
from odt_ops.runtime.fusion.layout import SUFFIX
from odt_ops.runtime.plan import Plan

torch = pytest.importorskip("torch", reason="PyTorch defines the benchmark's CNNs and is the kernels' oracle")

# The two plans sum the batch statistics in another order: the values agree to float32 rounding of
# the sums. Values that are zero in exact arithmetic (the bias gradient of a BatchNorm whose output
# only feeds another BatchNorm, a running mean of normalized values) are that rounding alone, ~1e-8.
RTOL, ATOL = 2e-4, 1e-6


def _artifacts(name: str, directory) -> tuple[onnx.ModelProto, list[str], list[str], list[np.ndarray]]:
    from odt_ops.benchmark import configs as cfgs
    from odt_ops.benchmark.driver import odt_artifacts

    config = cfgs.CONFIGS[name]
    model = cfgs.forward_model(config)
    forward = directory / "forward.onnx"
    onnx.save(model, forward)
    out = directory / "odt"
    odt_artifacts(config, forward, out, cfgs.trainable(config, model))
    proto = onnx.load(out / "training_model.onnx")
    info = meta.read(proto)
    inputs = [*info.user_inputs, *info.labels, *info.parameters, *info.buffers]
    outputs = [info.loss, *(info.gradients[p] for p in info.trainable if p in info.gradients), *info.buffer_updates.values()]
    ckpt = CheckpointState.load_checkpoint(out / "checkpoint").checkpoint
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, *config.input_shape)).astype(np.float32)
    y = rng.integers(0, config.classes, 4).astype(np.int64)
    feeds = [x, y, *(np.asarray(ckpt.parameters[p]) for p in info.parameters), *(np.asarray(ckpt.buffers[b]) for b in info.buffers)]
    return proto, inputs, outputs, feeds


def _plan(proto, inputs, outputs, fuse) -> Plan:
    constants = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    opsets = {o.domain: o.version for o in proto.opset_import}
    return Plan(proto.graph, opsets, constants, inputs, outputs, fuse=fuse)


def _layout_ops(plan: Plan) -> Counter:
    return Counter(next(onnx.helper.get_attribute_value(a) for a in s.node.attribute if a.name == "layout_op").decode()
                   if s.node.op_type == "ChannelsLast" else s.node.op_type
                   for s in plan.steps if s.node.domain == DOMAIN)


def _assert_matches_onnxruntime(proto, inputs, outputs, feeds, got) -> None:
    """``got`` (a plan's outputs) against onnxruntime running the same artifact graph."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the spec oracle running the artifact graph")
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    given = {i.name for i in session.get_inputs()}
    reference = session.run(outputs, {n: v for n, v in zip(inputs, feeds) if n in given})
    for g, r, name_ in zip(got, reference, outputs):
        np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-5, err_msg=name_)


@pytest.mark.parametrize("name", ["mobilenetv3-adamw", "efficientnet-adamw"])
def test_channels_last_plan_trains_as_the_graph_as_written(tmp_path, name):
    proto, inputs, outputs, feeds = _artifacts(name, tmp_path)
    nhwc = _plan(proto, inputs, outputs, fuse=True)
    plain = _plan(proto, inputs, outputs, fuse=False)
    ops = _layout_ops(nhwc)
    graph_ops = Counter(n.op_type for n in proto.graph.node)
    # every BatchNormalization and every depthwise and 1x1 convolution but the stem runs channels last
    assert ops["BatchNormalization"] == graph_ops["BatchNormalization"]
    assert ops["Conv"] >= graph_ops["Conv"] - 1 - ops["ToChannelsLast"]
    assert not any(s.node.domain != DOMAIN and s.node.op_type == "BatchNormalization" for s in nhwc.steps)
    # converted only at the edges: the stem's output, the squeeze-excite's (N, C, 1, 1) values, the head
    assert ops["ToChannelsFirst"] + ops["ToChannelsLast"] < graph_ops["Conv"]
    assert ops["PointwiseWeightGrad"] > 0  # 1x1 weight gradients as one product of the channels-last matrices
    assert ops["DepthwiseWeightGrad"] > 0  # depthwise ones as a multiply and a column sum per kernel tap
    got, want = nhwc.run(feeds), plain.run(feeds)
    for g, w, name_ in zip(got, want, outputs):
        assert not name_.endswith(SUFFIX)
        assert g.shape == w.shape and g.dtype == w.dtype, name_
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=name_)

    # the eval model (BatchNormalization in inference mode) too
    eval_proto = onnx.load(tmp_path / "odt" / "eval_model.onnx")
    by_name = dict(zip(inputs, feeds))
    eval_inputs = [i.name for i in eval_proto.graph.input]
    eval_outputs = [o.name for o in eval_proto.graph.output]
    eval_feeds = [by_name[n] for n in eval_inputs]
    eval_nhwc = _plan(eval_proto, eval_inputs, eval_outputs, fuse=True)
    assert _layout_ops(eval_nhwc)["BatchNormalization"] == graph_ops["BatchNormalization"]
    for g, w in zip(eval_nhwc.run(eval_feeds), _plan(eval_proto, eval_inputs, eval_outputs, fuse=False).run(eval_feeds)):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)

    _assert_matches_onnxruntime(proto, inputs, outputs, feeds, got)


@pytest.mark.parametrize("name, weight_grads", [("cnn-adamw", 0), ("unet-adamw", 4)])
def test_a_cnn_without_depthwise_convolutions_is_left_channels_first(tmp_path, name, weight_grads):
    """Regular convolutions neither seed nor join a region: measured slower (layout.py's docstring);
    their weight gradients from 16 input channels are one product per tap (StrideOneWeightGrad).
    The fused plan trains as the graph as written and as onnxruntime runs the artifact graph."""
    proto, inputs, outputs, feeds = _artifacts(name, tmp_path)
    plan = _plan(proto, inputs, outputs, fuse=True)
    ops = _layout_ops(plan)
    assert not {"ChannelsLast", "ToChannelsFirst", "ToChannelsLast"} & set(ops)
    assert ops["StrideOneWeightGrad"] == weight_grads  # UNet's 1-channel first layer keeps its window columns
    for g, w, name_ in zip(plan.run(feeds), _plan(proto, inputs, outputs, fuse=False).run(feeds), outputs):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=name_)
    _assert_matches_onnxruntime(proto, inputs, outputs, feeds, plan.run(feeds))


def _last(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1))


@pytest.mark.parametrize("strides, pads, dilations, multiplier", [
    ([1, 1], [1, 1, 1, 1], [1, 1], 1), ([2, 2], [2, 2, 2, 2], [1, 1], 1), ([1, 2], [0, 1, 2, 0], [2, 1], 2)])
def test_channels_last_depthwise_conv_is_the_conv_kernel_bit_for_bit_and_torchs(strides, pads, dilations, multiplier):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 6, 9, 8)).astype(np.float32)
    w = rng.standard_normal((6 * multiplier, 1, 3, 5)).astype(np.float32)
    b = rng.standard_normal(6 * multiplier).astype(np.float32)
    attrs = {"group": 6, "strides": strides, "pads": pads, "dilations": dilations}
    want = conv_kernels.conv(x, w, b, **attrs)[0]
    got = conv_kernels.conv_channels_last(_last(x), w, b, **attrs)[0]
    np.testing.assert_array_equal(got, _last(want))
    padded = np.pad(x, [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])])
    oracle = torch.nn.functional.conv2d(torch.from_numpy(padded), torch.from_numpy(w), torch.from_numpy(b),
                                        stride=strides, dilation=dilations, groups=6).numpy()
    np.testing.assert_allclose(want, oracle, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel, strides, pads, dilations, bias", [
    ((3, 3), [1, 1], [1, 1, 1, 1], [1, 1], True), ((3, 2), [2, 2], [0, 1, 2, 0], [1, 1], True),
    ((3, 3), [1, 2], [2, 2, 2, 2], [2, 1], False), ((2, 2), [1, 1], [0, 0, 0, 0], [1, 1], True),
    ((3, 3), [3, 1], [0, 0, 0, 0], [1, 1], False), ((5, 1), [2, 1], [2, 0, 1, 0], [1, 3], True)])
def test_channels_last_one_group_conv_matches_torch(kernel, strides, pads, dilations, bias):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 5, 11, 9)).astype(np.float32)
    w = rng.standard_normal((7, 5, *kernel)).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float32) if bias else None
    got = conv_kernels.conv_channels_last(_last(x), w, b, strides=strides, pads=pads, dilations=dilations)[0]
    padded = np.pad(x, [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])])
    oracle = torch.nn.functional.conv2d(torch.from_numpy(padded), torch.from_numpy(w), None if b is None else torch.from_numpy(b),
                                        stride=strides, dilation=dilations).numpy()
    assert got.shape == _last(oracle).shape and got.dtype == np.float32
    np.testing.assert_allclose(got, _last(oracle), rtol=1e-5, atol=1e-5)


def test_channels_last_one_group_conv_of_one_and_three_spatial_axes_matches_torch():
    rng = np.random.default_rng(6)
    x1, w1 = rng.standard_normal((2, 4, 13)).astype(np.float32), rng.standard_normal((6, 4, 3)).astype(np.float32)
    got = conv_kernels.conv_channels_last(np.ascontiguousarray(x1.transpose(0, 2, 1)), w1, auto_pad="SAME_UPPER", strides=[2])[0]
    # ONNX's SAME_UPPER: ceil(13 / 2) = 7 outputs need (7 - 1) * 2 + 3 - 13 = 2 pads, the odd one at the end
    oracle = torch.nn.functional.conv1d(torch.from_numpy(np.pad(x1, [(0, 0), (0, 0), (1, 1)])), torch.from_numpy(w1), stride=2)
    np.testing.assert_allclose(got, oracle.numpy().transpose(0, 2, 1), rtol=1e-5, atol=1e-5)
    x3, w3 = rng.standard_normal((2, 3, 5, 6, 4)).astype(np.float32), rng.standard_normal((4, 3, 2, 3, 2)).astype(np.float32)
    got = conv_kernels.conv_channels_last(np.ascontiguousarray(x3.transpose(0, 2, 3, 4, 1)), w3, pads=[1, 0, 1, 1, 2, 0])[0]
    padded = np.pad(x3, [(0, 0), (0, 0), (1, 1), (0, 2), (1, 0)])
    oracle = torch.nn.functional.conv3d(torch.from_numpy(padded), torch.from_numpy(w3)).numpy()
    np.testing.assert_allclose(got, oracle.transpose(0, 2, 3, 4, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel, pads, dilations", [
    ((3, 3), [1, 1, 1, 1], [1, 1]), ((3, 2), [0, 1, 2, 0], [1, 1]), ((3, 3), [2, 1, 2, 1], [2, 1]), ((2, 3), [1, 2, 0, 2], [2, 2]),
    ((2, 2), [0, 0, 0, 0], [1, 1])])
@pytest.mark.parametrize("block_bytes", [None, 1000])  # None: the whole batch in one block; 1000: blocks of 20 pixels, the last one short
def test_stride_one_weight_grad_is_torchs_conv_weight_gradient(kernel, pads, dilations, block_bytes, monkeypatch):
    if block_bytes is not None:
        monkeypatch.setattr(layout_ops, "_BLOCK_BYTES", block_bytes)
        monkeypatch.setattr(layout_ops, "_BLOCK_PER_CHANNEL", 1)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 5, 9, 8)).astype(np.float32)
    w = torch.from_numpy(rng.standard_normal((7, 5, *kernel)).astype(np.float32)).requires_grad_()
    padded = torch.from_numpy(np.pad(x, [(0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])]))
    y = torch.nn.functional.conv2d(padded, w, dilation=dilations)
    dy = rng.standard_normal(tuple(y.shape)).astype(np.float32)
    y.backward(torch.from_numpy(dy))
    run = layout_ops._stride_one_weight_grad({"kernel": list(kernel), "dilations": dilations, "pads": pads}, 17)
    got = run(x, dy)[0]  # (1, C * taps, M), the rule's MatMul layout
    assert got.shape == (1, 5 * kernel[0] * kernel[1], 7) and got.dtype == np.float32
    np.testing.assert_allclose(got.reshape(5, -1, 7).transpose(2, 0, 1).reshape(w.shape), w.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_channels_last_pointwise_and_transposed_convs_match_torch():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 5, 4, 7)).astype(np.float32)
    w = rng.standard_normal((3, 5, 1, 1)).astype(np.float32)
    b = rng.standard_normal(3).astype(np.float32)
    y = conv_kernels.conv_channels_last(_last(x), w, b)[0]
    np.testing.assert_allclose(y, _last(torch.nn.functional.conv2d(*map(torch.from_numpy, (x, w, b))).numpy()), rtol=1e-5, atol=1e-5)
    # the 1x1 transposed convolution (a 1x1 Conv's input gradient) and the depthwise one, strided
    wt = rng.standard_normal((5, 3, 1, 1)).astype(np.float32)
    yt = conv_kernels.conv_transpose_channels_last(_last(x), wt)[0]
    np.testing.assert_allclose(yt, _last(torch.nn.functional.conv_transpose2d(*map(torch.from_numpy, (x, wt))).numpy()), rtol=1e-5, atol=1e-5)
    wd = rng.standard_normal((5, 1, 3, 3)).astype(np.float32)
    attrs = {"group": 5, "strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 0]}
    yd = conv_kernels.conv_transpose_channels_last(_last(x), wd, **attrs)[0]
    np.testing.assert_array_equal(yd, _last(conv_kernels.conv_transpose(x, wd, **attrs)[0]))
    oracle = torch.nn.functional.conv_transpose2d(torch.from_numpy(x), torch.from_numpy(wd), stride=2, padding=1,
                                                  output_padding=(1, 0), groups=5).numpy()
    np.testing.assert_allclose(yd, _last(oracle), rtol=1e-5, atol=1e-5)


def test_batch_norm_rows_and_their_gradient_match_torch():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 7, 5, 6)).astype(np.float32) * 3 + 1
    dy = rng.standard_normal(x.shape).astype(np.float32)
    scale, bias = rng.standard_normal(7).astype(np.float32), rng.standard_normal(7).astype(np.float32)
    mean, var = rng.standard_normal(7).astype(np.float32), rng.random(7).astype(np.float32) + 0.5
    rows, dy_rows = _last(x).reshape(-1, 7), _last(dy).reshape(-1, 7)
    y, running_mean, running_var = batch_norm_rows(rows, scale, bias, mean, var, 1e-5, 0.9)
    tx = torch.from_numpy(x).requires_grad_()
    ts, tb = torch.from_numpy(scale).requires_grad_(), torch.from_numpy(bias).requires_grad_()
    tm, tv = torch.from_numpy(mean.copy()), torch.from_numpy(var.copy())
    ty = torch.nn.functional.batch_norm(tx, tm, tv, ts, tb, training=True, momentum=0.1, eps=1e-5)
    ty.backward(torch.from_numpy(dy))
    np.testing.assert_allclose(y.reshape(4, 5, 6, 7), _last(ty.detach().numpy()), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(running_mean, tm.numpy(), rtol=1e-5, atol=1e-6)
    # ONNX keeps the population variance; PyTorch's running variance is the unbiased one
    n = rows.shape[0]
    np.testing.assert_allclose(running_var, 0.9 * var + 0.1 * (tv.numpy() - 0.9 * var) / 0.1 * (n - 1) / n, rtol=1e-5, atol=1e-6)
    dx, dscale, dbias = batch_norm_grad_rows(rows, dy_rows, scale, np.float32(1 / n), np.float32(1e-5))
    np.testing.assert_allclose(dx.reshape(4, 5, 6, 7), _last(tx.grad.numpy()), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dscale, ts.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dbias, tb.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_inference_batch_norm_rows_are_the_channels_first_kernel_bit_for_bit():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 10, 4, 5)).astype(np.float32)
    scale, bias, mean = (rng.standard_normal(10).astype(np.float32) for _ in range(3))
    var = rng.random(10).astype(np.float32) + 0.1
    want = batch_normalization(x, scale, bias, mean, var, epsilon=1e-3)[0]
    got = batch_norm_inference_rows(_last(x).reshape(-1, 10), scale, bias, mean, var, 1e-3)
    np.testing.assert_array_equal(got.reshape(3, 4, 5, 10), _last(want))
    oracle = torch.nn.functional.batch_norm(*map(torch.from_numpy, (x, mean, var, scale, bias)), training=False, eps=1e-3)
    np.testing.assert_allclose(want, oracle.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, channels", [(2048, 16), (128, 96), (96, 240), (7, 5)])  # (7, 5): no block, plain broadcast
@pytest.mark.parametrize("ufunc", [np.subtract, np.multiply, np.add])
def test_along_rows_is_numpys_broadcast_bit_for_bit_with_and_without_the_buffer(rows, channels, ufunc):
    """The spelled-out rows, in and out of ``unbuffered_runs``, are numpy's own broadcast of the values
    along the rows (the oracle): the same elementwise operation, so the same bits, values of another
    dtype cast as astype casts them."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((rows, channels)).astype(np.float32)
    values = rng.standard_normal(channels)  # float64: cast to x's float32
    want = ufunc(x, values.astype(np.float32))
    np.testing.assert_array_equal(along_rows(ufunc, x, values), want)
    with unbuffered_runs(16):
        out = np.empty_like(x)
        assert along_rows(ufunc, x, values, out=out) is not None
        np.testing.assert_array_equal(out, want)


def test_unbuffered_runs_sets_and_restores_numpys_buffer_size():
    before = np.getbufsize()
    with unbuffered_runs(1000):
        assert np.getbufsize() == 992  # the multiple of 16 numpy takes, no longer than the run
    assert np.getbufsize() == before
    with pytest.raises(RuntimeError), unbuffered_runs(10):
        assert np.getbufsize() == 16
        raise RuntimeError
    assert np.getbufsize() == before
    with unbuffered_runs(1 << 30):  # never more than numpy's own buffer
        assert np.getbufsize() == before


@pytest.mark.parametrize("shape, kernel, strides, pads, dilations", [
    ((2, 9, 8, 6), (3, 3), [2, 2], [1, 1, 1, 1], [1, 1]), ((2, 9, 8, 6), (3, 3), [2, 2], [0, 1, 2, 0], [1, 1]),
    ((2, 11, 10, 5), (3, 2), [3, 2], [2, 0, 1, 1], [2, 3]), ((1, 7, 9, 4), (5, 5), [2, 1], [2, 2, 2, 2], [1, 1]),
    ((2, 8, 8, 3), (2, 2), [2, 2], [0, 0, 0, 0], [1, 1])])
def test_strided_depthwise_conv_is_the_per_tap_multiply_add_bit_for_bit(shape, kernel, strides, pads, dilations):
    """Taps read from phase planes: the graph's depthwise Conv as written (tap by tap in row-major
    order, product then sum, spelled out here on numpy's padded array) bit for bit, and torch's."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal(shape).astype(np.float32)  # (N, H, W, C)
    c = shape[-1]
    w = rng.standard_normal((c, 1, *kernel)).astype(np.float32)
    attrs = {"group": c, "strides": strides, "pads": pads, "dilations": dilations}
    got = conv_kernels.conv_channels_last(x, w, **attrs)[0]
    padded = np.pad(x, [(0, 0), (pads[0], pads[2]), (pads[1], pads[3]), (0, 0)])
    want = None
    for i, j in np.ndindex(*kernel):
        tap = padded[:, i * dilations[0]::strides[0], j * dilations[1]::strides[1]][:, :got.shape[1], :got.shape[2]]
        term = tap * w[:, 0, i, j]
        want = term if want is None else want + term
    np.testing.assert_array_equal(got, want)
    oracle = torch.nn.functional.conv2d(torch.from_numpy(np.ascontiguousarray(padded.transpose(0, 3, 1, 2))), torch.from_numpy(w),
                                        stride=strides, dilation=dilations, groups=c).numpy()
    np.testing.assert_allclose(got, _last(oracle), rtol=1e-5, atol=1e-5)


_PLAIN_1X1 = [{}, {"pads": [0, 0, 0, 0], "strides": [1, 1], "kernel_shape": [1, 1], "dilations": [2, 2]}]


# padded or strided 1x1 Convs take the general kernel (the channels-last ConvTranspose has none: the pass
# admits only plain 1x1 ones)
@pytest.mark.parametrize("op, attrs", [*(("Conv", a) for a in [*_PLAIN_1X1, {"pads": [1, 0, 1, 0]}, {"strides": [2, 1]}]),
                                       *(("ConvTranspose", a) for a in _PLAIN_1X1)])
@pytest.mark.parametrize("bias", [True, False])
def test_bound_channels_last_1x1_conv_is_the_kernel_bit_for_bit_and_torchs(op, attrs, bias):
    """The ChannelsLast node's Conv and ConvTranspose (the 1x1 ones called straight) against the channels-last
    kernels (bit for bit) and torch's conv2d / conv_transpose2d."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 6, 5, 4)).astype(np.float32)  # (N, C, H, W)
    w = rng.standard_normal((7, 6, 1, 1) if op == "Conv" else (6, 7, 1, 1)).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float32) if bias else None
    run = layout_ops._channels_last_op({"layout_op": op, "layout_outputs": 1, **attrs}, 17)
    args = (_last(x), w) if b is None else (_last(x), w, b)
    got = run(*args)[0]
    kernel = conv_kernels.conv_channels_last if op == "Conv" else conv_kernels.conv_transpose_channels_last
    np.testing.assert_array_equal(got, kernel(*args, **attrs)[0])
    tensors = [torch.from_numpy(a) for a in (x, w)] + [None if b is None else torch.from_numpy(b)]
    pads = attrs.get("pads", [0, 0, 0, 0])
    if op == "Conv":
        oracle = torch.nn.functional.conv2d(*tensors, stride=attrs.get("strides", 1), padding=(pads[0], pads[1]))
    else:
        oracle = torch.nn.functional.conv_transpose2d(*tensors, stride=attrs.get("strides", 1), padding=(pads[0], pads[1]))
    np.testing.assert_allclose(got, _last(oracle.numpy()), rtol=1e-5, atol=1e-5)
