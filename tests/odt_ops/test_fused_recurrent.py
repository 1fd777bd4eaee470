"""The fused LSTM and GRU cells (odt_ops/runtime/fusion/recurrent.py): PyTorch exports (TorchScript and
dynamo exporters) trained with AdamW through the plan with the lstm_cell / gru_cell pass and without it
give the same bits (loss, every gradient, every parameter after each step), and both train as torch
autograd and torch's AdamW do, within float32 rounding; so do ONNX LSTM/GRU nodes with per-row
sequence lengths and initial states; the cells' product on a row-major copy of R^T is used only where
it gives the product's own bits."""
from __future__ import annotations

import io
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.kernels import lstm_cell
from odt_ops.kernels.products import ProductRecord
from odt_ops.runtime import fusion
from tests.odt_ops.test_recurrent import torch_counterparts

torch = pytest.importorskip("torch")
nn = torch.nn

pytestmark = pytest.mark.usefixtures("one_torch_thread")

T, BATCH, FEATURES, HIDDEN, CLASSES, STEPS = 5, 4, 6, 8, 3, 3
LR = 1e-3  # the Optimizer's default, onnxruntime's


class Tagger(nn.Module):
    """An LSTM or GRU over the sequence, its last step's output into a linear head."""

    def __init__(self, kind: str, batch_first: bool, bidirectional: bool):
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.rnn = getattr(nn, kind)(FEATURES, HIDDEN, batch_first=batch_first, bidirectional=bidirectional)
        self.head = nn.Linear(HIDDEN * (2 if bidirectional else 1), CLASSES)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[:, -1] if self.batch_first else y[-1])


def _export(module: nn.Module, x: np.ndarray, exporter: str) -> onnx.ModelProto:
    if exporter == "dynamo":
        return torch.onnx.export(module, (torch.from_numpy(x),), dynamo=True, input_names=["x"], output_names=["logits"]).model_proto
    buffer = io.BytesIO()
    torch.onnx.export(module, (torch.from_numpy(x),), buffer, dynamo=False, opset_version=17, input_names=["x"],
                      output_names=["logits"], training=torch.onnx.TrainingMode.EVAL)
    return onnx.load_from_string(buffer.getvalue())


def _train(directory, x, labels) -> tuple[list, list[dict], dict, Counter]:
    """STEPS AdamW steps: the losses, each step's gradients, the parameters after, the plan's fused nodes."""
    state = CheckpointState.load_checkpoint(str(directory / "checkpoint"))
    model = Module(str(directory / "training_model.onnx"), state, str(directory / "eval_model.onnx"))
    optimizer = Optimizer(str(directory / "optimizer_model.onnx"), model)
    losses, grads = [], []
    for _ in range(STEPS):
        losses.append(np.asarray(model(x, labels)).copy())
        grads.append({n: p.grad.copy() for n, p in state.parameters.items() if p.requires_grad})
        optimizer.step()
        model.lazy_reset_grad()
    params = {n: np.asarray(p.data).copy() for n, p in state.parameters.items()}
    return losses, grads, params, Counter(model.compiled_train.plan.fusions)


@pytest.mark.parametrize("kind, batch_first, bidirectional, exporter", [
    ("LSTM", True, False, "torchscript"), ("LSTM", False, False, "torchscript"), ("LSTM", True, True, "torchscript"),
    ("GRU", True, False, "torchscript"), ("GRU", False, True, "torchscript"), ("LSTM", True, True, "dynamo"), ("GRU", False, False, "dynamo")])
def test_fused_cells_train_bit_for_bit_as_the_unrolled_graph_and_like_torch(kind, batch_first, bidirectional, exporter, tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, T, FEATURES) if batch_first else (T, BATCH, FEATURES)).astype(np.float32)
    labels = rng.integers(0, CLASSES, BATCH).astype(np.int64)
    module = Tagger(kind, batch_first, bidirectional).eval()
    proto = _export(module, x, exporter)
    assert kind in {n.op_type for n in proto.graph.node}
    # each initializer that is a torch parameter (in ONNX's layout), found by its exported value
    loss_fn = nn.CrossEntropyLoss()
    loss_fn(module(torch.from_numpy(x)), torch.from_numpy(labels)).backward()  # torch_counterparts reads .grad
    forms = {t.name: _torch_form(module, numpy_helper.to_array(t)) for t in proto.graph.initializer
             if t.data_type == onnx.TensorProto.FLOAT}
    forms = {name: form for name, form in forms.items() if form is not None}
    assert len(forms) == 5, sorted(forms)  # W, R, B (both directions in one each) and the head's two
    artifacts.generate_artifacts(proto, requires_grad=sorted(forms), loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path)

    losses, grads, params, fused = _train(tmp_path, x, labels)
    # this export writes the zero initial state as a constant, which the unrolling drops: each
    # direction's first step has no state coming in and stays as written
    cells = (T - 1) * (2 if bidirectional else 1)
    assert fused[f"{kind}Cell"] == cells and fused[f"{kind}CellGrad"] == cells, fused
    assert fused["RowMajor"] == (2 if bidirectional else 1), fused  # one copy of each direction's R^T for its steps

    # the oracle for equality: the same artifacts through the plan without the pass
    with monkeypatch.context() as m:
        m.delitem(fusion.FUSIONS, f"{kind.lower()}_cell")
        plain_losses, plain_grads, plain_params, plain = _train(tmp_path, x, labels)
    assert f"{kind}Cell" not in plain and f"{kind}CellGrad" not in plain and "RowMajor" not in plain
    for step in range(STEPS):
        np.testing.assert_array_equal(losses[step], plain_losses[step], err_msg=f"loss, step {step}")
        assert grads[step].keys() == plain_grads[step].keys()
        for name, grad in grads[step].items():
            np.testing.assert_array_equal(grad, plain_grads[step][name], err_msg=f"{name} gradient, step {step}")
    for name, value in params.items():
        np.testing.assert_array_equal(value, plain_params[name], err_msg=name)

    # the oracle for the values: torch autograd and torch's AdamW (onnxruntime's defaults) on the same
    # batch: the first gradients within float32 rounding, the losses of every step. (Not the weights:
    # Adam's first update is lr * sign(gradient), so a gradient that rounds to either side of zero
    # moves its weight by 2 lr apart in torch and here.)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    for step in range(STEPS):
        optimizer.zero_grad()
        want = loss_fn(module(torch.from_numpy(x)), torch.from_numpy(labels))
        want.backward()
        np.testing.assert_allclose(losses[step], want.item(), rtol=1e-5 if step == 0 else 1e-4, err_msg=f"loss, step {step}")
        if step == 0:
            counterparts = torch_counterparts(module)
            for name, form in forms.items():
                np.testing.assert_allclose(grads[0][name], counterparts[form][1], rtol=1e-4, atol=1e-6, err_msg=f"{name} gradient")
        optimizer.step()


def _torch_form(module: nn.Module, value: np.ndarray) -> int | None:
    """The index of the torch parameter form (tests/odt_ops/test_recurrent.py) an export wrote as ``value``."""
    return next((k for k, (v, _) in enumerate(torch_counterparts(module)) if v.shape == value.shape and np.array_equal(v, value)), None)


class _OtherRounding(ProductRecord):
    """A formulation that rounds differently from np.matmul (as a BLAS summing in another order would)."""

    def __call__(self, A, B):
        return np.nextafter(super().__call__(A, B), np.inf)


def test_recurrent_product_multiplies_the_row_major_copy_only_where_a_probe_gives_the_same_bits():
    """h @ RT on RT's row-major copy (one per sequence) replaces the product through the plan's formulation
    (the oracle: the record's own h @ RT, which the unrolled graph's MatMul runs) only when a probe of
    those shapes and layouts shows the same bits; a formulation that rounds otherwise keeps its product."""
    rng = np.random.default_rng(3)
    h = rng.standard_normal((5, 8)).astype(np.float32)
    RT = rng.standard_normal((32, 8)).astype(np.float32).T  # the Transpose node's view of R
    rows = np.ascontiguousarray(RT)
    record = ProductRecord("direct")
    want = record(h, RT)
    np.testing.assert_array_equal(lstm_cell.recurrent_product(record, h, RT, rows), want)
    # the copy is what gets multiplied when the probe agrees: a marked copy shows through
    marked = rows.copy()
    marked[0, 0] += 1
    assert not np.array_equal(lstm_cell.recurrent_product(record, h, RT, marked), want)

    other = _OtherRounding("direct")
    RT3 = rng.standard_normal((24, 8)).astype(np.float32).T  # a key the probe has not met
    np.testing.assert_array_equal(lstm_cell.recurrent_product(other, h, RT3, np.ascontiguousarray(RT3)), other(h, RT3))


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_fused_cells_with_sequence_lengths_train_bit_for_bit_as_the_unrolled_graph(op, tmp_path, monkeypatch):
    """Per-row sequence lengths (a graph input: Where masks between the steps) and given initial states,
    both directions, batch-first: the plan with the cell pass gives the unrolled graph's bits (the
    unrolled graph's values are held to onnxruntime and finite differences in test_recurrent.py)."""
    from tests.odt_ops.test_recurrent import recurrent_model

    extra = {"linear_before_reset": 1} if op == "GRU" else {}
    model, feeds = recurrent_model(op, T=5, batch=3, I=4, H=6, direction="bidirectional", layout=1, initial=True,
                                   lens=[5, 2, 4], outputs=("Y",), **extra)
    artifacts.generate_artifacts(model, requires_grad=["W", "R", "B"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path)
    target = np.random.default_rng(1).standard_normal((3, 5, 2, 6)).astype(np.float32)
    inputs = [feeds[n] for n in ("X", "sequence_lens", "initial_h", "initial_c") if n in feeds]

    def train():
        state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
        module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
        optimizer = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
        losses, grads = [], []
        for _ in range(2):
            losses.append(np.asarray(module(*inputs, target)).copy())
            grads.append({n: p.grad.copy() for n, p in state.parameters.items() if p.requires_grad})
            optimizer.step()
            module.lazy_reset_grad()
        return losses, grads, Counter(module.compiled_train.plan.fusions)

    losses, grads, fused = train()
    assert fused[f"{op}Cell"] == fused[f"{op}CellGrad"] == 10, fused  # every step of both directions: each has a state
    with monkeypatch.context() as m:
        m.delitem(fusion.FUSIONS, f"{op.lower()}_cell")
        plain_losses, plain_grads, plain = train()
    assert f"{op}Cell" not in plain
    for step in range(2):
        np.testing.assert_array_equal(losses[step], plain_losses[step], err_msg=f"loss, step {step}")
        for name, grad in grads[step].items():
            np.testing.assert_array_equal(grad, plain_grads[step][name], err_msg=f"{name} gradient, step {step}")
