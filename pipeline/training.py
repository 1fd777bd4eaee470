"""What the training stages share: the ``optimizer`` section (the optimizer graph's
block node, the learning rate and its schedule), the data splits checked against the
model, the training loop with the device's limits, learning-rate schedules, and
classification metrics.

Everything here goes through odt_ops' public API (artifacts, onnxblock, api); the
loop is onnxruntime's on-device training loop (train step, optimizer step,
lazy_reset_grad) with a progress bar on a terminal and nothing on a pipe.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from odt_ops import meta
from odt_ops.api import ConstantLRScheduler, CosineLRScheduler, LinearLRScheduler, LRScheduler
from pipeline.config import MISSING, OPTIMIZER, Section
from pipeline.errors import DataError
from pipeline.io import load_npz, verify_digest
from pipeline.paths import Artifacts, Paths

# --------------------------------------------------------------------------- the optimizer section


class ScheduleName(Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


@dataclass
class ScheduleConfig(Section):
    name: ScheduleName = MISSING
    warmup_steps: int = MISSING

    def check(self) -> None:
        self.need(self.warmup_steps >= 0, "warmup_steps", "an integer >= 0")


@dataclass
class OptimizerConfig(Section):
    """``block`` is baked into optimizer_model.onnx (generate's param); ``lr`` and
    ``schedule`` are fed at every step (train's params), so a new rate never regenerates."""

    block: dict[str, Any] = OPTIMIZER.field()
    lr: float = MISSING
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    def check(self) -> None:
        self.need(math.isfinite(self.lr) and self.lr > 0, "lr", "a finite number > 0")


def scheduler(optimizer, opt_cfg, total_steps: int) -> LRScheduler:
    """The configured schedule over ``total_steps`` (odt_ops.api LR schedulers); each
    has a linear warm-up over ``schedule.warmup_steps``."""
    s = opt_cfg.schedule
    warmup = min(int(s.warmup_steps), total_steps)
    if s.name is ScheduleName.linear:
        return LinearLRScheduler(optimizer, warmup, max(total_steps, 1), opt_cfg.lr)
    if s.name is ScheduleName.cosine:
        return CosineLRScheduler(optimizer, warmup, max(total_steps, 1), opt_cfg.lr)
    return WarmupConstantLRScheduler(optimizer, warmup, opt_cfg.lr) if warmup else ConstantLRScheduler(optimizer, opt_cfg.lr)


class WarmupConstantLRScheduler(LRScheduler):
    """Linear warm-up to the rate over ``warmup_step_count`` steps, then constant."""

    def __init__(self, optimizer, warmup_step_count: int, initial_lr: float):
        self.warmup = int(warmup_step_count)
        super().__init__(optimizer, initial_lr)

    def factor(self, step: int) -> float:
        return min(1.0, step / self.warmup)


# --------------------------------------------------------------------------- data

TOTAL_STEPS = "odt.pipeline.total_steps"  # checkpoint property: steps behind it, over continued runs


def generated(paths: Paths) -> Artifacts:
    """generate's artifacts, once every one a training stage needs is there."""
    gen = paths.artifacts
    for path in gen.required():
        if not path.is_file():
            raise DataError(f"{paths.show(path)}: generate's artifact not found; run the pipeline from the start (dvc repro)")
        verify_digest(path, paths.show(path))
    return gen


def model_proto(path: Path, paths: Paths) -> onnx.ModelProto:
    """An ONNX file's protobuf, weights left outside; a truncated or garbage file is a
    DataError naming it (protobuf's DecodeError otherwise escapes as a traceback)."""
    from google.protobuf.message import DecodeError

    try:
        return onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError, RuntimeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{paths.show(path)}: not a readable ONNX model ({reason}); rerun the stage that writes it "
                        "(dvc repro -f), or check the file you pointed at") from None



@dataclass(frozen=True)
class Split:
    name: str
    path: Path
    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


def load_split(paths: Paths, name: str) -> Split:
    path = paths.split(name)
    verify_digest(path, paths.show(path))
    arrays = load_npz(path, ("x", "y"), what="prepare output")
    x, y = arrays["x"], arrays["y"]
    if x.dtype != np.float32 or y.dtype.kind not in "iu" or len(x) != len(y):
        raise DataError(f"{paths.show(path)}: expected x float32 [N, ...] and integer y [N], got x {x.dtype}{list(x.shape)}, "
                        f"y {y.dtype}{list(y.shape)}; rerun prepare (dvc repro)")
    return Split(name, path, x, y.astype(np.int64))


def check_fits(split: Split, model_path: Path, paths: Paths) -> None:
    """The split's samples have the shape the model's first input takes; names both files."""
    proto = model_proto(model_path, paths)
    inits = {t.name for t in proto.graph.initializer}
    spec = next(i for i in proto.graph.input if i.name not in inits)
    dims = [d.dim_value if d.HasField("dim_value") else None for d in spec.type.tensor_type.shape.dim]
    got = list(split.x.shape[1:])
    if len(dims) != len(got) + 1 or any(d is not None and d != g for d, g in zip(dims[1:], got)):
        shown = "[" + ", ".join("batch" if i == 0 else ("?" if d is None else str(d)) for i, d in enumerate(dims)) + "]"
        raise DataError(
            f"{paths.show(split.path)}: samples of shape {got} do not fit the input {spec.name!r} {shown} of "
            f"{paths.show(model_path)}; set data.input_shape to the model's input and rerun prepare, or choose a model for this data"
        )


def target_encoder(model_path: Path, paths: Paths | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """Labels as the artifacts' label input takes them: class ids (cross-entropy) or
    one-hot float rows (mse, l1, bce_with_logits), read from the model's metadata."""
    proto = model_proto(model_path, paths or Paths.default())
    info = meta.read(proto, str(model_path))
    (label,) = info.labels
    value = next(i for i in proto.graph.input if i.name == label)
    elem = value.type.tensor_type.elem_type
    if elem == onnx.TensorProto.INT64:
        return lambda y: np.ascontiguousarray(y, dtype=np.int64)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
    width = value.type.tensor_type.shape.dim[-1].dim_value

    def one_hot(y: np.ndarray) -> np.ndarray:
        out = np.zeros((len(y), width), dtype=dtype)
        out[np.arange(len(y)), y] = 1
        return out

    return one_hot


# --------------------------------------------------------------------------- loop


@contextlib.contextmanager
def limit_threads(threads: int) -> Iterator[None]:
    """At most ``threads`` BLAS/OpenMP threads inside the block (threadpoolctl, when installed)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=int(threads)):
        yield


@dataclass
class FitResult:
    steps: int
    epochs: float
    stopped_by: str  # epochs | max_steps | max_seconds
    seconds: float
    losses: list[float]


def steps_per_epoch(n: int, batch_size: int) -> int:
    return max(1, math.ceil(n / batch_size))


def fit(module, optimizer, x: np.ndarray, t: np.ndarray, *, epochs: int, batch_size: int, shuffle: bool, rng: np.random.Generator,
        lr_scheduler=None, max_steps: int | None = None, max_seconds: float | None = None,
        on_step: Callable[[int, int, float, float], None] | None = None, desc: str = "train") -> FitResult:
    """Mini-batch training: ``epochs`` passes over (x, t), stopping early at ``max_steps``
    optimizer steps or ``max_seconds`` of wall time. ``on_step(step, epoch, loss, lr)``
    sees every step (1-based), with the rate that step used."""
    n = len(x)
    per_epoch = steps_per_epoch(n, batch_size)
    total = epochs * per_epoch if max_steps is None else min(epochs * per_epoch, max_steps)
    bar = _progress(total, desc)
    losses_seen: list[float] = []
    step, stopped, t0 = 0, "epochs", time.monotonic()
    try:
        for epoch in range(epochs):
            module.train()
            order = rng.permutation(n) if shuffle else np.arange(n)
            for i in range(0, n, batch_size):
                idx = order[i : i + batch_size]
                lr = optimizer.get_learning_rate()
                out = module(x[idx], t[idx])  # loss, or [loss, *extra outputs]
                loss = float(out[0] if isinstance(out, list) else out)
                optimizer.step()
                module.lazy_reset_grad()
                if lr_scheduler is not None:
                    lr_scheduler.step()
                step += 1
                losses_seen.append(loss)
                if on_step is not None:
                    on_step(step, epoch, loss, lr)
                if bar is not None:
                    bar.update(1)
                    if step % 10 == 0 or step == total:
                        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                if max_steps is not None and step >= max_steps:
                    stopped = "max_steps"
                    break
                if max_seconds is not None and time.monotonic() - t0 >= max_seconds:
                    stopped = "max_seconds"
                    break
            if stopped != "epochs":
                break
    finally:
        if bar is not None:
            bar.close()
    return FitResult(step, step / per_epoch, stopped, time.monotonic() - t0, losses_seen)


def _progress(total: int, desc: str):
    """A tqdm bar on a terminal (stderr is a TTY, as under an interactive `dvc repro`),
    None otherwise (pipes, `dvc queue`, CI): one summary line is printed at the end."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = tqdm(total=total, desc=desc, unit="step", disable=None, leave=False, dynamic_ncols=True)
    if bar.disable:
        bar.close()
        return None
    return bar


# --------------------------------------------------------------------------- metrics


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


def export_inference(module, target, ir_version: int):
    """``module``'s inference model written to ``target`` at ``ir_version`` (what export and
    federate ship); returns the model."""
    import onnx

    from pipeline.io import atomic_write_bytes

    module.export_model_for_inferencing(target)
    proto = onnx.load(str(target))
    if proto.ir_version != ir_version:
        proto.ir_version = ir_version
        onnx.checker.check_model(proto, full_check=True)
        atomic_write_bytes(target, proto.SerializeToString())
    return proto
