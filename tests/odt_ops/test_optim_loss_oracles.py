"""Optimizers and losses against their oracles.

Optimizers: each in its two forms (the optimizer graph, run on odt_ops, onnxruntime and
onnx.reference; and the in-place numpy ``update`` the runtime uses) over several steps
with a changing learning rate, against torch.optim (SGD, Adam, AdamW mode "torch"),
torch.nn.utils.clip_grad_norm_ for ``max_norm``, and for AdamW mode "ort" the formula
written out below in float64.

Losses: every loss and option through generate_artifacts on a small model, the loss
value and every parameter's gradient from the training model against
torch.nn.functional and autograd (in float64).
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from odt_ops import artifacts, meta
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.errors import ArgumentError
from odt_ops.onnxblock import loss as losses
from odt_ops.onnxblock import optim
from tests.odt_ops.engines import ENGINES

SHAPES = {"w": (4, 3), "b": (3,), "k": (2, 2, 2)}
LRS = [0.05, 0.04, 0.03, 0.03, 0.02, 0.01]  # the rate changes between steps, as under a scheduler


def _problem(seed: int = 0, grad_scale: float = 1.0):
    rng = np.random.default_rng(seed)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    grads = [{n: (grad_scale * rng.standard_normal(s)).astype(np.float32) for n, s in SHAPES.items()} for _ in LRS]
    return params, grads


def _run_update(opt: optim.Optimizer, params, grads) -> dict[str, np.ndarray]:
    """The in-place numpy form, step after step."""
    values = {n: p.copy() for n, p in params.items()}
    states = {n: [np.zeros_like(p) for _ in opt.state_names] for n, p in params.items()}
    for step, (lr, g) in enumerate(zip(LRS, grads), start=1):
        before = {n: x.copy() for n, x in g.items()}
        opt.update(list(values.values()), [g[n] for n in values], [states[n] for n in values], lr, step)
        assert all(np.array_equal(before[n], g[n]) for n in g), "update must leave the gradients as they were"
    return values


def _run_graph(opt: optim.Optimizer, params, grads, engine: str) -> dict[str, np.ndarray]:
    """The optimizer artifact, fed its own outputs back step after step."""
    proto = optim.build_optimizer_model(opt, params)
    slots = meta.read_optimizer(proto)["parameters"]
    assert [s["name"] for s in slots] == list(params)
    values = {n: p.copy() for n, p in params.items()}
    states = {n: {s: np.zeros_like(p) for s in opt.state_names} for n, p in params.items()}
    out_names = [o.name for o in proto.graph.output]
    for step, (lr, g) in enumerate(zip(LRS, grads), start=1):
        feeds = {"learning_rate": np.array(lr, np.float32), "step": np.array(step, np.int64)}
        for s in slots:
            feeds[s["value"]], feeds[s["grad"]] = values[s["name"]], g[s["name"]]
            feeds.update({inp: states[s["name"]][sname] for sname, inp in s["states"].items()})
        outs = dict(zip(out_names, ENGINES[engine](proto, feeds)))
        for s in slots:
            new_value, *new_states = (outs[o] for o in s["outputs"])
            values[s["name"]] = new_value
            states[s["name"]] = dict(zip(s["states"], new_states))
    return values


def _run_torch(make, params, grads, max_norm=None) -> dict[str, np.ndarray]:
    torch = pytest.importorskip("torch")
    tensors = {n: torch.nn.Parameter(torch.from_numpy(p.copy())) for n, p in params.items()}
    opt = make(torch, list(tensors.values()))
    for lr, g in zip(LRS, grads):
        for n, t in tensors.items():
            t.grad = torch.from_numpy(g[n].copy())
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(tensors.values()), max_norm)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    return {n: t.detach().numpy() for n, t in tensors.items()}


# (ours, torch's) with the same hyperparameters
TORCH_CASES = {
    "sgd": (optim.SGD(), lambda t, p: t.optim.SGD(p, lr=0.1)),
    "sgd_weight_decay": (optim.SGD(weight_decay=0.1), lambda t, p: t.optim.SGD(p, lr=0.1, weight_decay=0.1)),
    "sgd_momentum": (optim.SGD(momentum=0.9), lambda t, p: t.optim.SGD(p, lr=0.1, momentum=0.9)),
    "sgd_nesterov_weight_decay": (optim.SGD(momentum=0.8, nesterov=True, weight_decay=0.05),
                                  lambda t, p: t.optim.SGD(p, lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.05)),
    "sgd_momentum_clipped": (optim.SGD(momentum=0.9, max_norm=0.5), lambda t, p: t.optim.SGD(p, lr=0.1, momentum=0.9)),
    "adam": (optim.Adam(betas=(0.8, 0.95), eps=1e-8), lambda t, p: t.optim.Adam(p, lr=0.1, betas=(0.8, 0.95), eps=1e-8)),
    "adam_weight_decay": (optim.Adam(eps=1e-6, weight_decay=0.05), lambda t, p: t.optim.Adam(p, lr=0.1, eps=1e-6, weight_decay=0.05)),
    "adamw_torch": (optim.AdamW(mode="torch", eps=1e-8, weight_decay=0.01),
                    lambda t, p: t.optim.AdamW(p, lr=0.1, eps=1e-8, weight_decay=0.01)),
    "adamw_torch_betas_strong_decay": (optim.AdamW(mode="torch", betas=(0.7, 0.9), eps=1e-6, weight_decay=0.5),
                                       lambda t, p: t.optim.AdamW(p, lr=0.1, betas=(0.7, 0.9), eps=1e-6, weight_decay=0.5)),
    "adamw_torch_clipped": (optim.AdamW(mode="torch", eps=1e-8, weight_decay=0.01, max_norm=1.0),
                            lambda t, p: t.optim.AdamW(p, lr=0.1, eps=1e-8, weight_decay=0.01)),
    "adamw_torch_clip_inactive": (optim.AdamW(mode="torch", eps=1e-8, weight_decay=0.01, max_norm=1e3),
                                  lambda t, p: t.optim.AdamW(p, lr=0.1, eps=1e-8, weight_decay=0.01)),
}


def _assert_float32_close(got: dict, want: dict, what: str) -> None:
    for n in want:
        assert got[n].dtype == np.float32, (what, n, got[n].dtype)
        np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-6, err_msg=f"{what}: parameter {n}")


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_optimizer_reproduces_torch(case):
    ours, make = TORCH_CASES[case]
    params, grads = _problem(seed=len(case))
    want = _run_torch(make, params, grads, max_norm=ours.max_norm)
    moved = max(float(np.max(np.abs(want[n] - params[n]))) for n in params)
    assert moved > 1e-2, "the steps must move the parameters for the comparison to mean anything"
    _assert_float32_close(_run_update(ours, params, grads), want, "numpy update")
    _assert_float32_close(_run_graph(ours, params, grads, "odt"), want, "optimizer graph on odt_ops")


def test_clipping_is_active_in_the_clipped_cases():
    params, grads = _problem(seed=len("sgd_momentum_clipped"))
    norms = [np.sqrt(sum(float(np.sum(np.square(g[n], dtype=np.float64))) for n in g)) for g in grads]
    assert min(norms) > 1.0 > 0.5, norms  # every step of max_norm 0.5 and 1.0 clips
    assert max(norms) < 1e3  # and max_norm 1e3 never does


def _adamw_ort_formula(params, grads, *, betas, eps, weight_decay, max_norm=None) -> dict[str, np.ndarray]:
    """onnxruntime's AdamW in float64: the rate bias-corrected by sqrt(1 - b2^t) / (1 - b1^t),
    eps added to the uncorrected sqrt(v), then decoupled weight decay with the plain rate."""
    b1, b2 = betas
    p = {n: x.astype(np.float64) for n, x in params.items()}
    m = {n: np.zeros_like(x) for n, x in p.items()}
    v = {n: np.zeros_like(x) for n, x in p.items()}
    for t, (lr, g32) in enumerate(zip(LRS, grads), start=1):
        g = {n: x.astype(np.float64) for n, x in g32.items()}
        if max_norm is not None:
            norm = np.sqrt(sum(np.sum(x * x) for x in g.values()))
            g = {n: x * min(max_norm / (norm + 1e-6), 1.0) for n, x in g.items()}
        lr_t = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        for n in p:
            m[n] = b1 * m[n] + (1 - b1) * g[n]
            v[n] = b2 * v[n] + (1 - b2) * g[n] * g[n]
            p[n] = p[n] - lr_t * m[n] / (np.sqrt(v[n]) + eps)
            p[n] = p[n] - lr * weight_decay * p[n]
    return p


ORT_CASES = {
    "defaults": {},
    "weight_decay": {"weight_decay": 0.1},
    "betas_eps_strong_decay": {"betas": (0.8, 0.95), "eps": 1e-4, "weight_decay": 0.5},
    "clipped": {"weight_decay": 0.01, "max_norm": 0.7},
}


@pytest.mark.parametrize("case", list(ORT_CASES))
def test_adamw_ort_mode_follows_onnxruntime_formula(case):
    kwargs = ORT_CASES[case]
    ours = optim.AdamW(mode="ort", **kwargs)
    params, grads = _problem(seed=3)
    want = _adamw_ort_formula(params, grads, betas=ours.betas, eps=ours.eps, weight_decay=ours.weight_decay, max_norm=ours.max_norm)
    _assert_float32_close(_run_update(ours, params, grads), want, "numpy update")
    _assert_float32_close(_run_graph(ours, params, grads, "odt"), want, "optimizer graph on odt_ops")


def test_adamw_modes_differ_where_the_formulas_do():
    params, grads = _problem(seed=4, grad_scale=1e-3)  # eps matters next to small moments
    a = _run_update(optim.AdamW(mode="ort", eps=1e-3, weight_decay=0.3), params, grads)
    b = _run_update(optim.AdamW(mode="torch", eps=1e-3, weight_decay=0.3), params, grads)
    assert max(float(np.max(np.abs(a[n] - b[n]))) for n in a) > 1e-4


@pytest.mark.parametrize("kind, want", [
    (artifacts.OptimType.AdamW,
     {"kind": "AdamW", "hyperparameters": {"max_norm": None, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.0, "mode": "ort"}}),
    (artifacts.OptimType.SGD,
     {"kind": "SGD", "hyperparameters": {"max_norm": None, "momentum": 0.0, "nesterov": False, "weight_decay": 0.0}}),
])
def test_optim_types_are_onnxruntimes_defaults(kind, want, tmp_path):
    paths = artifacts.generate_artifacts(_linear(False), requires_grad=["w", "b"], loss=artifacts.LossType.MSELoss,
                                         optimizer=kind, artifact_directory=tmp_path)
    data = meta.read_optimizer(onnx.load(paths["optimizer_model"]))
    assert {k: data[k] for k in want} == want


ALL_OPTIMIZERS = {**{k: v[0] for k, v in TORCH_CASES.items()}, **{f"adamw_ort_{k}": optim.AdamW(**v) for k, v in ORT_CASES.items()}}


@pytest.mark.parametrize("engine", ["onnxruntime", "reference"])
@pytest.mark.parametrize("case", list(ALL_OPTIMIZERS))
def test_optimizer_graph_equals_numpy_update_on_other_runtimes(case, engine):
    opt = ALL_OPTIMIZERS[case]
    params, grads = _problem(seed=5)
    want = _run_update(opt, params, grads)
    got = _run_graph(opt, params, grads, engine)
    for n in want:
        np.testing.assert_allclose(got[n], want[n], rtol=1e-6, atol=1e-7, err_msg=f"{engine}: {n}")


def test_optimizer_graph_is_standard_onnx_and_records_its_hyperparameters():
    opt = optim.AdamW(mode="torch", betas=(0.8, 0.9), eps=1e-7, weight_decay=0.2, max_norm=2.0)
    params, _ = _problem()
    proto = optim.build_optimizer_model(opt, params)
    onnx.checker.check_model(proto, full_check=True)
    assert {n.domain for n in proto.graph.node} <= {""}
    assert [i.name for i in proto.graph.input][:2] == ["learning_rate", "step"]
    data = meta.read_optimizer(proto)
    assert data["kind"] == "AdamW"
    assert data["hyperparameters"] == {"max_norm": 2.0, "betas": [0.8, 0.9], "eps": 1e-7, "weight_decay": 0.2, "mode": "torch"}
    for slot, name in zip(data["parameters"], params):
        assert slot["name"] == name
        assert list(slot["states"]) == ["exp_avg", "exp_avg_sq"]
        assert len(slot["outputs"]) == 3
    assert len(proto.graph.output) == 3 * len(params)


# ---- losses ----------------------------------------------------------------------------

N, K, C, D = 6, 5, 4, 3


def _linear(spatial: bool) -> onnx.ModelProto:
    """Scores [N, C] = x w^T + b (Gemm, w [C, K]), or [N, C, D] = transpose(x[N, D, K] w + b)
    (MatMul, w [K, C]) for per-position losses."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((K, C) if spatial else (C, K)).astype(np.float32), "w"),
             numpy_helper.from_array((0.1 * rng.standard_normal(C)).astype(np.float32), "b")]
    if not spatial:
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["scores"], transB=1, name="fc")]
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", K])
        y = helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", C])
    else:
        nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"], name="matmul"),
                 helper.make_node("Add", ["xw", "b"], ["z"], name="bias"),
                 helper.make_node("Transpose", ["z"], ["scores"], perm=[0, 2, 1], name="classes_first")]
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", D, K])
        y = helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", C, D])
    graph = helper.make_graph(nodes, "linear", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def _torch_scores(x, w, b, spatial):
    return (x @ w + b).permute(0, 2, 1) if spatial else x @ w.T + b


W_C = [0.5, 2.0, 1.0, 0.25]  # class weights
POS = [3.0, 0.5, 1.0, 2.0]  # BCE pos_weight
MSE, L1, BCE, CE = "mse_loss", "l1_loss", "binary_cross_entropy_with_logits", "cross_entropy"


def _torch(function: str, **options):
    """torch.nn.functional.<function>(scores, target, **options), lists as float64 tensors."""

    def loss(F, scores, target):
        import torch

        kwargs = {k: torch.tensor(v, dtype=torch.float64) if isinstance(v, list) else v for k, v in options.items()}
        return getattr(F, function)(scores, target, **kwargs)

    return loss


ALL_CE = {"weight": W_C, "ignore_index": 1, "label_smoothing": 0.3}
# id -> (our loss, torch's, label kind, per-position scores [N, C, D])
LOSS_CASES = {
    "mse_default_enum": (artifacts.LossType.MSELoss, _torch(MSE), "float", False),
    "mse_sum": (losses.MSELoss("sum"), _torch(MSE, reduction="sum"), "float", False),
    "mse_none": (losses.MSELoss("none"), _torch(MSE, reduction="none"), "float", False),
    "l1_default_enum": (artifacts.LossType.L1Loss, _torch(L1), "float", False),
    "l1_sum": (losses.L1Loss("sum"), _torch(L1, reduction="sum"), "float", False),
    "l1_none": (losses.L1Loss("none"), _torch(L1, reduction="none"), "float", False),
    "bce_default_enum": (artifacts.LossType.BCEWithLogitsLoss, _torch(BCE), "prob", False),
    "bce_sum": (losses.BCEWithLogitsLoss(reduction="sum"), _torch(BCE, reduction="sum"), "prob", False),
    "bce_none": (losses.BCEWithLogitsLoss(reduction="none"), _torch(BCE, reduction="none"), "prob", False),
    "bce_weight": (losses.BCEWithLogitsLoss(weight=W_C), _torch(BCE, weight=W_C), "prob", False),
    "bce_pos_weight_sum": (losses.BCEWithLogitsLoss(pos_weight=POS, reduction="sum"), _torch(BCE, pos_weight=POS, reduction="sum"), "prob", False),
    "bce_weight_pos_weight_none": (losses.BCEWithLogitsLoss(weight=W_C, pos_weight=POS, reduction="none"),
                                   _torch(BCE, weight=W_C, pos_weight=POS, reduction="none"), "prob", False),
    "ce_default_enum": (artifacts.LossType.CrossEntropyLoss, _torch(CE), "class", False),
    "ce_sum": (losses.CrossEntropyLoss(reduction="sum"), _torch(CE, reduction="sum"), "class", False),
    "ce_none": (losses.CrossEntropyLoss(reduction="none"), _torch(CE, reduction="none"), "class", False),
    "ce_weight": (losses.CrossEntropyLoss(weight=W_C), _torch(CE, weight=W_C), "class", False),
    "ce_ignore_index": (losses.CrossEntropyLoss(ignore_index=1), _torch(CE, ignore_index=1), "class", False),
    "ce_ignore_index_none": (losses.CrossEntropyLoss(ignore_index=1, reduction="none"), _torch(CE, ignore_index=1, reduction="none"), "class", False),
    "ce_weight_ignore_index": (losses.CrossEntropyLoss(weight=W_C, ignore_index=1), _torch(CE, weight=W_C, ignore_index=1), "class", False),
    "ce_label_smoothing": (losses.CrossEntropyLoss(label_smoothing=0.1), _torch(CE, label_smoothing=0.1), "class", False),
    "ce_label_smoothing_sum": (losses.CrossEntropyLoss(label_smoothing=0.2, reduction="sum"), _torch(CE, label_smoothing=0.2, reduction="sum"), "class", False),
    "ce_label_smoothing_none": (losses.CrossEntropyLoss(label_smoothing=0.2, reduction="none"), _torch(CE, label_smoothing=0.2, reduction="none"), "class", False),
    "ce_all_options": (losses.CrossEntropyLoss(**ALL_CE), _torch(CE, **ALL_CE), "class", False),
    "ce_all_options_sum": (losses.CrossEntropyLoss(**ALL_CE, reduction="sum"), _torch(CE, **ALL_CE, reduction="sum"), "class", False),
    "ce_all_options_none": (losses.CrossEntropyLoss(**ALL_CE, reduction="none"), _torch(CE, **ALL_CE, reduction="none"), "class", False),
    "ce_spatial": (losses.CrossEntropyLoss(), _torch(CE), "class", True),
    "ce_spatial_all_options": (losses.CrossEntropyLoss(**ALL_CE), _torch(CE, **ALL_CE), "class", True),
    "ce_spatial_all_options_none": (losses.CrossEntropyLoss(**ALL_CE, reduction="none"), _torch(CE, **ALL_CE, reduction="none"), "class", True),
}


def _labels(kind: str, spatial: bool, rng) -> np.ndarray:
    shape = (N, C, D) if spatial else (N, C)
    if kind == "float":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "prob":
        return rng.uniform(0, 1, shape).astype(np.float32)
    labels = rng.integers(0, C, (N, D) if spatial else (N,))
    labels.flat[:2] = 1  # ignore_index=1 always has something to ignore
    labels.flat[2] = 0
    return labels.astype(np.int64)


@pytest.mark.parametrize("case", list(LOSS_CASES))
def test_loss_value_and_gradients_equal_torch(case, tmp_path):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    ours, torch_loss, label_kind, spatial = LOSS_CASES[case]
    artifacts.generate_artifacts(_linear(spatial), requires_grad=["w", "b"], loss=ours, artifact_directory=tmp_path)
    info = meta.read(onnx.load(tmp_path / "training_model.onnx"))
    assert len(info.labels) == 1
    rng = np.random.default_rng(len(case))
    x = rng.standard_normal((N, D, K) if spatial else (N, K)).astype(np.float32)
    y = _labels(label_kind, spatial, rng)

    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    w0, b0 = state.parameters["w"].data.copy(), state.parameters["b"].data.copy()
    module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
    loss = module(x, y)
    grads = {n: state.parameters[n].grad.copy() for n in ("w", "b")}
    eval_loss = module.eval()(x, y)

    w = torch.tensor(w0, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(b0, dtype=torch.float64, requires_grad=True)
    scores = _torch_scores(torch.tensor(x, dtype=torch.float64), w, b, spatial)
    target = torch.tensor(y) if label_kind == "class" else torch.tensor(y, dtype=torch.float64)
    want = torch_loss(F, scores, target)
    want.sum().backward()  # a reduction="none" loss is differentiated as its sum

    want_loss = want.detach().numpy()
    assert loss.shape == want_loss.shape
    assert loss.dtype == np.float32
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(eval_loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, t in (("w", w), ("b", b)):
        want_grad = t.grad.numpy()
        assert float(np.max(np.abs(want_grad))) > 1e-3
        np.testing.assert_allclose(grads[name], want_grad, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(want_grad))), err_msg=name)


@pytest.mark.parametrize("bad", [lambda: losses.MSELoss("avg"), lambda: losses.CrossEntropyLoss(label_smoothing=1.5),
                                 lambda: losses.BCEWithLogitsLoss(reduction="max"), lambda: optim.AdamW(mode="keras"),
                                 lambda: optim.SGD(nesterov=True), lambda: optim.Adam(mode="ort")])
def test_bad_loss_and_optimizer_options_fail_at_construction(bad):
    with pytest.raises(ArgumentError):  # ours, and a ValueError for generic callers
        bad()


# ---- the whole loop: artifacts, Module and Optimizer against a torch training loop ------


def _torch_mlp(torch, state, names):
    layers = []
    for i in range(len(names) // 2):
        w, b = state.parameters[f"fc{i}.weight"].data, state.parameters[f"fc{i}.bias"].data
        lin = torch.nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            lin.weight.copy_(torch.from_numpy(w.copy()))
            lin.bias.copy_(torch.from_numpy(b.copy()))
        layers += [lin, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


@pytest.mark.parametrize("case", ["sgd_nesterov_weight_decay", "sgd_momentum_clipped", "adam_weight_decay", "adamw_torch_clipped"])
def test_training_loop_reproduces_torch(case, tmp_path):
    torch = pytest.importorskip("torch")
    from tests.odt_ops.models import classification_data, mlp

    ours, make = TORCH_CASES[case]
    artifacts.generate_artifacts(mlp((20, 16, 5)), requires_grad=["fc*"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=ours, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(tmp_path / "training_model.onnx", state)
    opt = Optimizer(tmp_path / "optimizer_model.onnx", module)
    net = _torch_mlp(torch, state, state.parameters.keys())
    torch_opt = make(torch, list(net.parameters()))
    x, y = classification_data(8 * len(LRS), features=20, classes=5, seed=2)
    for i, lr in enumerate(LRS):
        xb, yb = x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8]
        opt.set_learning_rate(lr)
        module(xb, yb)
        opt.step()
        module.lazy_reset_grad()
        torch_opt.zero_grad()
        torch.nn.functional.cross_entropy(net(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
        if ours.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), ours.max_norm)
        for group in torch_opt.param_groups:
            group["lr"] = lr
        torch_opt.step()
    for i in range(2):
        for kind, t in (("weight", net[2 * i].weight), ("bias", net[2 * i].bias)):
            np.testing.assert_allclose(state.parameters[f"fc{i}.{kind}"].data, t.detach().numpy(), rtol=1e-4, atol=1e-5,
                                       err_msg=f"fc{i}.{kind}")


@pytest.mark.parametrize("case", [c for c, opt in ALL_OPTIMIZERS.items() if opt.max_norm is None])
def test_numpy_update_is_the_graph_bit_for_bit_on_odt(case):
    """The in-place form keeps the graph's operations and their order, so on odt_ops's own
    kernels the two agree exactly, not just within rounding (clipping aside: its norm sums
    the squares in another order)."""
    opt = ALL_OPTIMIZERS[case]
    params, grads = _problem(seed=6)
    want = _run_graph(opt, params, grads, "odt")
    got = _run_update(opt, params, grads)
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=n)
