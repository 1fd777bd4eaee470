"""Control flow (If, Loop, Scan): loading keeps what subgraphs read, forward kernels against
onnxruntime and onnx.reference, lowering at load (constant Ifs inlined, static Loops and Scans
unrolled, data-dependent Ifs selected with Where), and training through them against torch."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from odt_ops.ir import passes
from odt_ops.ir.graph import implicit_inputs, outer_reads
from odt_ops.ir.model import Model

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def _if_reading_initializer() -> onnx.ModelProto:
    """If whose branches read initializers that no top-level node reads."""
    then = helper.make_graph([helper.make_node("Add", ["x", "w"], ["t"])], "then", [], [helper.make_tensor_value_info("t", F, [2])])
    other = helper.make_graph([helper.make_node("Mul", ["x", "w2"], ["e"])], "else", [], [helper.make_tensor_value_info("e", F, [2])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("c", B, []), helper.make_tensor_value_info("x", F, [2])],
        [helper.make_tensor_value_info("y", F, [2])],
        [numpy_helper.from_array(np.array([1, 2], np.float32), "w"), numpy_helper.from_array(np.array([3, 4], np.float32), "w2"),
         numpy_helper.from_array(np.array([5, 6], np.float32), "unused")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_outer_reads_are_seen_by_use_analysis():
    model = Model(_if_reading_initializer())
    node = model.graph.node[0]
    assert sorted(implicit_inputs(node)) == ["w", "w2", "x"]
    assert outer_reads(next(a.g for a in node.attribute if a.name == "then_branch")) == ["x", "w"]
    passes.prune_unused(model)
    assert sorted(t.name for t in model.graph.initializer) == ["w", "w2"]
    passes.fold_constants(model)
    assert sorted(t.name for t in model.graph.initializer) == ["w", "w2"]


# ---- forward kernels: single-node models, against onnxruntime and onnx.reference -----------------

def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes, inputs, outputs, initializers=(), opset=21):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = helper.find_min_ir_version_for(list(model.opset_import))
    return model


def _oracles(model, feeds, *, reference=True):
    """Our outputs equal onnxruntime's and (where it implements the attributes) onnx.reference's."""
    import onnxruntime as ort
    from onnx.reference import ReferenceEvaluator

    from odt_ops.runtime.session import InferenceSession

    ours = InferenceSession(model, normalize=False).run(None, feeds)
    theirs = [ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)]
    if reference:
        theirs.append(ReferenceEvaluator(model).run(None, feeds))
    for other in theirs:
        assert len(ours) == len(other)
        for a, b in zip(ours, other):
            assert a.dtype == b.dtype, (a.dtype, a.shape, b.dtype, b.shape)
            assert a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    return ours


def _loop_body(counted=False):
    """(i, cond, acc) -> (sum(acc + w * i) < limit, acc + w * i, acc * scale): reads w, limit, scale from
    outside. ``counted``: the condition is i < 6 instead, which constant evaluation decides."""
    nodes = [
        helper.make_node("Cast", ["i"], ["fi"], to=F),
        helper.make_node("Mul", ["w", "fi"], ["step"]),
        helper.make_node("Add", ["acc", "step"], ["acc_out"]),
        helper.make_node("ReduceSum", ["acc_out"], ["total"], keepdims=0),
        helper.make_node("Less", ["i", "six"], ["cond_out"]) if counted else helper.make_node("Less", ["total", "limit"], ["cond_out"]),
        helper.make_node("Mul", ["acc", "scale"], ["scan_out"]),
    ]
    return helper.make_graph(nodes, "body", [_vi("i", I64, []), _vi("cond", B, []), _vi("acc", F, [3])],
                             [_vi("cond_out", B, []), _vi("acc_out", F, [3]), _vi("scan_out", F, [3])])


def _loop_model(with_m=True, with_cond=True, counted=False, opset=21):
    inputs = [_vi("M", I64, []) if with_m else None, _vi("c", B, []) if with_cond else None, _vi("acc0", F, [3])]
    node = helper.make_node("Loop", ["M" if with_m else "", "c" if with_cond else "", "acc0"], ["acc", "scans"], body=_loop_body(counted))
    return _model([node], [i for i in inputs if i is not None], [_vi("acc", F, [3]), _vi("scans", F, [None, 3])],
                  [numpy_helper.from_array(np.array([0.5, 1.0, -0.25], np.float32), "w"),
                   numpy_helper.from_array(np.array(6.0, np.float32), "limit"),
                   numpy_helper.from_array(np.array(2.0, np.float32), "scale"), numpy_helper.from_array(np.array(6, np.int64), "six")],
                  opset)


@pytest.mark.parametrize("opset", [11, 13, 16, 19, 21])
def test_loop_forward_trip_count_condition_and_outer_reads(opset):
    acc0 = np.array([1.0, -2.0, 0.5], np.float32)
    for m, cond in [(5, True), (10, True), (0, True), (3, False)]:  # onnx.reference cannot stack zero iterations
        _oracles(_loop_model(opset=opset), {"M": np.array(m, np.int64), "c": np.array(cond), "acc0": acc0}, reference=m > 0 and cond)
    if opset != 21:
        return
    # without a cond input the body's condition is ignored (onnx.reference takes the absent cond as false)
    _oracles(_loop_model(with_cond=False), {"M": np.array(4, np.int64), "acc0": acc0}, reference=False)
    _oracles(_loop_model(with_m=False), {"c": np.array(True), "acc0": acc0})  # a while loop


def test_if_forward_reads_outer_values():
    then = helper.make_graph([helper.make_node("Add", ["x", "w"], ["t"])], "then", [], [_vi("t", F, [2])])
    other = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["e1"]), helper.make_node("Sub", ["e1", "w"], ["e"])],
                              "else", [], [_vi("e", F, [2])])
    model = _model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                   [_vi("c", B, []), _vi("x", F, [2])], [_vi("y", F, [2])],
                   [numpy_helper.from_array(np.array([1, 2], np.float32), "w")])
    x = np.array([3.0, -1.5], np.float32)
    assert _oracles(model, {"c": np.array(True), "x": x})[0].tolist() == [4.0, 0.5]
    _oracles(model, {"c": np.array(False), "x": x})


def _scan_model(axes=None, directions=None, out_axes=None, out_directions=None, opset=21):
    """Running sum over the scan axis of x (plus an outer bias) and the running product's scan output."""
    body = helper.make_graph(
        [helper.make_node("Add", ["s", "xt"], ["s1"]), helper.make_node("Add", ["s1", "bias"], ["s_out"]),
         helper.make_node("Mul", ["s_out", "xt"], ["y"])],
        "body", [_vi("s", F, [2]), _vi("xt", F, [2])], [_vi("s_out", F, [2]), _vi("y", F, [2])])
    attrs = {k: v for k, v in dict(scan_input_axes=axes, scan_input_directions=directions, scan_output_axes=out_axes,
                                   scan_output_directions=out_directions).items() if v is not None}
    node = helper.make_node("Scan", ["s0", "x"], ["s", "ys"], body=body, num_scan_inputs=1, **attrs)
    return _model([node], [_vi("s0", F, [2]), _vi("x", F, [None, None])], [_vi("s", F, [2]), _vi("ys", F, [None, None])],
                  [numpy_helper.from_array(np.array([0.5, -0.5], np.float32), "bias")], opset)


def test_scan_forward_axes_and_directions():
    rng = np.random.default_rng(0)
    s0 = rng.standard_normal(2).astype(np.float32)
    _oracles(_scan_model(), {"s0": s0, "x": rng.standard_normal((4, 2)).astype(np.float32)})
    xt = rng.standard_normal((2, 5)).astype(np.float32)
    for kw in [dict(axes=[1]), dict(axes=[-1], directions=[1]), dict(axes=[1], out_axes=[1]),
               dict(axes=[1], directions=[1], out_axes=[-1], out_directions=[1])]:
        _oracles(_scan_model(**kw), {"s0": s0, "x": xt}, reference=False)  # onnx.reference: default axes only


# ---- lowering at load ------------------------------------------------------------------------------

def _ops(model) -> set[str]:
    from odt_ops.ir.graph import all_nodes

    return {n.op_type for n in all_nodes(model.graph.node)}


def test_static_loop_and_scan_unroll_and_constant_if_inlines_at_load():
    from odt_ops.ir.load import load_model
    from odt_ops.runtime.session import InferenceSession

    acc0 = np.array([1.0, -2.0, 0.5], np.float32)
    loop = _loop_model(counted=True)  # M and cond as initializers: a static trip count, a condition constant evaluation decides
    consts = [numpy_helper.from_array(np.array(10, np.int64), "M"), numpy_helper.from_array(np.array(True), "c")]
    loop.graph.initializer.extend(consts)
    del loop.graph.input[:2]
    assert not _ops(load_model(loop, target_opset=None, batch_dim=None)) & {"Loop", "If", "Scan"}
    _oracles(loop, {"acc0": acc0})
    scan = _scan_model(axes=[1], directions=[1], out_axes=[1], out_directions=[1])
    for v in (*scan.graph.input, *scan.graph.output):
        if v.name in ("x", "ys"):
            v.type.tensor_type.shape.dim[0].dim_value, v.type.tensor_type.shape.dim[1].dim_value = (2, 5) if v.name == "x" else (2, 5)
    assert not _ops(load_model(scan, target_opset=None, batch_dim=None)) & {"Scan"}
    rng = np.random.default_rng(0)
    _oracles(scan, {"s0": rng.standard_normal(2).astype(np.float32), "x": rng.standard_normal((2, 5)).astype(np.float32)},
             reference=False)
    model = _if_reading_initializer()
    model.graph.initializer.append(numpy_helper.from_array(np.array(False), "c"))
    del model.graph.input[0]
    lowered = load_model(model, target_opset=None, batch_dim=None)
    assert "If" not in _ops(lowered)
    assert "Mul" in _ops(lowered)
    assert "Add" not in _ops(lowered)
    x = np.array([2.0, 3.0], np.float32)
    np.testing.assert_array_equal(InferenceSession(model).run(None, {"x": x})[0], x * [3, 4])


def _hand_written_loop() -> onnx.ModelProto:
    """h = x; repeat `steps` times (an input: known at run time only): h = tanh(h @ W); the body
    reads the weight W from outside."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("MatMul", ["h", "W"], ["h1"]),
         helper.make_node("Tanh", ["h1"], ["h_out"])],
        "body", [_vi("i", I64, []), _vi("cond", B, []), _vi("h", F, [1, 4])], [_vi("cond_out", B, []), _vi("h_out", F, [1, 4])])
    rng = np.random.default_rng(3)
    return _model([helper.make_node("Loop", ["steps", "", "x"], ["h"], body=body, name="the_loop")],
                  [_vi("steps", I64, []), _vi("x", F, [1, 4])], [_vi("h", F, [1, 4])],
                  [numpy_helper.from_array((rng.standard_normal((4, 4)) * 0.7).astype(np.float32), "W")])


def test_a_loop_with_a_run_time_trip_count_passes_the_preflight_check(tmp_path, capsys):
    """The trip count is an input: the Loop stays a node, the weight its body reads enters as a
    loop-carried input (onnxruntime computes the same on both), and it has a gradient rule."""
    import onnxruntime as ort

    from odt_ops.__main__ import main
    from odt_ops.artifacts import check_coverage
    from odt_ops.ir.load import load_model

    model = _hand_written_loop()
    assert not check_coverage(model, ["W"])["missing"]
    normalized = load_model(model).proto
    assert "W" in next(n for n in normalized.graph.node if n.op_type == "Loop").input
    feeds = {"steps": np.array(3, np.int64), "x": np.linspace(-1, 1, 4, dtype=np.float32).reshape(1, 4)}
    run = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0] for m in (model, normalized)]
    np.testing.assert_allclose(run[0], run[1], rtol=1e-6)
    path = tmp_path / "loop.onnx"
    onnx.save(model, path)
    assert main(["check", str(path), "--requires-grad", "W"]) == 0, capsys.readouterr().out


def test_a_loop_with_a_run_time_trip_count_trains_like_torch(tmp_path):
    """The hand-written loop, differentiated as a node (its body's gradient run backwards over the
    saved iterations), for trip counts 0, 1 and 4 fed at run time, against torch autograd of the
    same Python loop; the loss is MSE to a target."""
    import torch

    from odt_ops import artifacts
    from odt_ops.api import CheckpointState, Module

    model = _hand_written_loop()
    weight = numpy_helper.to_array(model.graph.initializer[0])
    artifacts.generate_artifacts(model, requires_grad=["W"], loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    training = onnx.load(tmp_path / "training_model.onnx")
    assert sum(n.op_type == "Loop" for n in training.graph.node) == 2  # forward, and the backward pass
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    x = np.linspace(-1, 1, 4, dtype=np.float32).reshape(1, 4)
    target = np.array([[0.3, -0.2, 0.1, 0.5]], np.float32)
    for steps in (0, 1, 4):
        module.lazy_reset_grad()
        loss = module(np.array(steps, np.int64), x, target)
        W = torch.tensor(weight, requires_grad=True)
        h = torch.from_numpy(x)
        for _ in range(steps):
            h = torch.tanh(h @ W)
        want = torch.nn.functional.mse_loss(h, torch.from_numpy(target))
        if steps:
            want.backward()
        expected = W.grad.numpy() if W.grad is not None else np.zeros_like(weight)
        np.testing.assert_allclose(float(loss), want.item(), rtol=1e-5, err_msg=f"{steps} steps")
        np.testing.assert_allclose(state.parameters["W"].grad, expected, rtol=1e-4, atol=1e-7, err_msg=f"{steps} steps")


def test_a_scan_over_a_run_time_length_trains_like_torch(tmp_path):
    """s = s0; for x in xs (its length known at run time only): s = tanh(s @ W + x), y += s. The
    Scan becomes the Loop it means and trains through the Loop's gradient, for 0, 2 and 5 steps,
    against torch autograd of the same Python loop."""
    import torch

    from odt_ops import artifacts
    from odt_ops.api import CheckpointState, Module

    body = helper.make_graph(
        [helper.make_node("MatMul", ["s", "W"], ["sw"]), helper.make_node("Add", ["sw", "x"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["s_out"]), helper.make_node("Identity", ["s_out"], ["y"])],
        "body", [_vi("s", F, [1, 4]), _vi("x", F, [1, 4])], [_vi("s_out", F, [1, 4]), _vi("y", F, [1, 4])])
    rng = np.random.default_rng(5)
    W0, s0 = (rng.standard_normal((4, 4)) * 0.6).astype(np.float32), rng.standard_normal((1, 4)).astype(np.float32)
    model = _model([helper.make_node("Scan", ["s0", "xs"], ["s_last", "ys"], body=body, num_scan_inputs=1, name="the_scan"),
                    helper.make_node("ReduceSum", ["ys", "axis0"], ["y_sum"], keepdims=0),
                    helper.make_node("Add", ["y_sum", "s_last"], ["out"])],
                   [_vi("xs", F, ["steps", 1, 4])], [_vi("out", F, [1, 4])],
                   [numpy_helper.from_array(W0, "W"), numpy_helper.from_array(s0, "s0"),
                    numpy_helper.from_array(np.array([0], np.int64), "axis0")])
    artifacts.generate_artifacts(model, requires_grad=["W", "s0"], loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    assert not _ops(onnx.load(tmp_path / "training_model.onnx")) & {"Scan"}
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    target = np.array([[0.2, -0.1, 0.4, 0.0]], np.float32)
    for steps in (0, 2, 5):
        xs = rng.standard_normal((steps, 1, 4)).astype(np.float32)
        module.lazy_reset_grad()
        loss = module(xs, target)
        W, s = torch.tensor(W0, requires_grad=True), torch.tensor(s0, requires_grad=True)
        h, total = s, torch.zeros(1, 4)
        for t in range(steps):
            h = torch.tanh(h @ W + torch.from_numpy(xs[t]))
            total = total + h
        want = torch.nn.functional.mse_loss(total + h, torch.from_numpy(target))
        want.backward()
        np.testing.assert_allclose(float(loss), want.item(), rtol=1e-5, err_msg=f"{steps} steps")
        for name, p in (("W", W), ("s0", s)):
            expected = p.grad.numpy() if p.grad is not None else np.zeros_like(p.detach().numpy())
            np.testing.assert_allclose(state.parameters[name].grad, expected, rtol=1e-4, atol=1e-7, err_msg=f"{name}, {steps} steps")


# ---- training through lowered control flow, against torch autograd ---------------------------------

def _train_one_step(proto, requires_grad, x_feeds, labels, tmp_path):
    """Loss and gradients of one Module step on ``proto`` with a cross-entropy loss."""
    from odt_ops import artifacts
    from odt_ops.api import CheckpointState, Module

    artifacts.generate_artifacts(proto, requires_grad=requires_grad, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path)
    for kind in ("training_model", "eval_model"):  # standard ONNX: no control flow left, onnx.checker passes
        written = onnx.load(tmp_path / f"{kind}.onnx")
        onnx.checker.check_model(written, full_check=True)
        assert not _ops(written) & {"Loop", "If", "Scan"}
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    model = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    model.train()
    loss = model(*x_feeds, labels)
    return float(loss), {n: state.parameters[n].grad for n in requires_grad}


def _initializer_named_like(proto, value: np.ndarray) -> str:
    hits = [t.name for t in proto.graph.initializer if numpy_helper.to_array(t).shape == value.shape
            and np.array_equal(numpy_helper.to_array(t), value)]
    assert len(hits) == 1, hits
    return hits[0]


def _recommender(mode):
    import torch

    class Recommender(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.emb = torch.nn.EmbeddingBag(30, 6, mode=mode)
            self.head = torch.nn.Linear(6, 4)

        def forward(self, items, offsets):
            return self.head(self.emb(items, offsets))

    return Recommender()


def _check_recommender_trains_like_torch(mode, how, tmp_path):
    """A one-dimensional batch of items cut into bags by offsets: TorchScript exports a Loop over the
    bags, dynamo a while Loop with nested Ifs appending to a sequence. Loss and every gradient equal
    torch autograd's after one Module step."""
    import io
    import warnings

    import torch

    items = np.array([1, 7, 4, 5, 4, 3, 29, 9, 0, 12], np.int64)
    offsets = np.array([0, 2, 5, 6], np.int64)
    labels = np.array([0, 3, 1, 2], np.int64)
    module = _recommender(mode)
    args = (torch.from_numpy(items), torch.from_numpy(offsets))
    want = torch.nn.functional.cross_entropy(module(*args), torch.from_numpy(labels))
    want.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "dynamo":
            proto = torch.onnx.export(module, args, dynamo=True, input_names=["items", "offsets"], verbose=False).model_proto
        else:
            buffer = io.BytesIO()
            torch.onnx.export(module, args, buffer, dynamo=False, opset_version=how, input_names=["items", "offsets"])
            proto = onnx.load_from_string(buffer.getvalue())
    assert "Loop" in _ops(proto)
    grads = {_initializer_named_like(proto, p.detach().numpy()): p.grad.numpy() for p in module.parameters()}
    loss, got = _train_one_step(proto, sorted(grads), [items, offsets], labels, tmp_path)
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    for name, grad in grads.items():
        np.testing.assert_allclose(got[name], grad, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("opset", [13, 17])
@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_embedding_bag_recommender_trains_like_torch(mode, opset, tmp_path):
    _check_recommender_trains_like_torch(mode, opset, tmp_path)


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_embedding_bag_with_a_dynamic_bag_count_trains_like_torch(mode, tmp_path):
    """items and offsets exported with dynamic axes: the Loop over the bags runs as many times as
    the offsets say, decided at run time (5 bags here, 4 at export), so it stays a Loop and is
    differentiated as one. Loss and every gradient equal torch autograd's; the training model
    runs the backward Loop and passes onnx.checker; onnxruntime computes the same loss on it."""
    import io
    import warnings

    import onnxruntime as ort
    import torch

    from odt_ops import artifacts
    from odt_ops.api import CheckpointState, Module

    module = _recommender(mode)
    export_args = (torch.tensor([1, 7, 4, 5, 4, 3, 29, 9, 0, 12]), torch.tensor([0, 2, 5, 6]))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, export_args, buffer, dynamo=False, opset_version=17, input_names=["items", "offsets"],
                          output_names=["y"], dynamic_axes={"items": {0: "n_items"}, "offsets": {0: "bags"}, "y": {0: "bags"}})
    proto = onnx.load_from_string(buffer.getvalue())
    items = np.array([3, 7, 4, 5, 4, 3, 29, 9, 0, 12, 8, 8, 1], np.int64)
    offsets = np.array([0, 2, 5, 6, 11], np.int64)
    labels = np.array([0, 3, 1, 2, 2], np.int64)
    want = torch.nn.functional.cross_entropy(module(torch.from_numpy(items), torch.from_numpy(offsets)), torch.from_numpy(labels))
    want.backward()
    grads = {_initializer_named_like(proto, p.detach().numpy()): p.grad.numpy() for p in module.parameters()}
    artifacts.generate_artifacts(proto, requires_grad=sorted(grads), loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    training = onnx.load(tmp_path / "training_model.onnx")
    assert sum(n.op_type == "Loop" for n in training.graph.node) == 2  # the bags' Loop, and its backward pass
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    model = Module(tmp_path / "training_model.onnx", state)
    np.testing.assert_allclose(float(model(items, offsets, labels)), want.item(), rtol=1e-5)
    for name, grad in grads.items():
        got = state.parameters[name].grad
        assert np.max(np.abs(got - grad)) <= 1e-5 * np.max(np.abs(grad)), name
    feeds = {"items": items, "offsets": offsets, training.graph.input[2].name: labels,
             **{n: state.parameters[n].data for n in grads}}
    session = ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    np.testing.assert_allclose(outs[training.graph.output[0].name], want.item(), rtol=1e-5)
    for name, grad in grads.items():
        assert np.max(np.abs(outs[f"{name}_grad"] - grad)) <= 1e-5 * np.max(np.abs(grad)), f"onnxruntime: {name}"


@pytest.mark.slow
def test_embedding_bag_dynamo_export_trains_like_torch(tmp_path):
    _check_recommender_trains_like_torch("mean", "dynamo", tmp_path)


def test_data_dependent_if_trains_like_torch(tmp_path):
    """y = x @ W1 if sum(x) > 0 else 2 * (x @ W2): both branches run, Where picks; each batch takes one."""
    import torch

    rng = np.random.default_rng(3)
    w1, w2 = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    then = helper.make_graph([helper.make_node("MatMul", ["x", "W1"], ["t"])], "then", [], [_vi("t", F, ["batch", 3])])
    other = helper.make_graph([helper.make_node("MatMul", ["x", "W2"], ["e0"]), helper.make_node("Add", ["e0", "e0"], ["e"])],
                              "else", [], [_vi("e", F, ["batch", 3])])
    proto = _model([helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
                    helper.make_node("Greater", ["total", "zero"], ["positive"]),
                    helper.make_node("If", ["positive"], ["logits"], then_branch=then, else_branch=other)],
                   [_vi("x", F, ["batch", 4])], [_vi("logits", F, ["batch", 3])],
                   [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2"),
                    numpy_helper.from_array(np.array(0, np.float32), "zero")])
    labels = np.array([2, 0], np.int64)
    for sign in (1, -1):
        x = (np.abs(rng.standard_normal((2, 4))) * sign).astype(np.float32)
        tw1, tw2 = torch.tensor(w1, requires_grad=True), torch.tensor(w2, requires_grad=True)
        tx = torch.from_numpy(x)
        logits = tx @ tw1 if tx.sum() > 0 else 2 * (tx @ tw2)
        want = torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels))
        want.backward()
        loss, got = _train_one_step(proto, ["W1", "W2"], [x], labels, tmp_path / str(sign))
        np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
        for name, w in (("W1", tw1), ("W2", tw2)):  # the branch not taken: torch has no gradient, ours is zero
            np.testing.assert_allclose(got[name], w.grad.numpy() if w.grad is not None else np.zeros_like(w1), rtol=1e-5, atol=1e-7)
        _oracles(proto, {"x": x})


def test_a_trip_count_from_the_batch_is_not_fixed_at_load():
    """Loop over the rows of x [batch, 4] (trip count Shape(Relu(x))[0]): unrolling it for the export's
    batch would break every other batch size, so it stays a Loop and runs at any batch."""
    import warnings

    from odt_ops.runtime.session import InferenceSession

    body = helper.make_graph([helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Gather", ["r", "i"], ["row"], axis=0),
                              helper.make_node("Add", ["acc", "row"], ["acc_out"])],
                             "body", [_vi("i", I64, []), _vi("cond", B, []), _vi("acc", F, [4])],
                             [_vi("cond_out", B, []), _vi("acc_out", F, [4])])
    model = _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Shape", ["r"], ["shape"]),
                    helper.make_node("Gather", ["shape", "zero"], ["rows"], axis=0),
                    helper.make_node("Loop", ["rows", "", "acc0"], ["total"], body=body)],
                   [_vi("x", F, [2, 4])], [_vi("total", F, [4])],
                   [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.zeros(4, np.float32), "acc0")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = InferenceSession(model)
    assert "Loop" in _ops(session.model)
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], np.maximum(x, 0).sum(0), rtol=1e-6)


def test_control_flow_bound_without_the_runtime_runs_its_bodies_node_by_node():
    """The loader binds kernels without a plan compiler (kernels/ never imports runtime/): a
    Loop bound that way runs its body node by node, to what the runtime's nested plans compute."""
    from odt_ops.ir.binding import bind_kernel

    model = _loop_model()
    node, w = model.graph.node[0], {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    feeds = {"M": np.array(5, np.int64), "c": np.array(True), "acc0": np.array([1.0, -2.0, 0.5], np.float32)}
    ours = bind_kernel(node, 21)(*(feeds[n] for n in node.input), *(w[n] for n in implicit_inputs(node)))
    for got, want in zip(ours, _oracles(model, feeds)):
        np.testing.assert_array_equal(got, want)
