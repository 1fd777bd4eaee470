"""Where things live: the project (code, conf/, params.yaml, data/) and the tracking store.

Two roots, on purpose:

- ``project_root()``: the checkout the stage runs in. DVC runs a queued experiment in a
  temporary copy (``.dvc/tmp/exps/...``) and imports ``pipeline`` from there, so the
  package's own location is the right root; ``ODT_PROJECT_ROOT`` overrides it.
- ``tracking_root()``: where ``mlflow.db`` lives, shared by every run. DVC sets
  ``DVC_ROOT`` to the *original* repository even for experiments in temporary copies,
  so it wins here; outside DVC it is the project root. (DVC_ROOT must not be used for
  stage outputs: a queued experiment would write into the user's workspace.)
"""
from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SPLITS = ("global_train", "global_test", "user_train", "user_holdout")
METRICS = "metrics.json"  # every stage's numbers, in detail (a small file git keeps; MLflow has them too)
HEADLINE = "headline.json"  # the few of them dvc.yaml lists as the stage's metrics (dvc metrics show, dvc exp show)


def project_root() -> Path:
    env = os.environ.get("ODT_PROJECT_ROOT")
    if env:
        return Path(env).resolve()
    package_parent = Path(__file__).resolve().parent.parent
    if (package_parent / "conf").is_dir():
        return package_parent
    return Path.cwd().resolve()  # a non-editable install: run from the checkout


def stages() -> tuple[str, ...]:
    """The pipeline's stages in order: dvc.yaml's, the one list. A stage is its dvc.yaml
    block, its module ``pipeline/<stage>.py`` (``run(cfg, paths, tracker)``, ``main()`` and,
    for its settings, ``CONFIG``) and its conf/ group; tests keep the three agreeing."""
    root = project_root()
    return _stages(root / "dvc.yaml" if (root / "dvc.yaml").is_file() else Path(__file__).resolve().parent.parent / "dvc.yaml")


@functools.cache
def _stages(dvc_yaml: Path) -> tuple[str, ...]:
    import yaml

    return tuple(yaml.safe_load(dvc_yaml.read_text(encoding="utf-8"))["stages"])


def tracking_root() -> Path:
    env = os.environ.get("DVC_ROOT")
    return Path(env).resolve() if env else project_root()


@dataclass(frozen=True)
class Paths:
    """The data/<stage>/ layout under one root; ``redirect`` points a stage elsewhere
    (main() writes into a staging directory and swaps it in when the stage succeeds)."""

    root: Path
    redirects: Mapping[str, Path] = field(default_factory=dict)

    @classmethod
    def default(cls) -> Paths:
        return cls(project_root())

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def user_folder(self) -> Path:
        """data/user: where the user's own data is dropped (prepare's DVC dependency)."""
        return self.data / "user"

    def out(self, stage: str) -> Path:
        """The output directory of ``stage`` (data/<stage>/)."""
        if stage not in stages():
            raise ValueError(f"unknown stage {stage!r}; stages: {', '.join(stages())}")
        return Path(self.redirects.get(stage, self.data / stage))

    def redirect(self, stage: str, directory: Path) -> Paths:
        return Paths(self.root, {**self.redirects, stage: Path(directory)})

    def split(self, name: str) -> Path:
        """One of prepare's data sets: global_train, global_test, user_train, user_holdout."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; splits: {', '.join(SPLITS)}")
        return self.out("prepare") / f"{name}.npz"

    def metrics(self, stage: str) -> Path:
        """``stage``'s metrics file: every number it reports."""
        return self.out(stage) / METRICS

    def headline(self, stage: str) -> Path:
        """``stage``'s headline metrics (``dvc metrics show`` and ``dvc exp show`` read them)."""
        return self.out(stage) / HEADLINE

    # Each output another stage (or the retraining job) reads, named once: the stage that
    # writes it and every reader use these.

    @property
    def base_model(self) -> Path:
        """convert's output: the normalized forward-only model."""
        return self.out("convert") / "base.onnx"

    @property
    def pretrained_model(self) -> Path:
        """pretrain's output: the cloud-trained forward-only model."""
        return self.out("pretrain") / "base.onnx"

    @property
    def artifacts(self) -> Artifacts:
        """generate's output: the training artifacts."""
        return Artifacts(self.out("generate"))

    @property
    def trained_checkpoint(self) -> Path:
        """train's output: the final checkpoint, optimizer state included."""
        return self.out("train") / "checkpoint"

    @property
    def inference_model(self) -> Path:
        """export's output: the personalized forward-only model."""
        return self.out("export") / "inference.onnx"

    @property
    def model_diff(self) -> Path:
        """export's output: trained minus pretrained, for federated learning."""
        return self.out("export") / "model.odtdiff"

    @property
    def federated_model(self) -> Path:
        """federate's output: the global model's forward-only model."""
        return self.out("federate") / "inference.onnx"

    def resolve(self, path: str | os.PathLike) -> Path:
        """A user-given path: absolute as is, relative to the project root otherwise."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.root / p

    def show(self, path: Path) -> str:
        """``path`` relative to the root when inside it (for messages)."""
        try:
            return str(Path(path).relative_to(self.root))
        except ValueError:
            return str(path)


@dataclass(frozen=True)
class Artifacts:
    """generate's folder: the files ``odt_ops.artifacts.generate_artifacts`` writes there."""

    directory: Path

    @property
    def training_model(self) -> Path:
        return self.directory / "training_model.onnx"

    @property
    def eval_model(self) -> Path:
        return self.directory / "eval_model.onnx"

    @property
    def optimizer_model(self) -> Path:
        return self.directory / "optimizer_model.onnx"

    @property
    def checkpoint(self) -> Path:
        """The pretrained weights, trainable and frozen: where training starts."""
        return self.directory / "checkpoint"

    @property
    def nominal_checkpoint(self) -> Path:
        return self.directory / "nominal_checkpoint"

    def required(self) -> tuple[Path, ...]:
        """What a training stage needs."""
        return (self.training_model, self.eval_model, self.optimizer_model, self.checkpoint)
