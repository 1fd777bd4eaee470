"""generate_artifacts: the offline phase.

The three artifact models are standard ONNX that onnxruntime's inference build and
onnx.reference execute with odt_ops' results; parameters are inputs shared by the
training and eval models; the training model outputs the loss, extra outputs, one
gradient per trainable parameter and the updated BatchNormalization statistics
(the spec's momentum); the eval model runs in inference mode; the metadata records
every role; the options behave as onnxruntime's; bad input fails before any file is
written, naming everything at fault.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from odt_ops import artifacts, meta
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.checkpoint import load_checkpoint
from odt_ops.errors import ArtifactError, OdtError, UnsupportedOpError
from odt_ops.kernels import registry
from odt_ops.onnxblock import Block, blocks, optim
from odt_ops.onnxblock import loss as losses
from tests.odt_ops.engines import ENGINES, run_odt, run_ort
from tests.odt_ops.models import cnn, mlp

KINDS = ("training_model", "eval_model", "optimizer_model")
BN_MOMENTUM = 0.8  # not the default 0.9, so using the node's own momentum is visible


def cnn_bn_dropout(ratio: float = 0.25) -> onnx.ModelProto:
    """models.cnn() with BatchNormalization (momentum 0.8) and a Dropout before the classifier."""
    proto = cnn()
    graph = proto.graph
    for node in graph.node:
        if node.op_type == "BatchNormalization":
            node.attribute.append(helper.make_attribute("momentum", BN_MOMENTUM))
        if node.op_type == "Gemm":
            node.input[0] = "f_dropped"
    at = [n.op_type for n in graph.node].index("Gemm")
    graph.node.insert(at, helper.make_node("Dropout", ["f", "drop.ratio"], ["f_dropped"], name="dropout"))
    graph.initializer.append(numpy_helper.from_array(np.array(ratio, np.float32), "drop.ratio"))
    onnx.checker.check_model(proto, full_check=True)
    return proto


@dataclass
class Artifacts:
    directory: Path
    paths: dict[str, Path]
    protos: dict[str, onnx.ModelProto]
    info: meta.ArtifactInfo
    x: np.ndarray
    labels: np.ndarray

    def weights(self) -> dict[str, np.ndarray]:
        ckpt = load_checkpoint(self.paths["checkpoint"])
        return {**ckpt.parameters, **ckpt.buffers}

    def feeds(self) -> dict[str, np.ndarray]:
        return {self.info.user_inputs[0]: self.x, self.info.labels[0]: self.labels, **self.weights()}


def _generate(directory: Path, model, x, labels, **options) -> Artifacts:
    paths = artifacts.generate_artifacts(model, artifact_directory=directory, **options)
    protos = {k: onnx.load(paths[k]) for k in KINDS if k in paths}
    return Artifacts(directory, paths, protos, meta.read(protos["training_model"]), x, labels)


@pytest.fixture(scope="module")
def mlp_art(tmp_path_factory) -> Artifacts:
    rng = np.random.default_rng(0)
    return _generate(tmp_path_factory.mktemp("mlp"), mlp((12, 8, 4), dropout=0.3), rng.standard_normal((5, 12)).astype(np.float32),
                     rng.integers(0, 4, 5), requires_grad=["fc*"], loss=artifacts.LossType.CrossEntropyLoss,
                     optimizer=artifacts.OptimType.AdamW, additional_output_names=["output", "h0", "d0"])


@pytest.fixture(scope="module")
def cnn_art(tmp_path_factory) -> Artifacts:
    rng = np.random.default_rng(1)
    return _generate(tmp_path_factory.mktemp("cnn"), cnn_bn_dropout(), rng.standard_normal((2, 1, 28, 28)).astype(np.float32),
                     rng.integers(0, 10, 2), requires_grad=["conv*.weight", "conv2.bias", "bn1.weight", "bn1.bias", "fc.*"],
                     frozen_params=["conv1.bias"], loss=artifacts.LossType.CrossEntropyLoss,
                     optimizer=optim.AdamW(mode="torch", weight_decay=0.01, max_norm=1.0), additional_output_names=["output", "c1"])


@pytest.fixture(params=["mlp", "cnn"])
def art(request) -> Artifacts:
    return request.getfixturevalue(f"{request.param}_art")


def _no_dropout(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose Dropout ratios are 0, so training-mode runs are deterministic across engines."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    ratios = {n.input[1] for n in out.graph.node if n.op_type == "Dropout" and len(n.input) > 1}
    for t in out.graph.initializer:
        if t.name in ratios:
            t.CopyFrom(numpy_helper.from_array(np.zeros((), numpy_helper.to_array(t).dtype), t.name))
    assert ratios, "the model under test has Dropout"
    return out


def _assert_close(got: np.ndarray, want: np.ndarray, what: str, tol: float = 1e-5) -> None:
    """Max abs error within ``tol`` times the largest magnitude of ``want``."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape, got.dtype, want.dtype)
    assert got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1e-6)
    err = float(np.max(np.abs(got.astype(np.float64) - want), initial=0.0))
    assert err <= tol * scale, f"{what}: max abs error {err:.3g} > {tol} * {scale:.3g}"


def _optimizer_feeds(art: Artifacts, step: int = 3) -> dict[str, np.ndarray]:
    proto = art.protos["optimizer_model"]
    rng = np.random.default_rng(2)
    weights = art.weights()
    feeds = {"learning_rate": np.array(0.01, np.float32), "step": np.array(step, np.int64)}
    for slot in meta.read_optimizer(proto)["parameters"]:
        value = weights[slot["name"]]
        feeds[slot["value"]] = value
        feeds[slot["grad"]] = rng.standard_normal(value.shape).astype(np.float32)
        for sname, name in slot["states"].items():
            state = 0.01 * rng.standard_normal(value.shape).astype(np.float32)
            feeds[name] = np.abs(state) if sname == "exp_avg_sq" else state
    assert set(feeds) == {i.name for i in proto.graph.input}
    return feeds


def _feeds_for(art: Artifacts, kind: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    if kind == "optimizer_model":
        return art.protos[kind], _optimizer_feeds(art)
    proto = _no_dropout(art.protos[kind]) if kind == "training_model" else art.protos[kind]
    return proto, art.feeds()


# ---- standard ONNX -----------------------------------------------------------------------


def test_writes_onnxruntimes_file_names(mlp_art):
    assert sorted(p.name for p in mlp_art.directory.iterdir()) == ["checkpoint", "eval_model.onnx", "optimizer_model.onnx", "training_model.onnx"]
    assert {k: p.name for k, p in mlp_art.paths.items()} == {"training_model": "training_model.onnx", "eval_model": "eval_model.onnx",
                                                              "optimizer_model": "optimizer_model.onnx", "checkpoint": "checkpoint"}


@pytest.mark.parametrize("kind", KINDS)
def test_every_node_is_a_standard_onnx_op(art, kind):
    proto = art.protos[kind]
    onnx.checker.check_model(proto, full_check=True)
    assert [(o.domain, o.version) for o in proto.opset_import] == [("", 21)]
    opset = proto.opset_import[0].version
    for node in proto.graph.node:
        assert node.domain in ("", "ai.onnx"), f"{node.name}: domain {node.domain!r}"
        schema = onnx.defs.get_schema(node.op_type, opset, "")
        assert not schema.deprecated, f"{node.name}: {node.op_type} is deprecated"


@pytest.mark.parametrize("engine", ["onnxruntime", "reference"])
@pytest.mark.parametrize("kind", KINDS)
def test_artifacts_run_on_other_runtimes_with_odt_results(art, kind, engine):
    proto, feeds = _feeds_for(art, kind)
    names = [o.name for o in proto.graph.output]
    want = run_odt(proto, feeds)
    got = ENGINES[engine](proto, feeds)
    assert len(got) == len(want) == len(names)
    for name, g, w in zip(names, got, want):
        _assert_close(g, w, f"{kind} output {name} on {engine}")


def test_module_computes_what_the_training_graph_says(art, tmp_path):
    """The runtime fuses and reuses buffers; its step must equal the artifact graph on onnxruntime."""
    proto = _no_dropout(art.protos["training_model"])
    onnx.save(proto, tmp_path / "training_model.onnx")
    state = CheckpointState.load_checkpoint(art.paths["checkpoint"])
    module = Module(tmp_path / "training_model.onnx", state)
    outs = module(art.x, art.labels)
    want = dict(zip([o.name for o in proto.graph.output], run_ort(proto, art.feeds())))
    info = art.info
    for name, value in zip([info.loss, *info.extra_outputs], outs):
        _assert_close(value, want[name], name)
    for param, grad in info.gradients.items():
        _assert_close(state.parameters[param].grad, want[grad], f"gradient of {param}")
    for buf, updated in info.buffer_updates.items():
        _assert_close(state.checkpoint.buffers[buf], want[updated], f"updated {buf}")


def test_optimizer_step_equals_the_optimizer_graph_on_onnxruntime(cnn_art):
    state = CheckpointState.load_checkpoint(cnn_art.paths["checkpoint"])
    module = Module(cnn_art.paths["training_model"], state)
    opt = Optimizer(cnn_art.paths["optimizer_model"], module)
    opt.set_learning_rate(0.05)
    module(cnn_art.x, cnn_art.labels)
    before = {n: state.parameters[n].data.copy() for n in cnn_art.info.trainable}
    grads = {n: state.parameters[n].grad.copy() for n in cnn_art.info.trainable}
    opt.step()
    proto = cnn_art.protos["optimizer_model"]
    feeds = {"learning_rate": np.array(0.05, np.float32), "step": np.array(1, np.int64)}
    slots = meta.read_optimizer(proto)["parameters"]
    for slot in slots:
        feeds[slot["value"]], feeds[slot["grad"]] = before[slot["name"]], grads[slot["name"]]
        feeds.update({name: np.zeros_like(before[slot["name"]]) for name in slot["states"].values()})
    outs = dict(zip([o.name for o in proto.graph.output], run_ort(proto, feeds)))
    for slot in slots:
        _assert_close(state.parameters[slot["name"]].data, outs[slot["outputs"][0]], slot["name"], tol=1e-6)
        for sname, out in zip(slot["states"], slot["outputs"][1:]):
            _assert_close(state.checkpoint.optimizer.states[slot["name"]][sname], outs[out], f"{slot['name']} {sname}", tol=1e-6)


# ---- what the models contain --------------------------------------------------------------


def test_parameters_are_graph_inputs_shared_by_training_and_eval(art):
    weights = art.weights()
    roles = [*art.info.trainable, *art.info.frozen, *art.info.buffers]
    assert sorted(roles) == sorted(weights)
    for kind in ("training_model", "eval_model"):
        graph = art.protos[kind].graph
        inputs = {i.name: i.type.tensor_type for i in graph.input}
        assert not set(roles) & {t.name for t in graph.initializer}, f"{kind}: a parameter is still an initializer"
        for name in roles:
            tt = inputs[name]
            assert tt.elem_type == helper.np_dtype_to_tensor_dtype(weights[name].dtype)
            assert [d.dim_value for d in tt.shape.dim] == list(weights[name].shape), (kind, name)
    train_inputs = [i.name for i in art.protos["training_model"].graph.input]
    eval_inputs = [i.name for i in art.protos["eval_model"].graph.input]
    assert train_inputs == eval_inputs


def test_training_model_outputs_loss_extras_gradients_then_buffers(art):
    info = art.info
    graph = art.protos["training_model"].graph
    outputs = [o.name for o in graph.output]
    grads = [info.gradients[p] for p in info.trainable]
    assert outputs == [info.loss, *info.extra_outputs, *grads, *info.buffer_updates.values()]
    assert list(info.gradients) == info.trainable  # one per trainable parameter, none for frozen ones
    assert list(info.buffer_updates) == info.buffers
    types = {o.name: o.type.tensor_type for o in graph.output}
    assert types[info.loss].elem_type == TensorProto.FLOAT
    assert len(types[info.loss].shape.dim) == 0
    weights = art.weights()
    for name, out in [*info.gradients.items(), *info.buffer_updates.items()]:
        assert [d.dim_value for d in types[out].shape.dim] == list(weights[name].shape)
    values = dict(zip(outputs, run_odt(_no_dropout(art.protos["training_model"]), art.feeds())))
    for param in info.trainable:
        g = values[info.gradients[param]]
        assert g.shape == weights[param].shape, param
        assert g.dtype == np.float32, param
        assert np.any(g != 0), param


def test_eval_model_outputs_loss_and_extras_only(art):
    info = meta.read(art.protos["eval_model"])
    assert info == art.info  # the same roles recorded in both models
    assert [o.name for o in art.protos["eval_model"].graph.output] == [info.loss, *info.extra_outputs]


def test_metadata_records_roles(cnn_art, mlp_art):
    info = cnn_art.info
    assert info.user_inputs == ["input"]
    assert info.labels == ["labels"]
    assert info.inference_outputs == ["output"]
    assert info.trainable == ["conv1.weight", "conv2.weight", "conv2.bias", "bn1.weight", "bn1.bias", "fc.weight", "fc.bias"]
    assert info.frozen == ["conv1.bias"]
    assert info.buffers == ["bn1.running_mean", "bn1.running_var"]
    assert info.extra_outputs == ["output", "c1"]
    assert info.loss == cnn_art.protos["training_model"].graph.output[0].name
    assert mlp_art.info.buffers == []
    assert mlp_art.info.frozen == []
    assert mlp_art.info.buffer_updates == {}
    ckpt = load_checkpoint(cnn_art.paths["checkpoint"])
    assert ckpt.requires_grad == {**dict.fromkeys(info.trainable, True), "conv1.bias": False}
    assert sorted(ckpt.buffers) == info.buffers
    data = meta.read_optimizer(cnn_art.protos["optimizer_model"])
    assert [p["name"] for p in data["parameters"]] == info.trainable
    assert data["kind"] == "AdamW"
    assert data["hyperparameters"]["mode"] == "torch"
    assert data["hyperparameters"]["max_norm"] == 1.0


def test_metadata_is_required_and_versioned():
    proto = mlp((4, 3))
    with pytest.raises(ArtifactError, match="generate_artifacts"):
        meta.read(proto)
    proto.metadata_props.append(onnx.StringStringEntryProto(key=meta.ARTIFACT_KEY, value='{"version": 99}'))
    with pytest.raises(ArtifactError, match="newer"):
        meta.read(proto)


# ---- training and inference modes ----------------------------------------------------------


def _running_stats(c1: np.ndarray, mean: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The spec: running = momentum * running + (1 - momentum) * batch statistic (population variance)."""
    x = c1.astype(np.float64)
    return tuple((BN_MOMENTUM * old + (1 - BN_MOMENTUM) * new).astype(np.float32)
                 for old, new in ((mean, x.mean(axis=(0, 2, 3))), (var, x.var(axis=(0, 2, 3)))))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_batchnorm_running_statistics_follow_the_spec(cnn_art, engine):
    proto = cnn_art.protos["training_model"]
    feeds = cnn_art.feeds()
    feeds["bn1.running_mean"] = np.linspace(-1, 1, 8).astype(np.float32)
    feeds["bn1.running_var"] = np.linspace(0.5, 2, 8).astype(np.float32)
    out = dict(zip([o.name for o in proto.graph.output], ENGINES[engine](_no_dropout(proto), feeds)))
    mean, var = _running_stats(out["c1"], feeds["bn1.running_mean"], feeds["bn1.running_var"])
    updates = cnn_art.info.buffer_updates
    _assert_close(out[updates["bn1.running_mean"]], mean, "running mean")
    _assert_close(out[updates["bn1.running_var"]], var, "running var")


def test_module_updates_buffers_and_eval_uses_them(cnn_art):
    state = CheckpointState.load_checkpoint(cnn_art.paths["checkpoint"])
    module = Module(cnn_art.paths["training_model"], state, cnn_art.paths["eval_model"])
    before = {b: state.checkpoint.buffers[b].copy() for b in cnn_art.info.buffers}
    _, _, c1 = module(cnn_art.x, cnn_art.labels)
    mean, var = _running_stats(c1, before["bn1.running_mean"], before["bn1.running_var"])
    _assert_close(state.checkpoint.buffers["bn1.running_mean"], mean, "running mean")
    _assert_close(state.checkpoint.buffers["bn1.running_var"], var, "running var")
    eval_loss, logits, _ = module.eval()(cnn_art.x, cnn_art.labels)
    forward = cnn_bn_dropout()
    weights = {**state.checkpoint.parameters, **state.checkpoint.buffers}
    for t in forward.graph.initializer:
        if t.name in weights:
            t.CopyFrom(numpy_helper.from_array(np.asarray(weights[t.name]), t.name))
    _assert_close(logits, run_ort(forward, {"input": cnn_art.x})[0], "eval logits vs the forward model with the new statistics")


def test_eval_model_is_the_forward_model_in_inference_mode_plus_the_loss(cnn_art):
    graph = cnn_art.protos["eval_model"].graph
    for node in graph.node:
        if node.op_type == "BatchNormalization":
            assert all(a.name != "training_mode" or a.i == 0 for a in node.attribute)
            assert len(node.output) == 1
        if node.op_type == "Dropout":
            assert len(node.input) < 3 or node.input[2] == ""
    assert not any(o.name.endswith("_grad") for o in graph.output)
    feeds = cnn_art.feeds()
    feeds["bn1.running_mean"] = np.linspace(-1, 1, 8).astype(np.float32)  # running statistics, not the batch's
    feeds["bn1.running_var"] = np.linspace(0.5, 2, 8).astype(np.float32)
    loss, logits, _ = run_ort(cnn_art.protos["eval_model"], feeds)
    forward = cnn_bn_dropout()
    for t in forward.graph.initializer:
        if t.name in feeds:
            t.CopyFrom(numpy_helper.from_array(feeds[t.name], t.name))
    want = run_ort(forward, {"input": cnn_art.x})[0]
    _assert_close(logits, want, "eval logits")
    z = want.astype(np.float64) - want.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    _assert_close(loss, np.float32(-log_p[np.arange(2), cnn_art.labels].mean()), "eval loss")
    train_loss = run_ort(_no_dropout(cnn_art.protos["training_model"]), feeds)[0]
    assert abs(float(train_loss) - float(loss)) > 1e-3, "training uses batch statistics, eval the running ones"


@pytest.mark.parametrize("engine", list(ENGINES))
def test_dropout_is_on_in_training_and_gradients_use_its_mask(mlp_art, engine):
    """Backpropagation by hand through onnxruntime's (or each engine's) own mask."""
    p = 0.3
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 12)).astype(np.float32)
    y = rng.integers(0, 4, 64)
    feeds = {**mlp_art.feeds(), "input": x, "labels": y}
    proto = mlp_art.protos["training_model"]
    out = dict(zip([o.name for o in proto.graph.output], ENGINES[engine](proto, feeds)))
    h0, d0, logits = (out[n].astype(np.float64) for n in ("h0", "d0", "output"))
    kept = d0 != 0
    live = h0 > 0
    assert 0.15 < 1 - kept[live].mean() < 0.45, "about a ratio of the units is dropped"
    np.testing.assert_allclose(d0[kept], h0[kept] / (1 - p), rtol=1e-6)
    w = mlp_art.weights()
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    d_logits = (probs - np.eye(4)[y]) / len(y)
    d_z0 = (d_logits @ w["fc1.weight"].astype(np.float64)) * kept / (1 - p) * live
    want = {"fc1.weight": d_logits.T @ d0, "fc1.bias": d_logits.sum(0), "fc0.weight": d_z0.T @ x, "fc0.bias": d_z0.sum(0)}
    for param, g in want.items():
        _assert_close(out[mlp_art.info.gradients[param]], g.astype(np.float32), f"{engine}: gradient of {param}")
    ev = dict(zip([o.name for o in mlp_art.protos["eval_model"].graph.output], ENGINES[engine](mlp_art.protos["eval_model"], feeds)))
    assert np.array_equal(ev["d0"], ev["h0"]), "Dropout is off in the eval model"


# ---- options -----------------------------------------------------------------------------


def _small(**options):
    return dict(model=mlp((6, 5, 3)), loss=artifacts.LossType.MSELoss) | options


def test_trainable_frozen_and_constant_initializers(tmp_path):
    paths = artifacts.generate_artifacts(**_small(requires_grad=["fc1.weight", "fc1.bias"], frozen_params=["fc0.weight"]),
                                         artifact_directory=tmp_path)
    train = onnx.load(paths["training_model"])
    info = meta.read(train)
    assert (info.trainable, info.frozen) == (["fc1.weight", "fc1.bias"], ["fc0.weight"])
    inputs = [i.name for i in train.graph.input]
    assert "fc0.weight" in inputs
    assert "fc0.bias" not in inputs  # frozen: an input; neither: a constant
    assert "fc0.bias" in {t.name for t in train.graph.initializer}
    assert list(info.gradients) == ["fc1.weight", "fc1.bias"]
    ckpt = load_checkpoint(paths["checkpoint"])
    assert ckpt.requires_grad == {"fc1.weight": True, "fc1.bias": True, "fc0.weight": False}
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    module = Module(paths["training_model"], state)
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((3, 6)).astype(np.float32), rng.standard_normal((3, 3)).astype(np.float32)
    module(x, t)
    assert state.parameters["fc0.weight"].grad is None
    assert not state.parameters["fc0.weight"].requires_grad
    # the frozen parameter is read from the state: changing it changes the loss
    before = float(module(x, t))
    state.parameters["fc0.weight"].data = np.zeros((5, 6), np.float32)
    assert float(module(x, t)) != before


def test_no_trainable_parameters_is_an_error_free_eval_setup(tmp_path):
    paths = artifacts.generate_artifacts(**_small(frozen_params=["fc*"]), artifact_directory=tmp_path)
    info = meta.read(onnx.load(paths["training_model"]))
    assert info.trainable == []
    assert len(info.frozen) == 4
    assert info.gradients == {}


@pytest.mark.parametrize("loss, name, elem, shape", [
    (artifacts.LossType.CrossEntropyLoss, "labels", TensorProto.INT64, ["batch"]),
    (artifacts.LossType.MSELoss, "target", TensorProto.FLOAT, ["batch", 3]),
    (artifacts.LossType.BCEWithLogitsLoss, "target", TensorProto.FLOAT, ["batch", 3]),
    (artifacts.LossType.L1Loss, "target", TensorProto.FLOAT, ["batch", 3]),
])
def test_labels_are_new_graph_inputs(tmp_path, loss, name, elem, shape):
    paths = artifacts.generate_artifacts(**_small(requires_grad=["fc*"], loss=loss), artifact_directory=tmp_path)
    for kind in ("training_model", "eval_model"):
        proto = onnx.load(paths[kind])
        assert meta.read(proto).labels == [name]
        label = {i.name: i for i in proto.graph.input}[name]
        tt = label.type.tensor_type
        assert tt.elem_type == elem
        assert [d.dim_param or d.dim_value for d in tt.shape.dim] == shape
    assert meta.read(proto).user_inputs == ["input"]


def test_extra_outputs_come_after_the_loss(tmp_path):
    paths = artifacts.generate_artifacts(**_small(requires_grad=["fc*"], additional_output_names=["h0", "output"]), artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    module = Module(paths["training_model"], state, paths["eval_model"])
    rng = np.random.default_rng(0)
    x, t = rng.standard_normal((3, 6)).astype(np.float32), rng.standard_normal((3, 3)).astype(np.float32)
    for mode in ("train", "eval"):
        getattr(module, mode)()
        loss, h0, out = module(x, t)
        assert module.output_names()[1:] == ["h0", "output"]
        assert h0.shape == (3, 5)
        assert np.all(h0 >= 0)
        np.testing.assert_allclose(loss, np.mean((out - t) ** 2), rtol=1e-6)


def _two_heads() -> onnx.ModelProto:
    """input -> Gemm 'fc' -> 'first' (4) and -> Gemm 'head' -> 'second' (2): two outputs."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "fc.weight"),
             numpy_helper.from_array(rng.standard_normal((2, 4)).astype(np.float32), "head.weight")]
    nodes = [helper.make_node("Gemm", ["input", "fc.weight"], ["first"], transB=1, name="fc"),
             helper.make_node("Gemm", ["first", "head.weight"], ["second"], transB=1, name="head")]
    graph = helper.make_graph(nodes, "two_heads", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("first", TensorProto.FLOAT, ["batch", 4]),
                               helper.make_tensor_value_info("second", TensorProto.FLOAT, ["batch", 2])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _run_module(paths, *inputs):
    return Module(paths["training_model"], CheckpointState.load_checkpoint(paths["checkpoint"]))(*inputs)


def test_loss_input_names_choose_the_output_of_a_multi_output_model(tmp_path):
    x = np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32)
    first, second = run_ort(_two_heads(), {"input": x})
    t = np.ones((3, 2), np.float32)
    paths = artifacts.generate_artifacts(_two_heads(), requires_grad=["*.weight"], loss=artifacts.LossType.MSELoss,
                                         loss_input_names=["second"], artifact_directory=tmp_path / "second")
    info = meta.read(onnx.load(paths["training_model"]))
    assert info.inference_outputs == ["first", "second"]
    assert info.labels == ["target"]
    np.testing.assert_allclose(_run_module(paths, x, t), np.mean((second - t) ** 2), rtol=1e-6)
    paths = artifacts.generate_artifacts(_two_heads(), requires_grad=["fc.weight"], loss=artifacts.LossType.MSELoss,
                                         artifact_directory=tmp_path / "default")
    t = np.ones((3, 4), np.float32)
    np.testing.assert_allclose(_run_module(paths, x, t), np.mean((first - t) ** 2), rtol=1e-6)  # the first output by default


class BothHeads(Block):
    """A custom loss: like onnxruntime, a custom block receives every model output."""

    def build(self, first: str, second: str) -> str:
        return blocks.Add()(losses.MSELoss()(first, "target_first"), losses.L1Loss()(second, "target_second"))


def test_a_custom_loss_block_receives_every_output(tmp_path):
    paths = artifacts.generate_artifacts(_two_heads(), requires_grad=["*.weight"], loss=BothHeads(), artifact_directory=tmp_path)
    info = meta.read(onnx.load(paths["training_model"]))
    assert info.labels == ["target_first", "target_second"]
    rng = np.random.default_rng(1)
    x, t1, t2 = (rng.standard_normal(s).astype(np.float32) for s in ((3, 3), (3, 4), (3, 2)))
    first, second = run_ort(_two_heads(), {"input": x})
    np.testing.assert_allclose(_run_module(paths, x, t1, t2), np.mean((first - t1) ** 2) + np.mean(np.abs(second - t2)), rtol=1e-6)


@pytest.mark.parametrize("requires_grad, frozen, trainable, frozen_want", [
    (["fc?.weight"], ["*.bias"], ["fc0.weight", "fc1.weight"], ["fc0.bias", "fc1.bias"]),
    (["fc1.*", "fc0.bias"], [], ["fc1.weight", "fc1.bias", "fc0.bias"], []),
    (["*"], None, ["fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias"], []),
    (["fc[0].*", "fc0.weight"], ["fc1.weight"], ["fc0.weight", "fc0.bias"], ["fc1.weight"]),  # overlapping patterns count once
])
def test_glob_patterns_select_parameters(tmp_path, requires_grad, frozen, trainable, frozen_want):
    paths = artifacts.generate_artifacts(**_small(requires_grad=requires_grad, frozen_params=frozen), artifact_directory=tmp_path)
    info = meta.read(onnx.load(paths["training_model"]))
    assert info.trainable == trainable
    assert info.frozen == frozen_want


def test_prefix_names_every_file(tmp_path):
    paths = artifacts.generate_artifacts(**_small(requires_grad=["fc*"]), optimizer=artifacts.OptimType.SGD, prefix="user7_",
                                         nominal_checkpoint=True, artifact_directory=tmp_path)
    names = ["user7_checkpoint", "user7_eval_model.onnx", "user7_nominal_checkpoint", "user7_optimizer_model.onnx", "user7_training_model.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    assert sorted(p.name for p in paths.values()) == names
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    module = Module(paths["training_model"], state, paths["eval_model"])
    Optimizer(paths["optimizer_model"], module).step()


def test_nominal_checkpoint_holds_names_shapes_and_dtypes_only(tmp_path):
    model = mlp((64, 32, 4))
    paths = artifacts.generate_artifacts(model, requires_grad=["fc1.*"], frozen_params=["fc0.*"], loss=artifacts.LossType.MSELoss,
                                         nominal_checkpoint=True, artifact_directory=tmp_path)
    full, nominal = load_checkpoint(paths["checkpoint"]), load_checkpoint(paths["nominal_checkpoint"])
    assert nominal.nominal
    assert not full.nominal
    assert list(nominal.parameters) == list(full.parameters)
    assert nominal.requires_grad == full.requires_grad
    for name, array in full.parameters.items():
        assert nominal.spec(name) == (array.shape, array.dtype)
        assert nominal.parameters[name].size == 0
    assert paths["nominal_checkpoint"].stat().st_size < paths["checkpoint"].stat().st_size / 4
    assert not artifacts.generate_artifacts(model, requires_grad=["fc1.*"], loss=artifacts.LossType.MSELoss,
                                            artifact_directory=tmp_path / "none").get("nominal_checkpoint")


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_existing_files_are_overwritten_atomically(tmp_path, monkeypatch):
    artifacts.generate_artifacts(**_small(model=mlp((6, 5, 3), seed=0), requires_grad=["fc*"]), optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    first = _snapshot(tmp_path)
    artifacts.generate_artifacts(**_small(model=mlp((6, 5, 3), seed=1), requires_grad=["fc*"]), optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    second = _snapshot(tmp_path)
    assert list(second) == list(first)  # the same files, no temporaries left behind
    assert second["checkpoint"] != first["checkpoint"]
    ckpt = load_checkpoint(tmp_path / "checkpoint")
    want = {t.name: numpy_helper.to_array(t) for t in mlp((6, 5, 3), seed=1).graph.initializer}
    assert all(np.array_equal(ckpt.parameters[n], want[n]) for n in ckpt.parameters)

    def crash(src, dst):  # the process dies between writing a file and renaming it into place
        raise OSError("simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        artifacts.generate_artifacts(**_small(model=mlp((6, 5, 3), seed=2), requires_grad=["fc*"]), optimizer=artifacts.OptimType.SGD,
                                     artifact_directory=tmp_path)
    assert _snapshot(tmp_path) == second  # old files intact, no partial or temporary file


# ---- bad input: one error, nothing written -------------------------------------------------

BAD_OPTIONS = {
    "frozen_and_trainable": (dict(requires_grad=["fc*"], frozen_params=["fc1.bias", "fc0.weight"]), ["fc0.weight", "fc1.bias"]),
    "unknown_name": (dict(requires_grad=["fc0.weight", "fc9.weight", "conv.bias"]), ["fc9.weight", "conv.bias"]),
    "unknown_pattern": (dict(requires_grad=["fc*"], frozen_params=["encoder.*"]), ["encoder.*"]),
    "buffer_as_trainable": (dict(model=cnn(), requires_grad=["bn1.*"], loss=artifacts.LossType.CrossEntropyLoss),
                            ["bn1.running_mean", "bn1.running_var"]),
    "unknown_extra_output": (dict(requires_grad=["fc*"], additional_output_names=["h0", "logits"]), ["logits"]),
    "unknown_loss_input": (dict(requires_grad=["fc*"], loss_input_names=["scores"]), ["scores"]),
    "bad_loss": (dict(requires_grad=["fc*"], loss="mse"), ["LossType"]),
    "bad_optimizer": (dict(requires_grad=["fc*"], optimizer="adamw"), ["OptimType"]),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_options_fail_before_any_file_is_written(tmp_path, case):
    options, named = BAD_OPTIONS[case]
    (tmp_path / "training_model.onnx").write_bytes(b"an older artifact")
    with pytest.raises(ArtifactError) as err:
        artifacts.generate_artifacts(**_small(**options), artifact_directory=tmp_path)
    for name in named:
        assert name in str(err.value)
    assert _snapshot(tmp_path) == {"training_model.onnx": b"an older artifact"}


def test_integer_initializer_cannot_be_trainable(tmp_path):
    model = mlp((6, 5, 3))
    model.graph.initializer.append(numpy_helper.from_array(np.array([-1, 6], np.int64), "shape_const"))
    model.graph.node.insert(0, helper.make_node("Reshape", ["input", "shape_const"], ["flat"], name="flatten"))
    model.graph.node[1].input[0] = "flat"
    with pytest.raises(ArtifactError, match="shape_const"):
        artifacts.generate_artifacts(model, requires_grad=["fc*", "shape_const"], loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def _custom_model(domain: str) -> onnx.ModelProto:
    """fc0 -> Twice -> Relu -> Twice -> fc1 -> Half: three custom nodes between the weights and the loss."""
    model = mlp((6, 5, 3))
    graph = model.graph
    nodes = list(graph.node)
    del graph.node[:]
    for node in nodes:
        if node.op_type == "Relu":
            graph.node.append(helper.make_node("Twice", ["z0"], ["t0"], domain=domain, name="twice_a"))
            node.input[0] = "t0"
            node.output[0] = "r0"
            graph.node.append(node)
            graph.node.append(helper.make_node("Twice", ["r0"], ["h0"], domain=domain, name="twice_b"))
        elif node.name == "fc1":
            node.output[0] = "y"
            graph.node.append(node)
            graph.node.append(helper.make_node("Half", ["y"], ["output"], domain=domain, name="half"))
        else:
            graph.node.append(node)
    model.opset_import.append(helper.make_opsetid(domain, 1))
    # shape inference knows nothing of a custom op: declare its outputs' types, as exporters do
    graph.value_info.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 5]) for n in ("t0", "h0"))
    return model


@pytest.fixture
def kernels_without_rules(monkeypatch):
    """Kernels, but no gradient rules, for two ops of a test domain (removed after the test)."""

    def twice(X):
        return (X * X.dtype.type(2),)

    def half(X):
        return (X * X.dtype.type(0.5),)

    for op, fn in (("Twice", twice), ("Half", half)):
        monkeypatch.setitem(registry._KERNELS, ("test.odt", op), {1: registry.KernelEntry(fn, 1, frozenset(), frozenset())})
    return "test.odt"


def test_ops_without_a_gradient_rule_are_all_listed_before_anything_is_written(tmp_path, kernels_without_rules):
    model = _custom_model(kernels_without_rules)
    with pytest.raises(UnsupportedOpError) as err:
        artifacts.generate_artifacts(model, requires_grad=["fc*"], loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    message = str(err.value)
    for node in ("twice_a", "twice_b", "half"):
        assert node in message
    assert "gradient rule" in message
    assert set(err.value.missing) == {("test.odt", "Twice", 1), ("test.odt", "Half", 1)}  # the custom domain's own opset
    assert list(tmp_path.iterdir()) == []
    report = artifacts.check_coverage(model, ["fc*"])
    assert report["missing"] == err.value.missing


def test_ops_without_a_gradient_rule_off_the_gradient_path_are_fine(tmp_path, kernels_without_rules):
    """Only fc1 trains: the custom ops before it carry no gradient; Half after it does."""
    model = _custom_model(kernels_without_rules)
    with pytest.raises(UnsupportedOpError) as err:
        artifacts.generate_artifacts(model, requires_grad=["fc1.*"], loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    assert list(err.value.missing) == [("test.odt", "Half", 1)]
    graph = model.graph
    half = next(n for n in graph.node if n.name == "half")
    graph.node.remove(half)
    next(n for n in graph.node if n.name == "fc1").output[0] = "output"
    paths = artifacts.generate_artifacts(model, requires_grad=["fc1.*"], frozen_params=["fc0.*"], loss=artifacts.LossType.MSELoss,
                                         artifact_directory=tmp_path)
    assert meta.read(onnx.load(paths["training_model"])).trainable == ["fc1.weight", "fc1.bias"]


def test_ops_without_a_kernel_are_all_listed_before_anything_is_written(tmp_path):
    model = _custom_model("com.example.unknown")
    with pytest.raises(UnsupportedOpError) as err:
        artifacts.generate_artifacts(model, requires_grad=["fc*"], loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    for node in ("twice_a", "twice_b", "half"):
        assert node in str(err.value)
    assert list(tmp_path.iterdir()) == []
    assert isinstance(err.value, OdtError)


def test_check_coverage_counts_parameters():
    report = artifacts.check_coverage(cnn(), ["conv*", "fc.*"])
    assert report["missing"] == {}
    assert report["trainable_parameters"] == 8 * 9 + 8 + 16 * 8 * 9 + 16 + 10 * 784 + 10
    assert report["all_parameters"] == report["trainable_parameters"] + 4 * 8
    assert report["nodes"] == 9


def test_a_custom_op_on_the_path_is_reported_not_silently_cut(tmp_path):
    """Its output has no inferred type; the walk must still see the path through it."""
    from odt_ops.errors import UnsupportedOpError
    from odt_ops.grad import missing_gradients
    from odt_ops.ir.model import Model

    w = onnx.numpy_helper.from_array(np.ones((3, 4), np.float32), "w")
    nodes = [onnx.helper.make_node("Gemm", ["x", "w"], ["h"], transB=1, name="fc"),
             onnx.helper.make_node("Twice", ["h"], ["t"], domain="test.custom", name="twice"),
             onnx.helper.make_node("Relu", ["t"], ["y"], name="relu")]
    graph = onnx.helper.make_graph(nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 4])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 3])], [w])
    proto = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 21), onnx.helper.make_opsetid("test.custom", 1)])
    missing = missing_gradients(Model(proto), ["w"])
    assert missing == {("test.custom", "Twice", 1): ["twice"]}
    with pytest.raises(UnsupportedOpError, match="twice"):
        artifacts.generate_artifacts(proto, requires_grad=["w"], loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    assert not list(tmp_path.iterdir())
