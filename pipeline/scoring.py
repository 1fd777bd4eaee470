"""Classification metrics over the models' logits: accuracy, cross-entropy, confusion."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np


def batched(fn: Callable[[np.ndarray, np.ndarray], np.ndarray], x: np.ndarray, t: np.ndarray, batch_size: int) -> np.ndarray:
    return np.concatenate([fn(x[i : i + batch_size], t[i : i + batch_size]) for i in range(0, len(x), batch_size)])


def cross_entropy(logits: np.ndarray, y: np.ndarray) -> float:
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


def classification(logits: np.ndarray, y: np.ndarray, num_classes: int) -> dict:
    """accuracy, (cross-entropy) loss and the confusion matrix [actual][predicted]."""
    pred = logits.argmax(axis=1)
    confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(confusion, (y, pred), 1)
    return {"accuracy": float((pred == y).mean()), "loss": cross_entropy(logits, y), "confusion": confusion, "predicted": pred}
