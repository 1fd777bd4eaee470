"""train: on-device training on the user's own data through odt_ops.api.

The loop is onnxruntime's on-device training loop (CheckpointState, Module,
Optimizer, an LR scheduler): ``train.epochs`` passes over ``user_train`` in batches of
``device.batch_size`` with at most ``device.threads`` BLAS threads, stopping early at
``device.max_steps`` steps or ``device.max_seconds`` seconds, whichever comes first.
The learning rate (``optimizer.lr``, ``optimizer.schedule``) is fed at every step.

It starts from generate's checkpoint (the pretrained weights), or continues from
``train.init_checkpoint`` (parameters, buffers and, when it fits, the optimizer state:
moments and step count), which ``python -m pipeline.retrain`` points at the promoted
model. That file is not a DVC dependency, so ``train.init_sha256`` (its SHA-256, a
param) is its cache key and is checked against the file.

Outputs (data/train/): ``checkpoint`` (final, optimizer state included),
``checkpoints/step_NNNNNN`` (every ``train.checkpoint_every`` steps, optimizer state
included), ``curve.csv`` (step, epoch, loss, lr every ``train.log_every`` steps, for
``dvc plots``), ``metrics.json``. A progress bar shows on a terminal only.
"""
from __future__ import annotations

import csv
import importlib
import io
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.checkpoint import OptimizerState, load_checkpoint
from odt_ops.errors import CheckpointError
from pipeline import inputs, loop
from pipeline.config import MISSING, Section
from pipeline.errors import ConfigError, DataError
from pipeline.io import atomic_write_text, nest, sha256_file, write_json
from pipeline.optimizer import OptimizerConfig, scheduler
from pipeline.paths import Artifacts, Paths
from pipeline.tracking import NO_TRACKING, NullRun

TOTAL_STEPS = loop.TOTAL_STEPS
CURVE = "curve.csv"  # step, epoch, loss, lr (dvc plots; the PNG in MLflow)

# headline.json (dvc metrics show, dvc exp show): the mean loss of the last epoch
HEADLINE = {"final_loss": "last_epoch_loss"}


@dataclass
class TrainConfig(Section):
    epochs: int = MISSING
    shuffle: bool = MISSING
    checkpoint_every: int = MISSING
    log_every: int = MISSING
    # continue from this checkpoint (e.g. data/promoted/checkpoint) instead of the base
    init_checkpoint: str | None = MISSING
    # its SHA-256: the checkpoint is not a DVC dependency, so this param is its cache key
    init_sha256: str | None = MISSING

    def check(self) -> None:
        self.need(self.epochs >= 1, "epochs", "an integer >= 1")
        self.need(self.checkpoint_every >= 0, "checkpoint_every", "an integer >= 0 (0: final checkpoint only)")
        self.need(self.log_every >= 1, "log_every", "an integer >= 1")
        sha = self.init_sha256
        self.need(sha is None or bool(re.fullmatch(r"[0-9a-f]{64}", sha)), "init_sha256",
                  "null or 64 lowercase hex digits (sha256sum of train.init_checkpoint)")
        self.need(sha is None or bool(self.init_checkpoint), "init_sha256", "null when train.init_checkpoint is null")


@dataclass
class DeviceConfig(Section):
    name: str = MISSING
    threads: int = MISSING
    batch_size: int = MISSING
    max_steps: int | None = MISSING
    max_seconds: float | None = MISSING

    def check(self) -> None:
        self.need(self.threads >= 1, "threads", "an integer >= 1")
        self.need(self.batch_size >= 1, "batch_size", "an integer >= 1")
        self.need(self.max_steps is None or self.max_steps >= 1, "max_steps", "null or an integer >= 1")
        self.need(self.max_seconds is None or self.max_seconds > 0, "max_seconds", "null or a number > 0")


CONFIG = {"optimizer": OptimizerConfig, "train": TrainConfig, "device": DeviceConfig}


def run(cfg, paths: Paths, tracker: NullRun = NO_TRACKING) -> dict:
    gen = inputs.generated(paths)
    split = inputs.load_split(paths, "user_train")
    inputs.check_fits(split, gen.eval_model, paths)
    targets = inputs.target_encoder(gen.training_model)(split.y)

    state = CheckpointState.load_checkpoint(gen.checkpoint)
    init = continue_from(cfg, paths, state)
    module = Module(gen.training_model, state, gen.eval_model, seed=cfg.seed)
    optimizer, resumed = _optimizer(gen, module, state)

    t, dv = cfg.train, cfg.device
    per_epoch = loop.steps_per_epoch(len(split), dv.batch_size)
    total = t.epochs * per_epoch if dv.max_steps is None else min(t.epochs * per_epoch, dv.max_steps)
    lr_scheduler = scheduler(optimizer, cfg.optimizer, total)

    out = paths.out("train")
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    rows: list[tuple[int, int, float, float]] = []
    prior_steps = int(state.properties.get(TOTAL_STEPS, 0))

    def on_step(step: int, epoch: int, loss: float, lr: float) -> None:
        if step % t.log_every == 0 or step == 1:
            rows.append((step, epoch, loss, lr))
            tracker.log_metric("loss", loss, step)
            tracker.log_metric("lr", lr, step)
        if t.checkpoint_every and step % t.checkpoint_every == 0:
            state.properties[TOTAL_STEPS] = prior_steps + step
            save(state, out / "checkpoints" / f"step_{step:06d}")

    with loop.limit_threads(dv.threads):
        fit = loop.fit(
            module, optimizer, split.x, targets, epochs=t.epochs, batch_size=dv.batch_size, shuffle=t.shuffle,
            rng=np.random.default_rng(cfg.seed), lr_scheduler=lr_scheduler, max_steps=dv.max_steps,
            max_seconds=dv.max_seconds, on_step=on_step, desc="train",
        )
    state.properties[TOTAL_STEPS] = prior_steps + fit.steps
    save(state, paths.trained_checkpoint)
    _write_curve(out / CURVE, rows)

    module.eval()
    _, logits = module(split.x, targets)
    first = fit.losses[: min(per_epoch, len(fit.losses))]
    last = fit.losses[-min(per_epoch, len(fit.losses)):]
    metrics = {
        "steps": fit.steps,
        "epochs": round(fit.epochs, 6),
        "stopped_early": int(fit.stopped_by != "epochs"),
        "first_epoch_loss": float(np.mean(first)) if first else float("nan"),
        "last_epoch_loss": float(np.mean(last)) if last else float("nan"),
        "user_train.accuracy": float((logits.argmax(axis=1) == split.y).mean()),
        "examples": len(split),
        "continued": init["continued"],
        "resumed_optimizer_state": int(resumed),
        "total_steps": prior_steps + fit.steps,
    }
    write_json(paths.metrics("train"), nest(metrics))
    if fit.stopped_by != "epochs":
        print(f"train: stopped by device.{fit.stopped_by} after {fit.steps} of {t.epochs * per_epoch} steps", file=sys.stderr)
    # the console and MLflow only: metrics.json stays byte-for-byte reproducible
    return {**metrics, "seconds": fit.seconds, "steps_per_second": fit.steps / max(fit.seconds, 1e-9)}


def continue_from(cfg, paths: Paths, state: CheckpointState) -> dict:
    """Load ``train.init_checkpoint`` into ``state`` (generate's checkpoint, which knows
    what is trainable): every parameter and buffer by name, and the optimizer state."""
    spec = cfg.train.init_checkpoint
    if not spec:
        return {"continued": 0}
    path = paths.resolve(spec)
    if not path.is_file():
        raise DataError(f"train.init_checkpoint={spec}: {path} not found; point it at a checkpoint (data/promoted/checkpoint) "
                        "or set train.init_checkpoint=null to start from the pretrained model")
    want = cfg.train.init_sha256
    if want is None and os.environ.get("DVC_STAGE"):
        raise ConfigError(f"train.init_sha256: required under DVC when train.init_checkpoint is set (the file is not a DVC "
                          f"dependency; its hash is the cache key): add -S train.init_sha256=$(sha256sum {spec} | cut -c1-64)")
    got = sha256_file(path)
    if want is not None and got != want:
        raise DataError(f"train.init_checkpoint={spec}: its sha256 is {got[:12]}..., train.init_sha256 says {want[:12]}...: the file "
                        "changed since the params were written; rerun python -m pipeline.retrain, or set both again")
    try:
        init = load_checkpoint(path)
    except CheckpointError as exc:
        raise DataError(f"train.init_checkpoint={spec}: {exc}") from None
    ck = state.checkpoint
    problems = []
    for group, mine, theirs in (("parameter", ck.parameters, init.parameters), ("buffer", ck.buffers, init.buffers)):
        for name, array in mine.items():
            other = theirs.get(name)
            if other is None:
                problems.append(f"{group} {name} missing")
            elif other.shape != array.shape or other.dtype != array.dtype:
                problems.append(f"{name}: {other.dtype}{list(other.shape)} vs the model's {array.dtype}{list(array.shape)}")
    if problems:
        raise DataError(f"train.init_checkpoint={spec}: does not fit the model in data/generate ({'; '.join(problems[:4])}"
                        f"{'; ...' if len(problems) > 4 else ''}); it was trained for another model: set train.init_checkpoint=null")
    for name in ck.parameters:
        state.parameters[name].data = np.array(init.parameters[name])
    for name in ck.buffers:
        ck.buffers[name] = np.array(init.buffers[name])
    if init.optimizer is not None and sorted(init.optimizer.states) == sorted(ck.trainable_names()):
        o = init.optimizer
        ck.optimizer = OptimizerState(o.step, o.learning_rate, o.initial_learning_rate,
                                      {p: {s: np.array(a) for s, a in states.items()} for p, states in o.states.items()})
    if TOTAL_STEPS in init.properties:
        state.properties[TOTAL_STEPS] = int(init.properties[TOTAL_STEPS])
    return {"continued": 1}


def save(state: CheckpointState, path: Path) -> None:
    """A checkpoint with the optimizer state (the same state gives the same bytes)."""
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)


def _optimizer(gen: Artifacts, module: Module, state: CheckpointState) -> tuple[Optimizer, bool]:
    """The Optimizer, resuming the checkpoint's optimizer state when it fits this optimizer
    (an SGD state does not fit AdamW): then moments and step count continue."""
    ck = state.checkpoint
    if ck.optimizer is not None:
        try:
            return Optimizer(gen.optimizer_model, module), True
        except CheckpointError:
            ck.optimizer = None
    return Optimizer(gen.optimizer_model, module), False


def _write_curve(path: Path, rows) -> None:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["step", "epoch", "loss", "lr"])
    for step, epoch, loss, lr in rows:
        w.writerow([step, epoch, f"{loss:.6g}", f"{lr:.6g}"])
    atomic_write_text(path, buf.getvalue())


def after(cfg, paths: Paths, tracker) -> None:
    """The loss curve as a PNG (drawn where the tracking records are written)."""
    tracker.log_plot("loss_curve", "loss_curve.png", {"title": f"on-device training ({cfg.device.name}, lr {cfg.optimizer.lr:g})"},
                     {"curve_csv": paths.out("train") / CURVE})


def main(argv=None) -> int:
    from pipeline.stage import main as stage_main

    return stage_main("train", run, argv, after=after,
                      datasets={"user_train": "training"}, headline=HEADLINE)


if __name__ == "__main__":  # run the imported pipeline.<module>, whose classes the configuration holds (pipeline/stage.py)
    sys.exit(importlib.import_module(__spec__.name).main())
