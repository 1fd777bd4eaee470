"""Recurrent ops (LSTM, GRU, RNN): unrolled at load into standard ops (odt_ops.ir.recurrent).

Oracles: onnxruntime running the original node (forward), and torch (loss, gradients
of the head, and a few AdamW steps of the whole network) for real exports.
"""
from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import odt_ops
from odt_ops.errors import ModelCheckError
from odt_ops.runtime.session import InferenceSession

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def recurrent_model(op, *, T=4, batch=3, I=5, H=3, direction="forward", layout=0, initial=False, lens=None,
                    peepholes=False, bias=True, outputs=("Y", "Y_h", "Y_c"), opset=17, seed=0, **attrs):
    """One recurrent node: X (and initial states, sequence_lens) are graph inputs; W, R, B, P weights.
    Returns the model and its feeds."""
    rng = np.random.default_rng(seed)
    D = 2 if direction == "bidirectional" else 1
    G = GATES[op]
    x_shape = [T, batch, I] if layout == 0 else [batch, T, I]
    s_shape = [D, batch, H] if layout == 0 else [batch, D, H]
    feeds = {"X": rng.standard_normal(x_shape).astype(np.float32)}
    inits = [numpy_helper.from_array((0.5 * rng.standard_normal((D, G * H, I))).astype(np.float32), "W"),
             numpy_helper.from_array((0.5 * rng.standard_normal((D, G * H, H))).astype(np.float32), "R")]
    inputs = ["X", "W", "R", ""]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal((D, 2 * G * H)).astype(np.float32), "B"))
        inputs[3] = "B"
    graph_inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, x_shape)]
    if lens is not None:
        if isinstance(lens, str) and lens == "full":
            inits.append(numpy_helper.from_array(np.full(batch, T, np.int32), "sequence_lens"))
        else:
            feeds["sequence_lens"] = np.asarray(lens, np.int32)
            graph_inputs.append(helper.make_tensor_value_info("sequence_lens", TensorProto.INT32, [batch]))
    inputs.append("sequence_lens" if lens is not None else "")
    states = ["initial_h"] + (["initial_c"] if op == "LSTM" else [])
    for s in states:
        if initial:
            feeds[s] = rng.standard_normal(s_shape).astype(np.float32)
            graph_inputs.append(helper.make_tensor_value_info(s, TensorProto.FLOAT, s_shape))
        inputs.append(s if initial else "")
    if peepholes:
        inits.append(numpy_helper.from_array(rng.standard_normal((D, 3 * H)).astype(np.float32), "P"))
        inputs.append("P")
    while inputs and not inputs[-1]:
        inputs.pop()
    names = [o if o in outputs else "" for o in ("Y", "Y_h", "Y_c")[: 3 if op == "LSTM" else 2]]
    while names and not names[-1]:
        names.pop()
    if layout:
        attrs["layout"] = layout
    node = helper.make_node(op, inputs, names, name=f"{op.lower()}_node", hidden_size=H, direction=direction, **attrs)
    out_shapes = {"Y": [T, D, batch, H] if layout == 0 else [batch, T, D, H], "Y_h": s_shape, "Y_c": s_shape}
    graph = helper.make_graph([node], "g", graph_inputs,
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, out_shapes[n]) for n in names if n], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), feeds


def onnxruntime_outputs(model, feeds):
    """The original node on onnxruntime. Its CPU kernels refuse layout 1: then the same node in
    layout 0 runs on transposed inputs and its outputs are transposed back (the spec's definition)."""
    (node,) = model.graph.node
    if not any(a.name == "layout" and a.i == 1 for a in node.attribute):
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    seq_first = onnx.ModelProto()
    seq_first.CopyFrom(model)
    (node,) = seq_first.graph.node
    layout = next(a for a in node.attribute if a.name == "layout")
    layout.i = 0
    for value in (*seq_first.graph.input, *seq_first.graph.output):
        dims = value.type.tensor_type.shape.dim
        if len(dims) >= 3:
            kept = [onnx.TensorShapeProto.Dimension() for _ in dims]
            for k, d in zip(kept, dims):
                k.CopyFrom(d)
            order = [1, 0, 2] if len(dims) == 3 else [1, 2, 0, 3]  # [B,T,I]->[T,B,I]; [B,T,D,H]->[T,D,B,H]
            for i, j in enumerate(order):
                dims[i].CopyFrom(kept[j])
    moved = {k: (v.transpose(1, 0, 2) if v.ndim == 3 else v) for k, v in feeds.items()}
    outs = ort.InferenceSession(seq_first.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, moved)
    return [o.transpose(2, 0, 1, 3) if o.ndim == 4 else o.transpose(1, 0, 2) for o in outs]


def assert_matches_onnxruntime(model, feeds):
    want = onnxruntime_outputs(model, feeds)
    sess = InferenceSession(model)
    assert not {n.op_type for n in sess.model.graph.node} & {"LSTM", "GRU", "RNN"}
    got = sess.run(None, feeds)
    assert len(got) == len(want)
    for g, w, spec in zip(got, want, sess.outputs):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=spec.name)


CASES = [
    {},
    {"initial": True},
    {"layout": 1},
    {"layout": 1, "initial": True},
    {"lens": [4, 2, 1]},
    {"lens": [3, 4, 1], "initial": True},
    {"lens": [2, 4, 3], "layout": 1, "initial": True},
    {"lens": "full"},
    {"bias": False},
    {"clip": 0.7},
]


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_forward_matches_onnxruntime(op, case, direction):
    assert_matches_onnxruntime(*recurrent_model(op, direction=direction, **case))


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("case", [{}, {"initial": True, "lens": [1, 4, 3]}, {"bias": False}, {"clip": 0.5, "layout": 1}])
def test_gru_linear_before_reset(lbr, case, direction):
    assert_matches_onnxruntime(*recurrent_model("GRU", linear_before_reset=lbr, direction=direction, **case))


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("case", [
    {"peepholes": True},
    {"peepholes": True, "initial": True, "lens": [2, 4, 1]},
    {"input_forget": 1},
    {"input_forget": 1, "peepholes": True, "initial": True, "clip": 0.6},
])
def test_lstm_peepholes_and_input_forget(case, direction):
    assert_matches_onnxruntime(*recurrent_model("LSTM", direction=direction, **case))


ACTIVATION_CASES = [
    # (op, activations per direction, alphas, betas): alphas and betas are consumed only by the
    # functions that take them, in order (as onnxruntime reads the attributes)
    ("RNN", ["Relu"], None, None),
    ("RNN", ["LeakyRelu"], [0.3], None),
    ("RNN", ["Elu"], [0.7], None),
    ("RNN", ["Softsign"], None, None),
    ("RNN", ["Softplus"], None, None),
    ("RNN", ["ThresholdedRelu"], [0.2], None),
    ("RNN", ["ScaledTanh"], [1.5], [0.5]),
    ("RNN", ["Affine"], [0.6], [0.1]),
    ("GRU", ["HardSigmoid", "Softsign"], [0.3], [0.4]),
    ("GRU", ["Sigmoid", "LeakyRelu"], [0.2], None),
    ("LSTM", ["HardSigmoid", "Elu", "ScaledTanh"], [0.25, 0.9, 0.8], [0.45, 1.2]),
    ("LSTM", ["Sigmoid", "Softsign", "Affine"], [0.5], [0.25]),
]


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("op,acts,alphas,betas", ACTIVATION_CASES)
def test_activations(op, acts, alphas, betas, bidirectional):
    attrs = {"activations": acts}
    if alphas:
        attrs["activation_alpha"] = alphas
    if betas:
        attrs["activation_beta"] = betas
    if bidirectional:  # the backward direction uses the default functions: the attributes name them all
        defaults = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}[op]
        attrs["activations"] = acts + defaults
    assert_matches_onnxruntime(*recurrent_model(op, direction="bidirectional" if bidirectional else "forward",
                                                initial=True, **attrs))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("outputs", [("Y",), ("Y_h",), ("Y_c",), ("Y_h", "Y_c")])
def test_optional_outputs(op, outputs):
    if op != "LSTM" and outputs in (("Y_c",), ("Y_h", "Y_c")):
        pytest.skip("Y_c is LSTM's")
    model, feeds = recurrent_model(op, outputs=outputs, direction="bidirectional", lens=[4, 1, 2], initial=True)
    assert_matches_onnxruntime(model, feeds)


@pytest.mark.parametrize("opset", [7, 13, 14, 21])
def test_opsets(opset):
    """Older opsets (Squeeze/Split/Clip attributes) when the model keeps its own opset, and the
    converted one; layout exists from opset 14."""
    model, feeds = recurrent_model("LSTM", direction="bidirectional", initial=True, lens=[4, 2, 3], clip=0.9, opset=opset)
    if opset < 9:  # IR 3 types initializers only as graph inputs: feed the weights
        for t in model.graph.initializer:
            feeds[t.name] = numpy_helper.to_array(t)
            model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        del model.graph.initializer[:]
        model.ir_version = 3
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for normalize in (True, False):
        got = InferenceSession(model, normalize=normalize).run(None, feeds)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_long_sequence_is_fast_and_matches():
    model, feeds = recurrent_model("LSTM", T=64, batch=8, I=16, H=32, direction="bidirectional")
    assert_matches_onnxruntime(model, feeds)


GRADIENT_CASES = [
    ("LSTM", {"direction": "bidirectional", "peepholes": True, "initial": True, "lens": [3, 1], "clip": 2.5}),
    ("LSTM", {"direction": "reverse", "input_forget": 1, "layout": 1, "lens": [2, 3]}),
    ("GRU", {"direction": "bidirectional", "linear_before_reset": 1, "initial": True, "lens": [1, 3]}),
    ("GRU", {"direction": "reverse", "layout": 1, "initial": True}),
    ("RNN", {"direction": "bidirectional", "activations": ["Relu", "Softsign"], "lens": [3, 2], "initial": True}),
]


@pytest.mark.parametrize("op,case", GRADIENT_CASES, ids=lambda c: c if isinstance(c, str) else "-".join(map(str, c)))
def test_gradients_of_the_unrolled_graph_match_finite_differences(op, case):
    """float64: the rewrite composed with the existing gradient rules differentiates every input,
    masks and peepholes included."""
    from tests.odt_ops.gradcheck import check_gradients

    model, feeds = recurrent_model(op, T=3, batch=2, I=3, H=2, **case)
    for t in model.graph.initializer:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for v in (*model.graph.input, *model.graph.output):
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.DOUBLE
    feeds = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    unrolled = odt_ops.load_model(model, batch_dim=None).proto
    params = [t.name for t in unrolled.graph.initializer if t.name in ("W", "R", "B", "P")]
    inputs = [n for n in feeds if n != "sequence_lens"]
    check_gradients(unrolled, feeds, [*inputs, *params], rtol=1e-5, atol=1e-7)


def test_node_names_and_values_are_unique():
    model, _ = recurrent_model("GRU", direction="bidirectional", lens=[4, 1, 2], initial=True)
    # a second node reading the first one's output, so both rewrites share a graph
    g = model.graph
    second = helper.make_node("Relu", ["Y_h"], ["Z"], name="gru_node/Split")  # a name the rewrite would pick
    g.node.append(second)
    g.output.append(helper.make_tensor_value_info("Z", TensorProto.FLOAT, None))
    loaded = odt_ops.load_model(model)
    names = [n.name for n in loaded.graph.node]
    assert len(names) == len(set(names))
    produced = [o for n in loaded.graph.node for o in n.output]
    assert len(produced) == len(set(produced))
    onnx.checker.check_model(loaded.proto, full_check=True)


def test_dynamic_sequence_length_fails_naming_the_node():
    model, _ = recurrent_model("LSTM", layout=1)
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "time"
    with pytest.raises(ModelCheckError, match=r"LSTM node 'lstm_node'.*dynamic sequence length.*fixed sequence length"):
        odt_ops.load_model(model)


def test_zero_initial_state_constant_leaves_the_batch_free():
    """Exporters write h0 = c0 = 0 for the export's batch size as a constant; it is dropped (a zero
    state is the default), so the model serves any batch size, as the engine's symbolic batch promises."""
    model, feeds = recurrent_model("LSTM", direction="bidirectional", batch=3, layout=1)  # X: [batch, T, I]
    want = onnxruntime_outputs(model, feeds)  # without initial states: zeros, by the spec
    node = model.graph.node[0]
    zeros = numpy_helper.from_array(np.zeros((3, 2, 3), np.float32), "h0")
    model.graph.initializer.append(zeros)
    node.input.extend(["", "h0", "h0"])
    sess = InferenceSession(model)
    assert "h0" not in {t.name for t in sess.model.graph.initializer}
    for g, w in zip(sess.run(None, feeds), want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    x5 = np.random.default_rng(3).standard_normal((5, 4, 5)).astype(np.float32)  # batch 5
    (y, y_h, y_c) = sess.run(None, {"X": x5})
    assert y.shape == (5, 4, 2, 3)
    assert y_h.shape == y_c.shape == (5, 2, 3)


def test_check_command_lists_no_recurrent_op(tmp_path, capsys):
    from odt_ops.__main__ import main

    model, _ = recurrent_model("GRU", direction="bidirectional", lens=[4, 2, 3], initial=True)
    onnx.save(model, tmp_path / "gru.onnx")
    assert main(["check", str(tmp_path / "gru.onnx")]) == 0
    out = capsys.readouterr().out
    assert "every node has a kernel" in out
    assert "GRU," not in out


# ---- real exports: torch classifiers, trained one step ------------------------------------------

torch = pytest.importorskip("torch")
nn = torch.nn


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Classifier(nn.Module):
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        if kind == "lstm":
            self.rnn = nn.LSTM(6, 8, num_layers=2, bidirectional=True, batch_first=True)
            width = 16
        elif kind == "gru":
            self.rnn = nn.GRU(6, 8, batch_first=True)
            width = 8
        else:
            self.rnn = nn.RNN(6, 8, nonlinearity="relu", batch_first=True)
            width = 8
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[:, -1])


def export(module, x, how):
    buffer = io.BytesIO()
    if how == "dynamo":
        onnx_program = torch.onnx.export(module, (x,), dynamo=True, input_names=["x"], output_names=["logits"])
        return onnx_program.model_proto
    torch.onnx.export(module, (x,), buffer, dynamo=False, opset_version=int(how), input_names=["x"], output_names=["logits"],
                      training=torch.onnx.TrainingMode.EVAL)
    return onnx.load_from_string(buffer.getvalue())


def torch_counterparts(module: nn.Module) -> list[tuple[np.ndarray, np.ndarray]]:
    """(value, gradient) of every torch parameter in each layout an export may write it in: as is,
    transposed, and the recurrent weights as ONNX's W [D, G*H, I], R [D, G*H, H] and B [D, 2*G*H]
    per layer, gates reordered from torch's (i, f, g, o) / (r, z, n) to ONNX's (i, o, f, c) / (z, r, h)."""
    rnn = module.rnn
    order = {nn.LSTM: [0, 3, 1, 2], nn.GRU: [1, 0, 2], nn.RNN: [0]}[type(rnn)]
    suffixes = ["", "_reverse"] if rnn.bidirectional else [""]

    def onnx_form(name: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        tensors = [getattr(rnn, f"{name}_l{k}{s}") for s in suffixes]
        def gates(a):
            return np.concatenate([np.split(a, len(order))[i] for i in order])
        return (np.stack([gates(t.detach().numpy()) for t in tensors]), np.stack([gates(t.grad.numpy()) for t in tensors]))

    found = []
    for k in range(rnn.num_layers):
        found.append(onnx_form("weight_ih", k))
        found.append(onnx_form("weight_hh", k))
        (bi, gi), (bh, gh) = onnx_form("bias_ih", k), onnx_form("bias_hh", k)
        found.append((np.concatenate([bi, bh], axis=1), np.concatenate([gi, gh], axis=1)))
    for p in module.parameters():
        value, grad = p.detach().numpy(), p.grad.numpy()
        found.append((value, grad))
        if value.ndim == 2:
            found.append((value.T, grad.T))
    return found


def match_initializers(proto: onnx.ModelProto, module: nn.Module, *, strict: bool = True) -> dict[str, np.ndarray]:
    """ONNX initializer name -> torch's gradient of it, matched by value (exports copy weights exactly)."""
    candidates = torch_counterparts(module)
    matched = {}
    for t in proto.graph.initializer:
        value = numpy_helper.to_array(t)
        if value.dtype != np.float32 or not value.any():
            continue  # zero initial states, constants of other types
        hits = [g for v, g in candidates if v.shape == value.shape and np.array_equal(v, value)]
        assert hits or not strict, f"initializer {t.name!r} {value.shape} matches no torch parameter"
        if hits:
            matched[t.name] = hits[0]
    return matched


@pytest.mark.parametrize("how", ["13", "17", "dynamo"])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_exported_classifier_trains_like_torch(kind, how, tmp_path):
    from odt_ops import artifacts
    from odt_ops.api import CheckpointState, Module, Optimizer

    module = Classifier(kind).eval()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 5, 6)).astype(np.float32)
    labels = np.array([0, 2, 1, 2], dtype=np.int64)
    proto = export(module, torch.from_numpy(x), how)
    # The dynamo exporter writes nn.RNN as its cells' ops, unrolled, and folds the first step's
    # h0 @ W_hh^T + b_hh (h0 = 0) into a constant: that copy of b_hh is no parameter any more, so
    # b_hh's gradient lacks its first step there. Everything else must still train as in torch.
    folded = (kind, how) == ("rnn", "dynamo")
    if not folded:
        assert {n.op_type for n in proto.graph.node} & {"LSTM", "GRU", "RNN"}

    # the oracle: torch autograd on the same batch
    loss_fn = nn.CrossEntropyLoss()
    want = loss_fn(module(torch.from_numpy(x)), torch.from_numpy(labels))
    want.backward()
    torch_grads = match_initializers(proto, module, strict=not folded)
    if folded:
        b_hh = module.rnn.bias_hh_l0.detach().numpy()
        torch_grads = {n: g for n, g in torch_grads.items()
                       if not np.array_equal(numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == n)), b_hh)}
        assert len(torch_grads) == 5, sorted(torch_grads)  # W_ih, W_hh, b_ih, the head's two

    artifacts.generate_artifacts(proto, requires_grad=sorted(torch_grads), loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    model = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    optimizer = Optimizer(str(tmp_path / "optimizer_model.onnx"), model)
    model.train()
    loss = model(x, labels)
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5, atol=1e-6)
    for name, grad in torch_grads.items():
        np.testing.assert_allclose(state.parameters[name].grad, grad, rtol=1e-4, atol=1e-6, err_msg=name)

    # one AdamW step each (the same defaults as onnxruntime's: lr 1e-3, betas, eps 1e-8, weight decay 1e-2)
    optimizer.step()
    model.lazy_reset_grad()
    torch.optim.AdamW(module.parameters(), lr=optimizer.get_learning_rate()).step()
    with torch.no_grad():
        after = loss_fn(module(torch.from_numpy(x)), torch.from_numpy(labels)).item()
    assert after < want.item()
    if not folded:
        np.testing.assert_allclose(model(x, labels), after, rtol=1e-4)


def test_dynamic_time_axis_export_fails_at_load_naming_the_node():
    module = Classifier("gru").eval()
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.zeros(2, 5, 6),), buffer, dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "batch", 1: "time"}})
    gru = next(n.name for n in onnx.load_from_string(buffer.getvalue()).graph.node if n.op_type == "GRU")
    with pytest.raises(ModelCheckError, match=rf"GRU node '{gru}' has a dynamic sequence length.*fixed sequence length"):
        odt_ops.load_model(buffer.getvalue())


class TimeMajor(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.rnn = nn.LSTM(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[-1])


@pytest.mark.parametrize("how", ["13", "17"])
def test_time_major_export_runs_like_torch(how):
    """X is [time, batch, features]: its first axis is the time axis, static when the pass runs."""
    module = TimeMajor().eval()
    x = np.random.default_rng(2).standard_normal((7, 3, 6)).astype(np.float32)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    (got,) = InferenceSession(export(module, torch.from_numpy(x), how)).run(None, {"x": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _spec_cases():
    """The ONNX spec's LSTM, GRU and RNN node tests, captured from their generators (onnx's
    collect_testcases would run every op's generator, seconds of work)."""
    import inspect

    from onnx.backend.test.case.base import Base
    from onnx.backend.test.case.node import gru, lstm, rnn

    cases = []
    for module in (lstm, gru, rnn):
        original = module.expect
        module.expect = lambda node, inputs, outputs, name, **kw: cases.append((name, node, inputs, outputs, kw))
        try:
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if issubclass(cls, Base) and cls is not Base:
                    for attr in dir(cls):
                        if attr.startswith("export"):
                            getattr(cls, attr)()
        finally:
            module.expect = original
    return cases


@pytest.mark.parametrize("case", _spec_cases(), ids=lambda c: c[0])
def test_onnx_spec_node_cases(case):
    """The ONNX spec's own recurrent node tests (expected outputs from onnx's reference code)."""
    name, node, inputs, outputs, kw = case
    present = [n for n in node.input if n]
    graph = helper.make_graph(
        [node], name,
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in zip(present, inputs)],
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for n, a in zip([o for o in node.output if o], outputs)])
    model = helper.make_model(graph, opset_imports=kw.get("opset_imports") or [helper.make_opsetid("", 21)])
    got = InferenceSession(model, normalize=False).run(None, dict(zip(present, inputs)))
    for g, w in zip(got, outputs):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
