"""Fixtures for the pipeline tests: the real conf/ composed at tiny sizes, temporary
project roots, prepared data, and a migrated MLflow SQLite store to copy."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("hydra")
pytest.importorskip("omegaconf")

from pipeline import config, prepare  # noqa: E402
from pipeline.paths import Paths  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TINY = ["data.user_samples=100", "data.user_train_per_class=3"]


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
