"""The runtime's compiled plan, each rewrite against the artifact graph run node by node
as written: fusions (Plan(fuse=True) vs fuse=False, bit for bit), gradients computed
straight into their buffers (destinations), checks that stop a run before any
destination is written; the generated run's error messages and the profiler's hook."""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from odt_ops import artifacts, meta
from odt_ops.api import CheckpointState, Module, TrainingDivergedError
from odt_ops.errors import ArgumentError, KernelError
from odt_ops.onnxblock import loss as losses
from odt_ops.runtime.plan import Plan
from tests.odt_ops.models import classification_data, cnn, mlp


def _training_plan(directory, **options) -> tuple[Plan, meta.ArtifactInfo]:
    proto = onnx.load(directory / "training_model.onnx")
    info = meta.read(proto)
    outputs = [info.loss, *info.extra_outputs, *(info.gradients[p] for p in info.trainable if p in info.gradients),
               *info.buffer_updates.values()]
    inputs = [*info.user_inputs, *info.labels, *info.parameters, *info.buffers]
    constants = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    opsets = {o.domain: o.version for o in proto.opset_import}
    return Plan(proto.graph, opsets, constants, inputs, outputs, rng=np.random.default_rng(0), **options), info


def _feeds(directory, info, x, y) -> list[np.ndarray]:
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    ckpt = state.checkpoint
    return [x, y, *(np.asarray(ckpt.parameters[p]) for p in info.parameters), *(np.asarray(ckpt.buffers[b]) for b in info.buffers)]


def _generate(tmp_path, model, loss=artifacts.LossType.CrossEntropyLoss, trainable=("*",)):
    artifacts.generate_artifacts(model, requires_grad=list(trainable), loss=loss, artifact_directory=tmp_path)
    return tmp_path


def _assert_fused_equals_unfused(directory, x, y, rounded: frozenset[str] = frozenset()) -> Plan:
    """Every output bit for bit, but the ``rounded`` ones (a fusion that sums in another order:
    ProductSum, StrideOneWeightGrad) to float32 rounding of their largest element (observed: under 1e-6)."""
    fused, info = _training_plan(directory, fuse=True)
    plain, _ = _training_plan(directory, fuse=False)
    assert len(fused.steps) < len(plain.steps)
    assert not plain.fusions
    assert rounded <= set(fused.output_names)
    feeds = _feeds(directory, info, x, y)
    for got, want, name in zip(fused.run(feeds), plain.run(feeds), fused.output_names):
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        if name in rounded:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()), err_msg=name)
        else:
            np.testing.assert_array_equal(got, want, err_msg=name)
    return fused


def _cnn_data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 1, 28, 28)).astype(np.float32), rng.integers(0, 10, n)


def test_mlp_fused_plan_equals_the_graph_as_written(tmp_path):
    directory = _generate(tmp_path, mlp((784, 32, 10)), trainable=["fc*"])
    x, y = classification_data(16)
    fused = _assert_fused_equals_unfused(directory, x, y)
    assert Counter(fused.fusions) == {"SoftmaxCrossEntropyLossGrad": 1, "GemmRelu": 1, "DivideBySize": 1}
    # both bias gradients lost their Squeeze: ReduceSum(keepdims=0) in its place
    assert not any(s.node.op_type == "Squeeze" for s in fused.steps)


def _gated_mlp() -> onnx.ModelProto:
    """x -> Gemm -> Sigmoid and Gemm -> Tanh, multiplied (an LSTM cell's output gate times its
    squashed state) -> Gemm logits: the gradient has one Sigmoid and one Tanh rule."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in (("wg", (12, 8)), ("wc", (12, 8)), ("wo", (10, 12)))]
    nodes = [helper.make_node("Gemm", ["x", "wg"], ["g"], transB=1, name="gate"),
             helper.make_node("Sigmoid", ["g"], ["sg"], name="sigmoid"),
             helper.make_node("Gemm", ["x", "wc"], ["c"], transB=1, name="cell"),
             helper.make_node("Tanh", ["c"], ["tc"], name="tanh"),
             helper.make_node("Mul", ["sg", "tc"], ["h"], name="gated"),
             helper.make_node("Gemm", ["h", "wo"], ["logits"], transB=1, name="head")]
    graph = helper.make_graph(nodes, "gated", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_sigmoid_and_tanh_gradients_fuse_bit_for_bit(tmp_path):
    directory = _generate(tmp_path, _gated_mlp())
    x, y = classification_data(16, features=8)
    fused = _assert_fused_equals_unfused(directory, x, y)
    assert Counter(fused.fusions)["SigmoidGrad"] == 1
    assert Counter(fused.fusions)["TanhGrad"] == 1


@pytest.mark.parametrize("batchnorm", [False, True])
def test_cnn_fused_plan_equals_the_graph_as_written(tmp_path, batchnorm):
    directory = _generate(tmp_path, cnn(batchnorm=batchnorm), trainable=["conv*", "fc*", *(["bn1.weight", "bn1.bias"] if batchnorm else [])])
    fused = _assert_fused_equals_unfused(directory, *_cnn_data(8))
    # the two convolutions' weight-gradient columns: zero-padded taps read as row windows
    assert Counter(fused.fusions) == {"ScatterIntoZeros": 2, "SoftmaxCrossEntropyLossGrad": 1, "WindowColumns": 2,
                                     "DivideBySize": 2 if batchnorm else 1, **({"NormalizationTrainingGrad": 1} if batchnorm else {})}
    # both MaxPool gradients scatter only where the ReLU before the pool let the value through
    assert [len(s.node.input) for s in fused.steps if s.node.op_type == "ScatterIntoZeros"] == [4, 4]
    assert not any(s.node.op_type in ("Greater", "Where", "ConstantOfShape", "ScatterElements") for s in fused.steps)
    if not batchnorm:  # (BatchNormalization's own gradient has Unsqueezes)
        assert not any(s.node.op_type in ("Unsqueeze", "Concat") for s in fused.steps)
    # the window taps are one node; a Slice is left only where an input gradient flips a kernel
    assert all(s.node.input[0].endswith(".weight") for s in fused.steps if s.node.op_type == "Slice")


def _instance_normed(grouped: bool) -> onnx.ModelProto:
    """Conv 6 3x3 -> InstanceNormalization (per channel; or, as torch exports GroupNorm(3, 6), over
    (N, 3, 2*H*W) between two Reshapes, then the affine Mul and Add) -> ReLU -> Flatten -> Gemm 10."""
    rng = np.random.default_rng(1)
    arrays = {"conv.weight": rng.standard_normal((6, 1, 3, 3)), "conv.bias": np.zeros(6)}
    nodes = [helper.make_node("Conv", ["input", "conv.weight", "conv.bias"], ["c"], pads=[1, 1, 1, 1])]
    if grouped:
        arrays.update({"groups": np.array([0, 3, -1]), "back": np.array([0, 6, 7, 7]), "ones": np.ones(3), "zeros": np.zeros(3),
                       "gn.weight": rng.uniform(0.5, 2, (6, 1, 1)), "gn.bias": rng.standard_normal((6, 1, 1))})
        nodes += [helper.make_node("Reshape", ["c", "groups"], ["g"]),
                  helper.make_node("InstanceNormalization", ["g", "ones", "zeros"], ["gn"], epsilon=1e-5),
                  helper.make_node("Reshape", ["gn", "back"], ["r"]),
                  helper.make_node("Mul", ["r", "gn.weight"], ["s"]), helper.make_node("Add", ["s", "gn.bias"], ["n"])]
    else:
        arrays.update({"in.weight": rng.uniform(0.5, 2, 6), "in.bias": rng.standard_normal(6)})
        nodes.append(helper.make_node("InstanceNormalization", ["c", "in.weight", "in.bias"], ["n"], epsilon=1e-5))
    arrays["fc.weight"] = rng.standard_normal((10, 6 * 7 * 7)) * 0.1
    nodes += [helper.make_node("Relu", ["n"], ["h"]), helper.make_node("Flatten", ["h"], ["f"], axis=1),
              helper.make_node("Gemm", ["f", "fc.weight"], ["output"], transB=1)]
    inits = [numpy_helper.from_array(v.astype(np.int64 if n in ("groups", "back") else np.float32), n) for n, v in arrays.items()]
    graph = helper.make_graph(nodes, "instance_normed", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 7, 7])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("grouped", [False, True])
def test_instance_norm_gradient_fuses_bit_for_bit(tmp_path, grouped):
    """InstanceNormalization's rule has BatchNormalization's shape with per-instance statistics:
    the same fused node runs it, equal to the graph as written."""
    trainable = ["conv*", "fc*", "gn.*"] if grouped else ["conv*", "fc*", "in.*"]
    directory = _generate(tmp_path, _instance_normed(grouped), trainable=trainable)
    rng = np.random.default_rng(2)
    # GroupNorm's gamma gradient, ReduceSum(Mul(dY, normalized)), is one ProductSum (per-plane dot products)
    rounded = frozenset({"gn.weight_grad"}) if grouped else frozenset()
    fused = _assert_fused_equals_unfused(directory, rng.standard_normal((4, 1, 7, 7)).astype(np.float32), rng.integers(0, 10, 4), rounded)
    assert Counter(fused.fusions)["NormalizationTrainingGrad"] == 1
    assert Counter(fused.fusions)["ProductSum"] == (1 if grouped else 0)


WEIGHT = [0.5, 2.0, 1.0, 0.25, 1.0, 1.0, 1.0, 1.0, 3.0, 1.0]
# (loss, fused): with reduction "none" the per-sample loss's gradient is shaped by the loss
# itself (a cycle through the fused node), so those stay as written
def _pooled(order: str, **pool) -> onnx.ModelProto:
    """Conv 4 3x3 -> ReLU and MaxPool in ``order`` -> Flatten -> Gemm 10 on 1x9x9."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 1, 3, 3)).astype(np.float32), "conv.weight"),
             numpy_helper.from_array(np.zeros(4, np.float32), "conv.bias")]
    layers = {"relu": lambda x, y: helper.make_node("Relu", [x], [y]),
              "pool": lambda x, y: helper.make_node("MaxPool", [x], [y], **pool)}
    nodes, x = [helper.make_node("Conv", ["input", "conv.weight", "conv.bias"], ["c"], pads=[1, 1, 1, 1])], "c"
    for i, name in enumerate(order.split("-")):
        nodes.append(layers[name](x, f"h{i}"))
        x = f"h{i}"
    nodes.append(helper.make_node("Flatten", [x], ["f"], axis=1))
    features = 4 * (5 if pool.get("pads") else 4) ** 2
    inits.append(numpy_helper.from_array(rng.standard_normal((10, features)).astype(np.float32), "fc.weight"))
    nodes.append(helper.make_node("Gemm", ["f", "fc.weight"], ["output"], transB=1))
    graph = helper.make_graph(nodes, "pooled", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 9, 9])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 10])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize("order, pool, masked", [
    ("relu-pool", {"kernel_shape": [2, 2], "strides": [2, 2]}, True),
    ("relu-pool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, True),  # overlapping: added
    ("pool-relu", {"kernel_shape": [2, 2], "strides": [2, 2]}, False),
    ("pool-relu", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, False),
])
def test_max_pool_gradient_scatters_into_fresh_zeros(tmp_path, order, pool, masked):
    directory = _generate(tmp_path, _pooled(order, **pool))
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 1, 9, 9)).astype(np.float32)
    x[0, 0, :4, :4] = 0  # windows of ties (and of zeros after the ReLU)
    fused = _assert_fused_equals_unfused(directory, x, rng.integers(0, 10, 6))
    scatters = [s for s in fused.steps if s.node.op_type == "ScatterIntoZeros"]
    assert [len(s.node.input) == 4 for s in scatters] == [masked]


@pytest.mark.parametrize("conv", [
    {"strides": [2, 2], "pads": [1, 1, 1, 1]},
    {"dilations": [2, 2], "pads": [2, 0, 1, 3]},
    {"strides": [2, 1], "pads": [0, 2, 2, 0], "kernel_shape": [2, 3]},
    {"strides": [3, 3]},  # no padding, and windows that stop short of the end
    # stride 1 with rows as long as the input's: the columns read as row windows (WindowColumns)
    {"pads": [1, 1, 1, 1]},
    {"dilations": [2, 2], "pads": [2, 2, 2, 2]},
    {"pads": [0, 2, 2, 0], "kernel_shape": [2, 3]},
])
def test_conv_weight_gradient_taps_with_strides_dilations_and_pads(tmp_path, conv):
    rng = np.random.default_rng(3)
    kernel = conv.get("kernel_shape", [3, 3])
    inits = [numpy_helper.from_array(rng.standard_normal((4, 2, *kernel)).astype(np.float32), "conv.weight")]
    graph = helper.make_graph(
        [helper.make_node("Conv", ["input", "conv.weight"], ["c"], **conv), helper.make_node("Flatten", ["c"], ["f"]),
         helper.make_node("ReduceSum", ["f", "axes"], ["output"], keepdims=0)], "conv",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 2, 11, 10])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch"])],
        [*inits, numpy_helper.from_array(np.array([1], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    directory = _generate(tmp_path, model, loss=artifacts.LossType.MSELoss, trainable=["conv.weight"])
    x = rng.standard_normal((3, 2, 11, 10)).astype(np.float32)
    fused = _assert_fused_equals_unfused(directory, x, rng.standard_normal(3).astype(np.float32))
    # the mean loss divides by the batch size; zero-padded stride-1 taps are one WindowColumns
    padded_stride_one = any(conv.get("pads", [0])) and all(s == 1 for s in conv.get("strides", [1, 1]))
    assert sorted(fused.fusions) == ["DivideBySize", "WindowColumns" if padded_stride_one else "StackedSlices"]


CROSS_ENTROPY = {
    "sum": (losses.CrossEntropyLoss(reduction="sum"), True),
    "weight": (losses.CrossEntropyLoss(weight=WEIGHT), True),
    "ignore_index": (losses.CrossEntropyLoss(ignore_index=1), True),
    "weight_ignore_index_sum": (losses.CrossEntropyLoss(weight=WEIGHT, ignore_index=1, reduction="sum"), True),
    "none": (losses.CrossEntropyLoss(reduction="none"), False),
    "label_smoothing": (losses.CrossEntropyLoss(label_smoothing=0.1), False),
    "all_options": (losses.CrossEntropyLoss(weight=WEIGHT, ignore_index=1, label_smoothing=0.3), False),
}


@pytest.mark.parametrize("case", list(CROSS_ENTROPY))
def test_cross_entropy_options_fused_equal_the_graph(tmp_path, case):
    loss, fusable = CROSS_ENTROPY[case]
    directory = _generate(tmp_path, mlp((20, 16, 10)), loss=loss, trainable=["fc*"])
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((12, 20)).astype(np.float32), rng.integers(0, 10, 12)
    y[:3] = 1  # something for ignore_index to ignore
    fused, info = _training_plan(directory)
    plain, _ = _training_plan(directory, fuse=False)
    feeds = _feeds(directory, info, x, y)
    for got, want, name in zip(fused.run(feeds), plain.run(feeds), fused.output_names):
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert ("SoftmaxCrossEntropyLossGrad" in fused.fusions) == fusable


@pytest.mark.parametrize("formulation", [None, "columns32", "swapped"])
def test_gradients_are_computed_into_their_destinations(tmp_path, monkeypatch, formulation):
    """Also when the weight gradients' products are forced to another formulation
    (kernels/products.py): the writer computes the product its kernel would, into the destination."""
    if formulation:
        monkeypatch.setenv("ODT_GEMM", formulation)
    directory = _generate(tmp_path, mlp((784, 96, 10)), trainable=["fc*"])
    plain, info = _training_plan(directory)
    grads = [info.gradients[p] for p in info.trainable]
    shapes = [a.shape for a in plain.run(_feeds(directory, info, *classification_data(4)))[1:]]
    plan, _ = _training_plan(directory, destinations=grads)
    # the weight gradients come from Gemm nodes that write in place; the bias ones are copied
    assert plan.in_place == sorted(info.gradients[p] for p in ("fc0.weight", "fc1.weight"))
    feeds = _feeds(directory, info, *classification_data(16))
    want = plain.run(feeds)
    for order in ("C", "F"):  # destinations of either layout
        buffers = [np.full(s, np.nan, np.float32, order=order) for s in shapes]
        got = plan.run(feeds, into=buffers)
        for i, g in enumerate(grads):
            assert got[1 + i] is buffers[i]
            if order == "C":
                np.testing.assert_array_equal(buffers[i], want[1 + i], err_msg=g)
            else:  # BLAS computes an F-ordered product as the transposed one: the same sums in another order
                np.testing.assert_allclose(buffers[i], want[1 + i], rtol=1e-5, atol=1e-7, err_msg=g)
        np.testing.assert_array_equal(got[0], want[0])
    if formulation:  # the writers multiplied through their nodes' records, as forced
        chosen = [line for lines in plan.formulations().values() for line in lines]
        assert sum(line.startswith("96x16 @ 16x784 TN") for line in chosen) == 1, chosen  # fc0.weight's gradient
        assert all(line.endswith(f": {formulation}") for line in chosen), chosen
    # without destinations, the same plan returns fresh arrays and leaves the last ones alone
    before = [b.copy() for b in buffers]
    again = plan.run(_feeds(directory, info, *classification_data(16, seed=3)))
    assert all(np.array_equal(b, c) for b, c in zip(buffers, before))
    assert not all(np.array_equal(again[1 + i], before[i]) for i in range(len(grads)))


def test_a_failed_check_stops_the_run_before_any_destination_is_written(tmp_path):
    directory = _generate(tmp_path, mlp((784, 32, 10)), trainable=["fc*"])
    plain, info = _training_plan(directory)
    shapes = [a.shape for a in plain.run(_feeds(directory, info, *classification_data(4)))[1:]]
    buffers = [np.full(s, 7.0, np.float32) for s in shapes]
    seen = []

    def refuse(loss):
        seen.append(float(loss))
        raise TrainingDivergedError("refused")

    plan, _ = _training_plan(directory, destinations=[info.gradients[p] for p in info.trainable], checks={info.loss: refuse})
    with pytest.raises(TrainingDivergedError, match="refused"):
        plan.run(_feeds(directory, info, *classification_data(16)), into=buffers)
    assert len(seen) == 1
    assert all((b == 7.0).all() for b in buffers)


def test_module_leaves_gradients_untouched_when_the_loss_diverges(tmp_path):
    directory = _generate(tmp_path, mlp((784, 32, 10)), trainable=["fc*"])
    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state)
    x, y = classification_data(8)
    module(x, y)
    grads = {n: state.parameters[n].grad.copy() for n in state.parameters.keys()}  # noqa: SIM118 - iterating gives (name, value), as ORT's
    module.lazy_reset_grad()
    x[0, 0] = np.inf
    with pytest.raises(TrainingDivergedError):
        module(x, y)
    assert all(np.array_equal(state.parameters[n].grad, g) for n, g in grads.items())


def _two_nodes() -> onnx.GraphProto:
    return helper.make_graph(
        [helper.make_node("Relu", ["a"], ["r"], name="first"), helper.make_node("MatMul", ["r", "b"], ["y"], name="second")],
        "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, None), helper.make_tensor_value_info("b", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])


def test_a_failing_kernel_is_named_with_its_inputs():
    plan = Plan(_two_nodes(), {"": 21}, {}, ["a", "b"], ["y"])
    with pytest.raises(KernelError, match=r"MatMul node 'second' failed on inputs \(float32\[2,3\], float32\[4,5\]\)"):
        plan.run([np.ones((2, 3), np.float32), np.ones((4, 5), np.float32)])


def test_instrument_wraps_every_kernel_and_undoes_it():
    plan = Plan(_two_nodes(), {"": 21}, {}, ["a", "b"], ["y"])
    calls = []

    def wrap(step, fn):
        return lambda *args, **kwargs: (calls.append(step.node.name), fn(*args, **kwargs))[1]

    feeds = [np.ones((2, 3), np.float32), np.ones((3, 4), np.float32)]
    plan.instrument(wrap)
    (y,) = plan.run(feeds)
    assert calls == ["first", "second"]
    assert y.shape == (2, 4)
    plan.instrument(None)
    plan.run(feeds)
    assert calls == ["first", "second"]


def _reduce_squeeze_graph() -> onnx.GraphProto:
    return helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["r"], keepdims=1), helper.make_node("Squeeze", ["r", "axes"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([0], np.int64), "axes")])


@pytest.mark.parametrize("outputs, fused", [(["y"], True), (["y", "r"], False)])  # r wanted by the caller: kept
def test_a_fusion_keeps_every_value_the_caller_asks_for(outputs, fused):
    constants = {"axes": np.array([0], np.int64)}
    plan = Plan(_reduce_squeeze_graph(), {"": 21}, constants, ["x"], outputs)
    assert any(s.node.op_type == "Squeeze" for s in plan.steps) != fused
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got = plan.run([x])
    np.testing.assert_array_equal(got[0], x.sum(0))
    if len(outputs) > 1:
        np.testing.assert_array_equal(got[1], x.sum(0, keepdims=True))


def test_fusions_can_be_named_or_switched_off(monkeypatch):
    constants = {"axes": np.array([0], np.int64)}
    squeezes = lambda plan: sum(s.node.op_type == "Squeeze" for s in plan.steps)
    assert squeezes(Plan(_reduce_squeeze_graph(), {"": 21}, constants, ["x"], ["y"], fuse=["stacked_slices"])) == 1
    assert squeezes(Plan(_reduce_squeeze_graph(), {"": 21}, constants, ["x"], ["y"], fuse=["reduce_squeeze"])) == 0
    monkeypatch.setenv("ODT_FUSE", "0")
    assert squeezes(Plan(_reduce_squeeze_graph(), {"": 21}, constants, ["x"], ["y"])) == 1
    with pytest.raises(ArgumentError, match="unknown fusion"):
        Plan(_reduce_squeeze_graph(), {"": 21}, constants, ["x"], ["y"], fuse=["no_such_fusion"])


def test_destinations_outside_the_outputs_are_our_error():
    constants = {"axes": np.array([0], np.int64)}
    with pytest.raises(ArgumentError, match=r"destinations.*\['z'\]"):
        Plan(_reduce_squeeze_graph(), {"": 21}, constants, ["x"], ["y"], destinations=["z"])


def _personal() -> onnx.ModelProto:
    """784-64 frozen, ReLU, Gemm 10 head trained (transB=1), the benchmark's personalization shape."""
    return mlp((784, 64, 10))


def _train_three_steps(directory, x, y) -> tuple[Module, CheckpointState]:
    from odt_ops.api import Optimizer

    state = CheckpointState.load_checkpoint(directory / "checkpoint")
    module = Module(directory / "training_model.onnx", state, directory / "eval_model.onnx")
    opt = Optimizer(directory / "optimizer_model.onnx", module)
    for i in range(3):
        module(x[i::3], y[i::3])
        module(x[i::3][::-1], y[i::3][::-1])  # accumulated
        opt.step()
        module.lazy_reset_grad()
    return module, state


def test_weights_stored_transposed_train_exactly_as_row_major_ones(tmp_path, monkeypatch):
    """A weight that only enters Gemm as B with transB=1 is stored column by column; the user
    sees the same values, flat buffers stay row-major per parameter, training is unchanged up to
    float32 rounding (BLAS may sum a product of a few rows in another order for another layout;
    SGD keeps those differences at rounding size, where Adam's normalization could magnify them
    on near-zero gradients)."""
    import odt_ops.api.module as module_api

    artifacts.generate_artifacts(_personal(), requires_grad=["fc1.*"], frozen_params=["fc0.*"], artifact_directory=tmp_path,
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD)
    x, y = classification_data(24)
    module, state = _train_three_steps(tmp_path, x, y)
    assert module.params.transposed == {"fc1.weight"}
    assert module.frozen.transposed == {"fc0.weight"}
    assert state.parameters["fc0.weight"].data.flags.f_contiguous
    assert state.parameters["fc1.weight"].grad.flags.f_contiguous
    monkeypatch.setattr(module_api, "_transposed_weights", lambda graph, names: frozenset())
    plain, plain_state = _train_three_steps(tmp_path, x, y)
    assert not plain.params.transposed
    for name in plain_state.parameters.keys():  # noqa: SIM118 - iterating gives (name, value), as ORT's
        close = dict(rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(state.parameters[name].data, plain_state.parameters[name].data, **close)
        if plain_state.parameters[name].grad is not None:
            np.testing.assert_allclose(state.parameters[name].grad, plain_state.parameters[name].grad, **close)
    flat = module.get_contiguous_parameters()
    np.testing.assert_allclose(flat, plain.get_contiguous_parameters(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(flat[: 10 * 64], state.parameters["fc1.weight"].data.ravel())  # row-major
    module.copy_buffer_to_parameters(flat[::-1].copy(), trainable_only=False)
    np.testing.assert_array_equal(module.get_contiguous_parameters(), flat[::-1])
    CheckpointState.save_checkpoint(state, tmp_path / "saved", include_optimizer_state=True)
    again = CheckpointState.load_checkpoint(tmp_path / "saved")
    for name in state.parameters.keys():  # noqa: SIM118 - iterating gives (name, value), as ORT's
        np.testing.assert_array_equal(again.parameters[name].data, state.parameters[name].data, err_msg=name)


@pytest.mark.parametrize("shared", [False, True])
def test_relu_runs_in_place_only_on_a_product_nothing_else_reads(shared):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((6, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Relu", ["p"], ["r"])]
    # with the product also read by an Add, an in-place ReLU would change what the Add sees
    nodes.append(helper.make_node("Add", ["p", "r"] if shared else ["r", "r"], ["out"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", 4])])
    x = rng.standard_normal((5, 6)).astype(np.float32)
    plans = [Plan(graph, {"": 21}, {"w": w}, ["x"], ["out"], fuse=fuse) for fuse in (True, False)]
    assert plans[0].fusions == ([] if shared else ["MatMulRelu"])
    np.testing.assert_array_equal(plans[0].run([x])[0], plans[1].run([x])[0])
    p = x @ w
    np.testing.assert_allclose(plans[0].run([x])[0], p + np.maximum(p, 0) if shared else 2 * np.maximum(p, 0), rtol=1e-6)


def test_relu_of_a_vector_product_is_fused_too():
    # MatMul of two vectors is a 0-d product: numpy returns it as a scalar, not an array
    rng = np.random.default_rng(6)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Relu", ["p"], ["out"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [])])
    w = rng.standard_normal(6).astype(np.float32)
    plan = Plan(graph, {"": 21}, {"w": w}, ["x"], ["out"], fuse=True)
    assert plan.fusions == ["MatMulRelu"]
    for x in (w, -w):
        got = np.asarray(plan.run([x])[0])
        assert got.shape == ()
        assert got == max(np.float32(x @ w), np.float32(0))


def _two_node_plan(**kwargs):
    from onnx import helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["h"], name="act"), helper.make_node("Reshape", ["h", "s"], ["y"], name="flat")],
                              "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3]),
                                    helper.make_tensor_value_info("s", onnx.TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)])
    return Plan(graph, {"": 21}, {}, ["x", "s"], ["y"], **kwargs)


def test_the_generated_run_has_source_that_tracebacks_and_debuggers_show():
    import inspect
    import traceback

    from odt_ops.errors import KernelError

    plan = _two_node_plan()
    source = inspect.getsource(plan._run.fn)  # what pdb's `list` shows
    assert "Relu node 'act': (x) -> (h)" in source
    assert "Reshape node 'flat': (h, s) -> (y)" in source
    with pytest.raises(KernelError) as raised:
        plan.run([np.ones((2, 3), np.float32), np.array([4, 4])])
    shown = "".join(traceback.format_exception(raised.value.__cause__))
    assert "Reshape node 'flat'" in shown  # the generated line, with its node, in the traceback


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_trace_mode_prints_each_node_with_its_outputs(capsys, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv("ODT_TRACE", "1")
    plan = _two_node_plan(**({"trace": True} if how == "argument" else {}))
    plan.run([np.array([[-1, 2, 3], [4, -5, 6]], np.float32), np.array([3, 2])])
    err = capsys.readouterr().err.splitlines()
    assert err == ["Relu node 'act' -> h: float32[2, 3] range [0, 6]", "Reshape node 'flat' -> y: float32[3, 2] range [0, 6]"]


def test_unet_fused_plan_equals_the_graph_as_written(tmp_path):
    """The benchmark's UNet (torch-exported GroupNorm, bilinear Resize, skips): the loss and every
    gradient bit for bit, but those summed in another order: GroupNorm's gammas (ProductSum) and
    the 3x3 convolutions' weights after the first (StrideOneWeightGrad's pixel blocks)."""
    pytest.importorskip("torch", reason="the UNet is defined in PyTorch and exported")
    from odt_ops.benchmark import configs as cfgs

    config = cfgs.CONFIGS["unet-adamw"]
    model = cfgs.forward_model(config)
    directory = _generate(tmp_path, model, trainable=cfgs.trainable(config, model))
    gammas = frozenset(f"{block}.1.weight_grad" for block in ("enc1", "enc2", "mid", "dec1", "dec2"))
    rng = np.random.default_rng(3)
    blocked = frozenset(f"{block}.0.weight_grad" for block in ("enc2", "mid", "dec1", "dec2"))
    fused = _assert_fused_equals_unfused(directory, rng.standard_normal((4, 1, 32, 32)).astype(np.float32),
                                         rng.integers(0, 10, 4), gammas | blocked)
    assert Counter(fused.fusions)["ProductSum"] == len(gammas)
    assert Counter(fused.fusions)["ChannelAffine"] == len(gammas)  # each GroupNorm's Mul, Add and the ReLU after it
    assert Counter(fused.fusions)["NormalizationTrainingGrad"] == len(gammas)
