"""LoRA through generate_artifacts against PyTorch + peft, the library the LoRA paper's method lives in.

The same torch model (a pre-norm transformer classifier with separate q/k/v/o projections,
and a small CNN) is exported to ONNX; peft wraps the torch model with LoRA on the same
layers, and its A matrices are set to the ones our rewrite drew (B starts at zero in both).
Then the losses, the adapter gradients and 20 AdamW steps must agree within float32
rounding, and peft's merged weights must equal our merged export's.
"""
from __future__ import annotations

import numpy as np
import pytest

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.lora import LoraConfig, read_adapters
from odt_ops.onnxblock import optim
from tests.lora.torch_models import data, export, make, torch

peft = pytest.importorskip("peft", reason="the LoRA oracle needs peft (pip install -e '.[dev]')")

RANK, ALPHA, LR, STEPS, BATCH = 4, 8.0, 0.01, 20, 8
CASES = {
    "transformer": (["MatMul", "Gemm"], ["embed", "q", "k", "v", "o", "fc1", "fc2", "head"]),
    "cnn": (["Conv", "Gemm"], ["conv1", "conv2", "fc"]),
}


def _ours(kind: str, tmp_path):
    module_t = make(kind)
    x, y = data(kind, STEPS * BATCH)
    proto = export(module_t, x[:2])
    paths = artifacts.generate_artifacts(proto, loss=artifacts.LossType.CrossEntropyLoss,
                                         optimizer=optim.AdamW(mode="torch", eps=1e-8, weight_decay=0.01),
                                         artifact_directory=tmp_path, lora=LoraConfig(rank=RANK, alpha=ALPHA, targets=CASES[kind][0]))
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    module = Module(paths["training_model"], state, paths["eval_model"])
    return module_t, module, Optimizer(paths["optimizer_model"], module), state, x, y, paths


def _peft_twin(module_t, kind: str, adapters, state):
    """peft on the same torch model, its lora_A set to our A (stored [in, r]; peft keeps Linear's [r, in])."""
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=CASES[kind][1])
    model = peft.get_peft_model(module_t.train(), config)
    layers = {name.removeprefix("base_model.model."): m for name, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    pairs = {}
    for a in adapters:
        layer = layers[a.weight.removesuffix(".weight")]
        A, B = state.parameters[a.A].data, state.parameters[a.B].data
        assert not B.any(), "B starts at zero: the first forward is the base model's"
        wa, wb = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        with torch.no_grad():
            wa.copy_(torch.from_numpy(A if a.kind == "Conv" else A.T.copy()))
            wb.zero_()
        pairs[a.A], pairs[a.B] = (wa, a.kind != "Conv"), (wb, a.kind != "Conv")
    return model, pairs


def _as_ours(tensor, transpose: bool) -> np.ndarray:
    t = tensor.detach().numpy()
    return t.T if transpose else t


@pytest.mark.parametrize("kind", list(CASES))
def test_lora_matches_peft_losses_gradients_and_adamw_steps(kind, tmp_path):
    module_t, module, opt, state, x, y, paths = _ours(kind, tmp_path)
    info, adapters = read_adapters(__import__("onnx").load(str(paths["eval_model"])))
    assert len(adapters) == len(CASES[kind][1])
    assert info["rank"] == RANK
    assert sorted(state.checkpoint.trainable_names()) == sorted(n for a in adapters for n in (a.A, a.B))
    twin, pairs = _peft_twin(module_t, kind, adapters, state)
    torch_opt = torch.optim.AdamW([p for p, _ in pairs.values()], lr=LR, eps=1e-8, weight_decay=0.01)
    assert sum(p.requires_grad for p in twin.parameters()) == len(pairs), "peft trains the adapters only, as we do"
    module.train()
    for step in range(STEPS):
        xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
        module.lazy_reset_grad()
        loss = module(xb, yb)
        torch_opt.zero_grad()
        want = torch.nn.functional.cross_entropy(twin(torch.from_numpy(xb)), torch.from_numpy(yb))
        want.backward()
        np.testing.assert_allclose(float(loss), want.item(), rtol=2e-5, err_msg=f"loss at step {step}")
        if step in (0, 1, STEPS - 1):  # step 0: A's gradient is exactly zero (B = 0); step 1 on both move
            for name, (p, transpose) in pairs.items():
                want_grad = _as_ours(p.grad, transpose)  # float32 rounding: relative to the gradient's own scale
                np.testing.assert_allclose(state.parameters[name].grad, want_grad, rtol=1e-4, atol=2e-5 * float(np.abs(want_grad).max()) + 1e-9,
                                           err_msg=f"gradient of {name} at step {step}")
        opt.set_learning_rate(LR)
        opt.step()
        torch_opt.step()
    for name, (p, transpose) in pairs.items():
        got = state.parameters[name].data
        np.testing.assert_allclose(got, _as_ours(p, transpose), rtol=1e-4, atol=2e-6, err_msg=f"{name} after {STEPS} AdamW steps")
        assert np.abs(got).max() > 0
