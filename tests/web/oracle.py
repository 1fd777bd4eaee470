"""The oracle the web tests hold odt-web to: odt's Python Module and Optimizer on the same batches."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from odt_ops.api import CheckpointState, Module, Optimizer


class PythonTrainer:
    """Module + Optimizer over an artifact folder, stepping as odt-web's train() does:
    train step, optimizer step, lazy_reset_grad."""

    def __init__(self, artifacts: Path, learning_rate: float | None = None):
        self.artifacts = Path(artifacts)
        self.state = CheckpointState.load_checkpoint(self.artifacts / "checkpoint")
        self.module = Module(self.artifacts / "training_model.onnx", self.state, self.artifacts / "eval_model.onnx")
        self.optimizer = Optimizer(self.artifacts / "optimizer_model.onnx", self.module)
        if learning_rate is not None:
            self.optimizer.set_learning_rate(learning_rate)
        self.ms_per_step = 0.0

    def train(self, x: np.ndarray, y: np.ndarray, batches: list[list[int]]) -> list[float]:
        self.module.train()
        losses, started = [], time.perf_counter()
        for batch in batches:
            loss, _logits = self.module(x[batch], y[batch])
            losses.append(float(loss))
            self.optimizer.step()
            self.module.lazy_reset_grad()
        self.ms_per_step = (time.perf_counter() - started) / max(len(batches), 1) * 1000
        return losses

    def accuracy(self, x: np.ndarray, y: np.ndarray) -> float:
        self.module.eval()
        _, logits = self.module(x, y)
        return float(np.mean(np.asarray(logits).argmax(1) == y))

    @property
    def parameters(self) -> dict[str, np.ndarray]:
        return self.state.checkpoint.parameters

    def save(self, path: Path) -> None:
        CheckpointState.save_checkpoint(self.state, path, include_optimizer_state=True)


def samples(bundle_root: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    with np.load(Path(bundle_root) / "samples" / f"{name}.npz") as data:
        return data["x"].astype(np.float32), data["y"].astype(np.int64)
