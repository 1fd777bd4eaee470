"""Fixtures for the pipeline tests: the real conf/ composed at tiny sizes, temporary
project roots, prepared data, and a migrated MLflow SQLite store to copy."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra")
pytest.importorskip("omegaconf")

from pipeline import config, prepare
from pipeline.paths import Paths
from pipeline.paths import stages as pipeline_stages

REPO = Path(__file__).resolve().parents[2]
TINY = ["data.user_samples=100", "data.user_train_per_class=3"]
# the whole pipeline at test size: few digits for the user, few epochs
TINY_RUN = [*TINY, "pretrain.epochs=2", "train.epochs=3", "train.checkpoint_every=4"]


def load_cfg(*overrides: str):
    """The repository's conf/ plus overrides, tracking off, validated."""
    return config.load(["tracking=disabled", *overrides], root=REPO)


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """A project root with the real conf/ (no params.yaml), used by main()."""
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    monkeypatch.setenv("ODT_PROJECT_ROOT", str(tmp_path))
    for var in ("DVC_ROOT", "DVC_STAGE", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV", "ODT_PARENT_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Paths:
    """prepare's outputs at the default (full) size, in a temporary root."""
    paths = Paths(tmp_path_factory.mktemp("prepared"))
    prepare.run(load_cfg(), paths)
    return paths


# what most tests need run after prepare and convert: every stage but federate (Flower, slow; tests/federated/)
AFTER_CONVERT = tuple(s for s in pipeline_stages() if s not in ("prepare", "convert", "federate"))


def run_stages(cfg, paths: Paths, names=AFTER_CONVERT) -> dict:
    """Run stage functions in order (as DVC would, without DVC); returns their metrics."""
    import importlib

    return {name: importlib.import_module(f"pipeline.{name}").run(cfg, paths) for name in names}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Paths:
    """Every stage's outputs at test size (TINY_RUN), in a temporary root."""
    from pipeline import convert

    paths = Paths(tmp_path_factory.mktemp("tiny_run"))
    cfg = load_cfg(*TINY_RUN)
    prepare.run(cfg, paths)
    convert.run(cfg, paths)
    run_stages(cfg, paths)
    return paths


def copy_outputs(src: Paths, dest: Path, stages=None) -> Paths:
    """``src``'s outputs of ``stages`` (every stage's by default) under ``dest``."""
    for stage in stages or pipeline_stages():
        if src.out(stage).exists():
            shutil.copytree(src.out(stage), dest / "data" / stage)
    return Paths(dest)


PROJECT_FILES = ("pipeline", "conf", "odt_ops", "dvc.yaml", ".dvc/config", ".dvc/.gitignore", ".dvcignore", ".gitignore",
                 "data/.gitignore", "data/README.md", "data/user/README.md", "data/models/README.md", "pyproject.toml")


def project_copy(dest: Path, conf_values: str = "") -> Path:
    """A git repository holding this working tree's project files (not its outputs,
    caches or stores), with ``conf_values`` (YAML) appended to conf/config.yaml and
    params.yaml composed from it, committed: what a fresh clone looks like."""
    import subprocess

    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PROJECT_FILES:
        src = REPO / name
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, dest / name)
    for gitignore in REPO.glob("data/*/.gitignore"):  # DVC's entries for the stages' cached files
        (dest / gitignore.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(gitignore, dest / gitignore.relative_to(REPO))
    if conf_values:
        with open(dest / "conf" / "config.yaml", "a", encoding="utf-8") as f:
            f.write("\n" + conf_values)
    (dest / "params.yaml").write_text(config.compose_yaml(root=dest), encoding="utf-8")
    git = ["git", "-c", "user.name=odt-test", "-c", "user.email=odt-test@localhost", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "fresh clone"], cwd=dest, check=True)
    return dest


def dvc_env(tmp_path: Path) -> dict:
    """DVC's stages run with this interpreter (ODT_PYTHON, see pipeline/stage.sh). A
    `torch` on the path that only records being imported: the tripwire for `dvc repro`
    importing torch."""
    trap = tmp_path / "trap"
    (trap / "torch").mkdir(parents=True)
    (trap / "torch" / "__init__.py").write_text(
        f"open({str(tmp_path / 'torch-imported')!r}, 'a').write(__import__('sys').argv[0] + '\\n')\n"
        "raise ImportError('torch is not for this pipeline run')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "ODT_", "MLFLOW_"))}
    env.update(ODT_PYTHON=sys.executable, PYTHONPATH=str(trap),
               DVC_NO_ANALYTICS="1", MLFLOW_DISABLE_TELEMETRY="true", GIT_AUTHOR_NAME="odt-test", GIT_AUTHOR_EMAIL="t@localhost",
               GIT_COMMITTER_NAME="odt-test", GIT_COMMITTER_EMAIL="t@localhost")
    return env


# conf values for a whole `dvc repro` at test size (appended to conf/config.yaml: _self_ wins)
TINY_CONF = """\
data:
  user_samples: 100
  user_train_per_class: 3
pretrain:
  epochs: 2
train:
  epochs: 3
tracking:
  enabled: false
federated:
  clients: 3
  rounds: 2
  fraction_train: 1.0
  finetune_epochs: 1
  population:
    train_per_client: 10
    holdout_per_client: 10
"""


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its tables created once (creating them takes seconds)."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch, mlflow_template) -> str:
    """A fresh copy of the migrated store; MLFLOW_TRACKING_URI points at it."""
    store = tmp_path / "store"
    store.mkdir()
    shutil.copy(mlflow_template, store / "mlflow.db")
    uri = f"sqlite:///{store / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return uri
