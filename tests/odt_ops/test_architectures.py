"""Real architectures, as users export them from PyTorch, train as PyTorch trains them.

For each model of tests/odt_ops/architectures.py and each way it is exported (the TorchScript
exporter at opset 17 as ONNX Runtime's training docs do it, TrainingMode.TRAINING and no constant
folding; some also at opset 13, with the exporter's default constant folding, and through the
dynamo exporter with a dynamic batch axis): the pre-flight
check finds nothing missing, the artifacts generate, one step's loss and the gradient of every
parameter equal torch autograd's, and 20 AdamW steps (torch's arithmetic,
onnxblock.optim.AdamW(mode="torch")) give torch.optim.AdamW's losses.

Exports rename some weights (the TorchScript exporter names recurrent weights onnx::LSTM_12 and
reorders their gates; the dynamo exporter may store a transposed copy): every float initializer
is matched to the torch parameter it holds by value (as is, transposed, or in ONNX's recurrent
layout, or reshaped), and every torch parameter must be found. Models are in training mode (BatchNorm uses
batch statistics in both; the running statistics are updated by both but not compared: ONNX
keeps the population variance where torch keeps the unbiased one); Dropout is 0.

Where an export changes what is trained, the case is left out and said why: constant folding
splits BertLike's pooling attention's in_proj weight and bias into two initializers each (the
query's rows, the keys' and values' rows), and writes GPTLike's tied embedding a second time,
transposed, as its own initializer (each copy then gets only its own use's gradient); the dynamo exporter's default optimizer fuses BatchNorm into the preceding Conv (it
writes BatchNormalization in inference mode even from a module in training mode), so
MobileNetV3 goes through it with optimize=False, where odt's training model puts the
BatchNormalization back into training mode. The TorchScript exporter cannot write
nn.TransformerEncoderLayer at opset 13 (scaled_dot_product_attention needs opset 14).

Tolerances: the first loss to 1e-5; gradients to rtol 1e-4 plus 1e-6 of the largest gradient of
the model (a bias before BatchNorm has an exact gradient of 0, float32 noise of ~1e-8 in both);
the 20 AdamW losses to rtol 1e-4: the two engines' rounding differences compound, from ~1e-7 at
the first step to at most ~6e-5 at the twentieth (MobileNetV3, BatchNorm over a batch of 4).
"""
from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

torch = pytest.importorskip("torch", reason="PyTorch (the dev extra) is the oracle here")

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.onnxblock import optim
from tests.odt_ops.architectures import ARCHITECTURES, Architecture

nn = torch.nn
STEPS = 20
LR = 3e-3
WEIGHT_DECAY = 0.01
EPS = 1e-6  # odt's AdamW default (ONNX Runtime's); torch.optim.AdamW is given the same

# (architecture, exporter) -> why it cannot train yet: the exact error, strict, so the test
# fails (and the mark must go) the moment the engine learns it
XFAIL: dict[tuple[str, str], str] = {}  # none today: the EmbeddingBag recommender (Loop) trains since control flow landed


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def export(arch: Architecture, how: str) -> onnx.ModelProto:
    module = arch.build()  # its own instance: exporting runs forward, which moves BatchNorm's running statistics
    inputs, _ = arch.data()
    args = tuple(torch.from_numpy(x) for x in inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how.startswith("dynamo"):
            batch = torch.export.Dim("batch")
            dynamic = tuple({0: batch} if x.shape[:1] == args[0].shape[:1] else None for x in args)
            return torch.onnx.export(module, args, dynamo=True, input_names=list(arch.input_names), output_names=["output"],
                                     dynamic_shapes=dynamic, optimize=how == "dynamo", verbose=False).model_proto
        buffer = io.BytesIO()
        torch.onnx.export(module, args, buffer, dynamo=False, opset_version=int(how.split("-")[0]),
                          input_names=list(arch.input_names), output_names=["output"], training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=how.endswith("-folded"))
    return onnx.load_from_string(buffer.getvalue())


@pytest.fixture(scope="module")
def exported():
    """Each (architecture, exporter) exported once per test session."""
    cache: dict[tuple[str, str], onnx.ModelProto] = {}

    def get(arch: Architecture, how: str) -> onnx.ModelProto:
        if (arch.name, how) not in cache:
            cache[arch.name, how] = export(arch, how)
        return cache[arch.name, how]

    return get


# ---- torch parameters in the layouts an export writes them in ------------------------------------

RNN_GATES = {nn.LSTM: [0, 3, 1, 2], nn.GRU: [1, 0, 2], nn.RNN: [0]}  # torch's (i,f,g,o)/(r,z,n) -> ONNX's (i,o,f,c)/(z,r,h)


def layouts(module: nn.Module) -> dict[str, tuple[tuple[str, ...], object]]:
    """key -> (the torch parameters it is made of, get -> array), where ``get`` reads a parameter's
    value or its gradient: each parameter as is and transposed, and each recurrent layer's
    weights as ONNX's W [D, G*H, I], R [D, G*H, H], B [D, 2*G*H]."""
    found: dict[str, tuple[tuple[str, ...], object]] = {}
    params = dict(module.named_parameters())
    for name, p in params.items():
        found[name] = ((name,), lambda get, p=p: get(p))
        if p.ndim == 2:
            found[name + ".T"] = ((name,), lambda get, p=p: get(p).T)
    for prefix, rnn in module.named_modules():
        if type(rnn) not in RNN_GATES:
            continue
        order = RNN_GATES[type(rnn)]
        suffixes = ["", "_reverse"] if rnn.bidirectional else [""]

        def onnx_form(get, names, order=order):
            return np.stack([np.concatenate([np.split(get(params[n]), len(order))[i] for i in order]) for n in names])

        for k in range(rnn.num_layers):
            names = {f: [f"{prefix}.{f}_l{k}{s}" for s in suffixes] for f in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
            for f in ("weight_ih", "weight_hh"):
                found[f"{prefix}.{f}_l{k}:onnx"] = (tuple(names[f]), lambda get, n=names[f], of=onnx_form: of(get, n))
            found[f"{prefix}.bias_l{k}:onnx"] = (
                (*names["bias_ih"], *names["bias_hh"]),
                lambda get, n=names, of=onnx_form: np.concatenate([of(get, n["bias_ih"]), of(get, n["bias_hh"])], axis=1))
    return found


def value(p):
    return p.detach().numpy()


def grad(p):
    return np.zeros(tuple(p.shape), np.float32) if p.grad is None else p.grad.numpy()


def match_parameters(proto: onnx.ModelProto, module: nn.Module) -> dict[str, str]:
    """ONNX initializer name -> the layouts() key whose value it holds exactly."""
    forms = layouts(module)
    matched = {}
    for t in proto.graph.initializer:
        array = numpy_helper.to_array(t)
        if array.dtype != np.float32 or array.size < 1:
            continue
        if t.name in forms and np.shape(forms[t.name][1](value)) == array.shape and np.array_equal(forms[t.name][1](value), array):
            matched[t.name] = t.name
            continue
        hits = [k for k, (_, f) in forms.items() if np.shape(f(value)) == array.shape and np.array_equal(f(value), array)]
        hits = hits or [k for k, (_, f) in forms.items()  # reshaped (a GroupNorm scale folded to [C, 1, 1])
                        if np.size(f(value)) == array.size and np.array_equal(np.ravel(f(value)), array.ravel())]
        if hits:
            matched[t.name] = hits[0]
    return matched


def matched_parameters(proto: onnx.ModelProto, reference: nn.Module) -> tuple[dict[str, str], dict]:
    """match_parameters() and layouts(), once every torch parameter is found in an initializer."""
    matched = match_parameters(proto, reference)
    forms = layouts(reference)
    covered = {p for key in matched.values() for p in forms[key][0]}
    missing = sorted(set(dict(reference.named_parameters())) - covered)
    assert not missing, f"torch parameters no initializer holds: {missing}"
    return matched, forms


# ---- the test ----------------------------------------------------------------------------------

CASES = [pytest.param(a, how, id=f"{a.name}-{how}", marks=[
    *([pytest.mark.slow] if a.slow or how != "17" else []),
    *([pytest.mark.xfail(strict=True, reason=XFAIL[a.name, how])] if (a.name, how) in XFAIL else [])])
    for a in ARCHITECTURES.values() for how in a.exporters]


@pytest.mark.parametrize(("arch", "how"), CASES)
def test_trains_like_torch(arch: Architecture, how: str, exported, tmp_path):
    proto = exported(arch, how)
    if how == "17":  # the export holds what the case is about
        ops = {n.op_type for n in proto.graph.node}
        assert arch.ops <= ops, f"the export lacks {sorted(arch.ops - ops)}"
    if arch.sequence_lens and not how.startswith("dynamo"):
        recurrent = [n for n in proto.graph.node if n.op_type in ("LSTM", "GRU", "RNN")]
        assert recurrent, "no sequence_lens"
        assert all(len(n.input) > 4 and n.input[4] for n in recurrent), "no sequence_lens"
    reference = arch.build()
    matched, forms = matched_parameters(proto, reference)
    trainable = sorted(matched)

    # pre-flight, then the artifacts (AdamW with torch.optim.AdamW's arithmetic)
    report = artifacts.check_coverage(proto, requires_grad=trainable)
    assert not report["missing"], report["missing"]
    loss_type = artifacts.LossType.CrossEntropyLoss if arch.loss == "ce" else artifacts.LossType.MSELoss
    artifacts.generate_artifacts(proto, requires_grad=trainable, loss=loss_type, artifact_directory=tmp_path,
                                 optimizer=optim.AdamW(mode="torch", weight_decay=WEIGHT_DECAY, eps=EPS))
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    model = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    optimizer = Optimizer(tmp_path / "optimizer_model.onnx", model)
    optimizer.set_learning_rate(LR)
    model.train()

    inputs, labels = arch.data()
    torch_inputs = [torch.from_numpy(x) for x in inputs]
    torch_labels = torch.from_numpy(labels)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, betas=(0.9, 0.999), eps=EPS, weight_decay=WEIGHT_DECAY)

    ours, theirs = [], []
    for step in range(STEPS):
        ours.append(float(model(*inputs, labels)))
        loss = arch.torch_loss(reference(*torch_inputs), torch_labels)
        loss.backward()
        theirs.append(loss.item())
        if step == 0:  # one step: the loss and every parameter's gradient
            # rounding in a gradient is relative to the terms it sums, not to the result: a bias
            # before BatchNorm has an exact gradient of 0 and float32 noise of ~1e-8 in both engines
            scale = max(float(np.abs(forms[key][1](grad)).max()) for key in matched.values())
            np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5, err_msg="first loss")
            for name, key in matched.items():
                got = state.parameters[name].grad
                want = np.reshape(forms[key][1](grad), got.shape)
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6 * scale, err_msg=f"gradient of {name} ({key})")
        optimizer.step()
        model.lazy_reset_grad()
        torch_optimizer.step()
        torch_optimizer.zero_grad()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, err_msg="20 AdamW steps' losses")
