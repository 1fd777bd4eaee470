"""The real files the fuzzer damages: artifacts of a small MLP with Dropout (so the checkpoint carries
the engine's generator state), a trained checkpoint with optimizer state and properties, a nominal
checkpoint, a model difference, a forward model with external data, and ONNX Runtime's own
checkpoint with a .data file (tests/fixtures/ort)."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.export import model_diff, save_diff
from tests.odt_ops.models import mlp

ORT_FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "ort" / "mlp_external"
SIZES = (6, 5, 3)
ARTIFACTS = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx")


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((4, SIZES[0])).astype(np.float32), rng.integers(0, SIZES[-1], 4).astype(np.int64)


def build(d: Path) -> Path:
    """Write every original into ``d`` (returned)."""
    artifacts.generate_artifacts(mlp(SIZES, dropout=0.25), requires_grad=["fc*"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=d, opset=21, nominal_checkpoint=True)
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    module = Module(d / "training_model.onnx", state, d / "eval_model.onnx")
    optimizer = Optimizer(d / "optimizer_model.onnx", module)
    module(*batch())
    optimizer.step()
    state.properties["epoch"] = 1
    state.properties["note"] = "fuzz"
    CheckpointState.save_checkpoint(state, d / "trained", include_optimizer_state=True)
    save_diff(model_diff(d / "checkpoint", d / "trained", num_examples=4, num_steps=1), d / "update.odtdiff")
    onnx.save(mlp(SIZES), d / "forward.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="forward.data", size_threshold=0)
    shutil.copy(ORT_FIXTURE / "checkpoint", d / "ort_checkpoint")
    shutil.copy(ORT_FIXTURE / "checkpoint.data", d / "ort_checkpoint.data")
    return d
