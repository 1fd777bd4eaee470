"""LoRA on grouped convolutions keeps the groups, so the merge folds back into the grouped weight.

peft (0.21) puts a full convolution in front of a grouped 1x1 (its A mixes every input channel)
and refuses to merge when groups > 1, so the oracle is a torch twin written here with our
parametrisation: A a grouped convolution (rank*groups out channels, the layer's kernel, stride,
padding, groups) and B a grouped 1x1. Losses, adapter gradients and 20 AdamW steps must agree
with it within float32 rounding; the merged export (no adapter nodes) runs on onnxruntime and
equals our engine's adapted model.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from odt_ops import InferenceSession, artifacts
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.errors import LoraError
from odt_ops.lora import LoraConfig, export_adapter, export_adapter_base, export_merged, read_adapters
from odt_ops.onnxblock import optim
from tests.lora.torch_models import export, nn, torch

ort = pytest.importorskip("onnxruntime", reason="the merged export's oracle is onnxruntime")
RANK, ALPHA, LR, STEPS, BATCH = 2, 4.0, 0.01, 20, 8


class _GroupedCnn(nn.Module):
    """A grouped conv (groups=2), a depthwise conv (groups=8) and a linear head."""

    def __init__(self):
        super().__init__()
        self.grouped = nn.Conv2d(4, 8, 3, padding=1, groups=2)
        self.depthwise = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8)
        self.fc = nn.Linear(8 * 4 * 4, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.depthwise(torch.relu(self.grouped(x)))).flatten(1))


class _GroupedLora(nn.Module):
    """base(x) + alpha / r * B(A(x)): A grouped like the base conv, B a grouped 1x1."""

    def __init__(self, base: nn.Conv2d, a: np.ndarray):
        super().__init__()
        g = base.groups
        self.base = base.requires_grad_(False)
        self.A = nn.Conv2d(base.in_channels, RANK * g, base.kernel_size, base.stride, base.padding, base.dilation, groups=g, bias=False)
        self.B = nn.Conv2d(RANK * g, base.out_channels, 1, groups=g, bias=False)
        with torch.no_grad():
            self.A.weight.copy_(torch.from_numpy(a))
            self.B.weight.zero_()

    def forward(self, x):
        return self.base(x) + ALPHA / RANK * self.B(self.A(x))


def _data(n: int):
    rng = np.random.default_rng(5)
    return rng.standard_normal((n, 4, 8, 8)).astype(np.float32), rng.integers(0, 4, n).astype(np.int64)


def test_grouped_conv_lora_matches_a_grouped_torch_twin_and_merges_exactly(tmp_path):
    torch.manual_seed(5)
    model_t = _GroupedCnn()
    x, y = _data(STEPS * BATCH)
    paths = artifacts.generate_artifacts(export(model_t, x[:2]), loss=artifacts.LossType.CrossEntropyLoss,
                                         optimizer=optim.AdamW(mode="torch", eps=1e-8, weight_decay=0.01), artifact_directory=tmp_path,
                                         lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=["Conv"]))
    _, adapters = read_adapters(onnx.load(str(paths["eval_model"])))
    # the depthwise conv's blocks are single output channels (rank 1 at most): an op-type target leaves it out
    assert [(a.weight, a.group) for a in adapters] == [("grouped.weight", 2)]
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    (adapter,) = adapters
    assert state.parameters[adapter.A].data.shape == (RANK * 2, 2, 3, 3)
    assert state.parameters[adapter.B].data.shape == (8, RANK, 1, 1)
    module = Module(paths["training_model"], state, paths["eval_model"])
    opt = Optimizer(paths["optimizer_model"], module)
    model_t.grouped = _GroupedLora(model_t.grouped, state.parameters[adapter.A].data)
    model_t.requires_grad_(False)
    pairs = {adapter.A: model_t.grouped.A.weight, adapter.B: model_t.grouped.B.weight}
    for p in pairs.values():
        p.requires_grad_(True)
    torch_opt = torch.optim.AdamW(list(pairs.values()), lr=LR, eps=1e-8, weight_decay=0.01)
    module.train()
    for step in range(STEPS):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        module.lazy_reset_grad()
        loss = module(xb, yb)
        torch_opt.zero_grad()
        want = torch.nn.functional.cross_entropy(model_t(torch.from_numpy(xb)), torch.from_numpy(yb))
        want.backward()
        np.testing.assert_allclose(float(loss), want.item(), rtol=2e-5, err_msg=f"loss at step {step}")
        if step in (1, STEPS - 1):
            for name, p in pairs.items():
                want_grad = p.grad.numpy()
                np.testing.assert_allclose(state.parameters[name].grad, want_grad, rtol=1e-4, atol=2e-5 * float(np.abs(want_grad).max()),
                                           err_msg=f"gradient of {name} at step {step}")
        opt.set_learning_rate(LR)
        opt.step()
        torch_opt.step()
    for name, p in pairs.items():
        np.testing.assert_allclose(state.parameters[name].data, p.detach().numpy(), rtol=1e-4, atol=2e-6, err_msg=f"{name} after {STEPS} steps")
    module.eval()
    module.export_model_for_inferencing(tmp_path / "engine.onnx")
    engine = InferenceSession(str(tmp_path / "engine.onnx")).run(None, {"x": x})[0]
    merged = export_merged(paths["eval_model"], state.checkpoint, tmp_path / "merged.onnx")
    grouped = [n for n in merged.graph.node if n.op_type == "Conv"]
    assert len(grouped) == 2, "the merged model is the base graph: no adapter convolutions"
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    theirs = ort.InferenceSession(str(tmp_path / "merged.onnx"), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(theirs, engine, rtol=1e-4, atol=1e-5 * float(np.abs(engine).max()))
    with torch.no_grad():
        np.testing.assert_allclose(theirs, model_t(torch.from_numpy(x)).numpy(), rtol=1e-4, atol=1e-5 * float(np.abs(engine).max()))
    # the grouped A and B as onnxruntime's adapter file, on the base whose adapter inputs default to zero
    export_adapter_base(paths["eval_model"], state.checkpoint, tmp_path / "base.onnx")
    export_adapter(paths["eval_model"], state.checkpoint, tmp_path / "user.onnx_adapter")
    adapter = ort.LoraAdapter()
    adapter.Load(str(tmp_path / "user.onnx_adapter"))
    run = ort.RunOptions()
    run.add_active_adapter(adapter)
    options.log_severity_level = 3  # the adapter inputs are overridable initializers: that is the point
    server = ort.InferenceSession(str(tmp_path / "base.onnx"), options, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(server.run(None, {"x": x}, run)[0], engine, rtol=1e-4, atol=1e-5 * float(np.abs(engine).max()))


def test_a_glob_naming_a_conv_whose_groups_cannot_hold_the_rank_is_an_error_naming_it(tmp_path):
    x, _ = _data(2)
    with pytest.raises(LoraError, match=r"'depthwise.weight'.*in each of its 8 groups.*at most 1"):
        artifacts.generate_artifacts(export(_GroupedCnn(), x), loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path,
                                     lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=["depthwise*"]))
