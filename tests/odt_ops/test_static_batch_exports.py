"""Exports made WITHOUT a dynamic batch axis train at any batch (issue 21).

PyTorch bakes the batch a model was traced with into shape constants when no axis is dynamic:
``x.expand(x.shape[0], ...)`` becomes Expand to ``[3, ...]``, ``torch.zeros(x.shape[0], ...)`` a
ConstantOfShape (or a folded constant), ``x.repeat`` a Tile, view/reshape targets and a time-major
LSTM's default state the same. Each model below is written batch-generic in torch, exported at
EXPORT_BATCH with no dynamic axes by both exporters, and trained by our artifacts at TRAIN_BATCH.

Oracle: PyTorch autograd at TRAIN_BATCH: the loss (rtol 1e-5) and every parameter's gradient, per
tensor relative to that tensor's largest magnitude. A model whose baked constant merely equals the
batch by coincidence (a head count equal to it) must keep computing what torch computes.
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle here")

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module
from tests.odt_ops.test_architectures import grad, matched_parameters

EXPORT_BATCH, TRAIN_BATCH = 3, 5
PER_TENSOR = 1e-4
nn = torch.nn

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ExpandZeros(nn.Module):
    """x.expand to the batch, torch.zeros / torch.ones of the batch; the features are as many as
    the export batch, so each baked [3, 3] holds the batch once and a model size once."""

    def __init__(self):
        super().__init__()
        self.lin, self.scale = nn.Linear(4, EXPORT_BATCH), nn.Parameter(torch.randn(1, EXPORT_BATCH))

    def forward(self, x):
        b = x.shape[0]
        return self.lin(x) * self.scale.expand(b, EXPORT_BATCH) + torch.zeros(b, EXPORT_BATCH) + torch.ones(b, 1)


class RepeatToken(nn.Module):
    """A learned token repeated over the batch (Tile), concatenated to the features."""

    def __init__(self):
        super().__init__()
        self.lin, self.token, self.head = nn.Linear(4, 5), nn.Parameter(torch.randn(1, 3)), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(torch.cat([self.lin(x), self.token.repeat(x.shape[0], 1)], 1))


class TimeMajorLSTM(nn.Module):
    """batch_first=False with the default zero state the exporter expands to the batch."""

    def __init__(self, cell=nn.LSTM):
        super().__init__()
        self.rnn, self.head = cell(4, 6), nn.Linear(6, 2)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[-1])


class ClsTokenTransformer(nn.Module):
    """A ViT-style class token expanded to the batch, then multi-head attention (its Reshapes
    bake batch * heads)."""

    def __init__(self, heads: int = 2):
        super().__init__()
        self.embed, self.cls = nn.Linear(4, 6), nn.Parameter(torch.randn(1, 1, 6))
        self.attn = nn.MultiheadAttention(6, heads, batch_first=True)
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        t = self.embed(x)
        t = torch.cat([self.cls.expand(x.shape[0], -1, -1), t], 1)
        a, _ = self.attn(t, t, t, need_weights=False)
        return self.head(a[:, 0])


CASES = {
    "expand-zeros": (ExpandZeros, (4,)),
    "repeat-token": (RepeatToken, (4,)),
    "lstm-time-major": (TimeMajorLSTM, (7, None, 4)),  # None: where the batch goes
    "gru-time-major": (lambda: TimeMajorLSTM(nn.GRU), (7, None, 4)),
    "cls-token-attention": (ClsTokenTransformer, (6, 4)),
    # as many heads as the export batch: attention's [batch * heads] splits back into a [3, 3]
    # whose two sizes could each be the batch; the row-major position says which
    "cls-token-attention-heads-equal-batch": (lambda: ClsTokenTransformer(heads=EXPORT_BATCH), (6, 4)),
}


def shaped(spec: tuple, batch: int) -> tuple[int, ...]:
    return tuple(batch if d is None else d for d in spec) if None in spec else (batch, *spec)


def export(module: nn.Module, x: torch.Tensor, exporter: str) -> onnx.ModelProto:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            # optimize=False: onnxscript's optimizer would fold parameter.expand(B, ...) into a constant
            return torch.onnx.export(module, (x,), dynamo=True, optimize=False, input_names=["x"], verbose=False).model_proto
        buffer = io.BytesIO()  # as ONNX Runtime's training documentation says, but no dynamic_axes: the batch is static
        torch.onnx.export(module, (x,), buffer, dynamo=False, opset_version=17, input_names=["x"],
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
        return onnx.load_from_string(buffer.getvalue())


def batch_of(spec: tuple, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shaped(spec, batch), generator=g)
    return x, torch.randint(0, 2, (batch,), generator=g)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_static_batch_export_trains_at_another_batch(case, exporter, tmp_path):
    make, spec = CASES[case]
    torch.manual_seed(0)
    reference = make().train()
    x_export, _ = batch_of(spec, EXPORT_BATCH, 0)
    proto = export(reference, x_export, exporter)
    assert not any(d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim), "the export's batch is static"
    matched, forms = matched_parameters(proto, reference)
    artifacts.generate_artifacts(proto, requires_grad=sorted(matched), loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x, labels = batch_of(spec, TRAIN_BATCH, 1)
    loss = float(module(x.numpy(), labels.numpy()))
    want = nn.functional.cross_entropy(reference(x), labels)
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    module.eval()  # the eval model too (no dropout or batch statistics here: the same loss)
    np.testing.assert_allclose(float(module(x.numpy(), labels.numpy())), want.item(), rtol=1e-5)
    for name, key in matched.items():
        got, expected = state.parameters[name].grad, np.reshape(forms[key][1](grad), state.parameters[name].grad.shape)
        error, scale = float(np.max(np.abs(got - expected))), float(np.max(np.abs(expected)))
        assert error <= PER_TENSOR * scale + 1e-7, f"gradient of {name}: max error {error:.3g} of scale {scale:.3g}"


class SummedOverBatch(nn.Module):
    """A parameter expanded to the batch and summed over it: no dim of the expansion meets another,
    so nothing in the graph says whether the baked 3 is the batch (in torch the sum grows with
    it) or a model size."""

    def __init__(self):
        super().__init__()
        self.lin, self.bias = nn.Linear(4, 2), nn.Parameter(torch.randn(1, 2))

    def forward(self, x):
        return self.lin(x) + self.bias.expand(x.shape[0], 2).sum(0)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_batch_the_data_flow_cannot_place_keeps_the_export_batch_with_a_warning_naming_the_node(exporter, tmp_path):
    """Such a model ran at its export batch before static batches were freed; it still does (torch
    at that batch is the oracle), and the warning names the node and the export to use instead."""
    from odt_ops.errors import InputError, StaticBatchWarning

    torch.manual_seed(0)
    reference = SummedOverBatch().train()
    proto = export(reference, batch_of((4,), EXPORT_BATCH, 0)[0], exporter)
    with pytest.warns(StaticBatchWarning, match=r"runs only at its export batch 3: node '[^']+' holds 3, the batch this "
                                                r"model was exported with.*dynamic batch axis"):
        artifacts.generate_artifacts(proto, requires_grad=["lin.weight", "lin.bias"], loss=artifacts.LossType.CrossEntropyLoss,
                                     artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    x, labels = batch_of((4,), EXPORT_BATCH, 1)
    loss = float(module(x.numpy(), labels.numpy()))
    want = nn.functional.cross_entropy(reference(x), labels)
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    np.testing.assert_allclose(state.parameters["lin.weight"].grad, reference.lin.weight.grad.numpy(), rtol=1e-4, atol=1e-7)
    other, other_labels = batch_of((4,), TRAIN_BATCH, 2)
    with pytest.raises(InputError):
        module(other.numpy(), other_labels.numpy())


@pytest.mark.parametrize("name", ["vit", "bert", "unet", "lstm_bidirectional", "gru_lengths", "keyword_spotter", "mobilenetv3",
                                  "efficientnet", "autoencoder", "tcn"])
def test_the_architecture_suites_static_exports_train_at_another_batch(name, tmp_path):
    """tests/odt_ops/architectures.py's models, exported with no dynamic axis (as that suite
    exports them, which trains them at the export batch only), trained at one more row: ViT's
    class token, BERT's padding mask expanded over 4 heads at a batch of 4, UNet's GroupNorm of 2
    groups at a batch of 2, a bidirectional LSTM, a GRU given per-row lengths (a rank-1 input),
    convolutional nets. Oracle: torch autograd at
    that batch."""
    from tests.odt_ops.architectures import ARCHITECTURES
    from tests.odt_ops.test_architectures import export as export_architecture

    arch = ARCHITECTURES[name]
    proto = export_architecture(arch, "17")
    reference = arch.build()
    matched, forms = matched_parameters(proto, reference)
    loss_type = artifacts.LossType.CrossEntropyLoss if arch.loss == "ce" else artifacts.LossType.MSELoss
    artifacts.generate_artifacts(proto, requires_grad=sorted(matched), loss=loss_type, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    inputs, labels = arch.data()
    rows = [0, *range(len(labels))]  # another batch than the export's (the first row twice: lengths stay sorted)
    inputs, labels = [x[rows] for x in inputs], labels[rows]
    loss = float(Module(tmp_path / "training_model.onnx", state)(*inputs, labels))
    want = arch.torch_loss(reference(*[torch.from_numpy(x) for x in inputs]), torch.from_numpy(labels))
    want.backward()
    np.testing.assert_allclose(loss, want.item(), rtol=1e-5)
    for param, key in matched.items():
        got = state.parameters[param].grad
        expected = np.reshape(forms[key][1](grad), got.shape)
        error, scale = float(np.max(np.abs(got - expected))), float(np.max(np.abs(expected)))
        assert error <= PER_TENSOR * scale + 1e-7, f"gradient of {param}: max error {error:.3g} of scale {scale:.3g}"
