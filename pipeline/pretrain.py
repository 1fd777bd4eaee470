"""pretrain: the cloud step. The base model trained on the global data with
the same engine the device uses (every parameter trainable, cross-entropy, the
``pretrain.optimizer`` block node at ``pretrain.lr``), exported as a forward-only ONNX model.

``pretrain.mode``: ``auto`` trains sources whose weights are fresh initializations
(the built-in models and PyTorch classes) and keeps an ONNX file as it is (already
trained elsewhere); ``train`` and ``skip`` force either.

Outputs (data/pretrain/): ``base.onnx`` (the model the device starts from; what
evaluate calls "base"), ``metrics.json`` (accuracy and loss on the global train and
test sets and on the user's holdout: the gap personalization has to close).
"""
from __future__ import annotations

import importlib
import shutil
import sys
import tempfile
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

import odt_ops
from odt_ops import artifacts
from odt_ops.api import CheckpointState, ConstantLRScheduler, Module, Optimizer
from pipeline import config, inputs, loop, scoring
from pipeline.config import MISSING, OPTIMIZER, Section
from pipeline.convert import ModelSource
from pipeline.io import flatten, nest, write_json
from pipeline.paths import Paths
from pipeline.tracking import NO_TRACKING, NullRun

EVAL_SPLITS = ("global_train", "global_test", "user_holdout")

# headline.json (dvc metrics show, dvc exp show): the pretrained base on the global test set
HEADLINE = {"base_accuracy": "global_test.accuracy"}


class PretrainMode(Enum):
    auto = "auto"
    train = "train"
    skip = "skip"


@dataclass
class PretrainConfig(Section):
    mode: PretrainMode = MISSING
    epochs: int = MISSING
    batch_size: int = MISSING
    lr: float = MISSING
    optimizer: dict[str, Any] = OPTIMIZER.field()

    def check(self) -> None:
        self.need(self.epochs >= 0, "epochs", "an integer >= 0 (0: keep the initial weights)")
        self.need(self.batch_size >= 1, "batch_size", "an integer >= 1")
        self.need(self.lr > 0, "lr", "a number > 0")


CONFIG = {"pretrain": PretrainConfig}


def should_train(cfg) -> bool:
    mode = cfg.pretrain.mode
    if mode is PretrainMode.auto:
        return cfg.model.source in (ModelSource.builtin, ModelSource.torch) and cfg.pretrain.epochs > 0
    return mode is PretrainMode.train and cfg.pretrain.epochs > 0


def run(cfg, paths: Paths, tracker: NullRun = NO_TRACKING) -> dict:
    source = inputs.upstream(paths.base_model, "convert", paths)
    splits = {name: inputs.load_split(paths, name) for name in EVAL_SPLITS}
    inputs.check_fits(splits["global_train"], source, paths)
    out = paths.out("pretrain")
    out.mkdir(parents=True, exist_ok=True)
    target = paths.pretrained_model
    fit = None
    if should_train(cfg):
        fit = _train(cfg, source, splits["global_train"], target, tracker)
    else:
        shutil.copyfile(source, target)

    sess = odt_ops.InferenceSession(target)
    (inp,) = sess.input_names()
    metrics: dict = {"trained": int(fit is not None)}
    for name, split in splits.items():
        logits = np.concatenate([sess.run(None, {inp: split.x[i : i + 512]})[0] for i in range(0, len(split), 512)])
        result = scoring.classification(logits, split.y, cfg.data.num_classes)
        metrics[f"{name}.accuracy"] = result["accuracy"]
        metrics[f"{name}.loss"] = result["loss"]
    if fit is not None:
        metrics.update({"steps": fit.steps, "epochs": cfg.pretrain.epochs, "final_train_loss": float(np.mean(fit.losses[-_per_epoch(cfg, splits):]))})
    write_json(paths.metrics("pretrain"), nest(metrics))
    if fit is not None:
        metrics["seconds"] = fit.seconds  # MLflow and the console only: metrics.json stays reproducible
    return metrics


def _per_epoch(cfg, splits) -> int:
    return loop.steps_per_epoch(len(splits["global_train"]), cfg.pretrain.batch_size)


def _train(cfg, source: Path, split: inputs.Split, target: Path, tracker) -> loop.FitResult:
    p = cfg.pretrain
    opt = config.build(p.optimizer)
    model = odt_ops.load_model(source)
    output = model.graph.output[0].name
    with tempfile.TemporaryDirectory(prefix="odt-pretrain-") as tmp:
        tmp = Path(tmp)
        artifacts.generate_artifacts(
            model, requires_grad=artifacts.default_trainable(model), loss=artifacts.LossType.CrossEntropyLoss,
            optimizer=opt, artifact_directory=tmp,
        )
        state = CheckpointState.load_checkpoint(tmp / "checkpoint")
        module = Module(tmp / "training_model.onnx", state, tmp / "eval_model.onnx", seed=cfg.seed)
        optimizer = Optimizer(tmp / "optimizer_model.onnx", module)
        ConstantLRScheduler(optimizer, p.lr)

        def on_step(step: int, epoch: int, loss: float, lr: float) -> None:
            tracker.log_metric("loss", loss, step)

        fit = loop.fit(
            module, optimizer, split.x, split.y, epochs=p.epochs, batch_size=p.batch_size, shuffle=True,
            rng=np.random.default_rng(cfg.seed), on_step=on_step, desc="pretrain",
        )
        module.export_model_for_inferencing(target, [output])
    return fit


def after(cfg, paths: Paths, tracker) -> None:
    tracker.log_parent_metrics({f"base.{k}": v for k, v in _flat_metrics(paths.metrics("pretrain")).items()
                                if k.endswith("accuracy")})


def _flat_metrics(path: Path) -> dict:
    import json

    return flatten(json.loads(path.read_text()))


def main(argv=None) -> int:
    from pipeline.stage import main as stage_main

    return stage_main("pretrain", run, argv, after=after,
                      datasets={"global_train": "training", "global_test": "evaluation"}, headline=HEADLINE)


if __name__ == "__main__":  # run the imported pipeline.<module>, whose classes the configuration holds (pipeline/stage.py)
    sys.exit(importlib.import_module(__spec__.name).main())
