"""MLflow tracking: where the store is, stage runs nested under a pipeline run with
their params, step metrics, tags and artifacts, and the runs found through a real
MLflow server's REST API."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pipeline import config, tracking
from pipeline.errors import TrackingError
from pipeline.paths import stages as pipeline_stages
from tests.pipeline.conftest import TINY_RUN, load_cfg

mlflow = pytest.importorskip("mlflow")


def test_tracking_uri_rule(monkeypatch, tmp_path):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))  # the original repo, also for queued experiments
    assert tracking.tracking_uri() == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert tracking.artifact_location(tracking.tracking_uri()) == (tmp_path.resolve() / "mlartifacts").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5999")
    assert tracking.tracking_uri() == "http://127.0.0.1:5999"
    assert tracking.artifact_location("http://127.0.0.1:5999") is None


def test_stage_run_nests_under_the_parent_with_params_metrics_tags(mlflow_store, monkeypatch, tmp_path):
    client = mlflow.MlflowClient(tracking_uri=mlflow_store)
    experiment_id = client.create_experiment("odt", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment_id, run_name="pipeline").info.run_id
    monkeypatch.setenv("ODT_PARENT_RUN_ID", parent)
    monkeypatch.setenv("DVC_EXP_NAME", "exp-test")
    monkeypatch.setenv("DVC_STAGE", "train")
    cfg = load_cfg("tracking=mlflow", "optimizer.lr=0.007")
    (tmp_path / "curve.csv").write_text("step,loss\n0,1.0\n")
    with tracking.stage_run("train", cfg, config_source="test") as run:
        for step in range(1200):  # more than one log_batch
            run.log_metric("loss", 1.0 / (step + 1), step=step)
        run.log_metrics({"accuracy": 0.9, "note": "not a number"})
        run.log_artifact(tmp_path / "curve.csv", "train")
    child = client.get_run(run.run_id)
    assert child.info.status == "FINISHED"
    assert child.info.run_name == "train"
    tags = child.data.tags
    assert tags["mlflow.parentRunId"] == parent
    assert tags["odt.stage"] == "train"
    assert tags["dvc.stage"] == "train"
    assert tags["dvc.exp"] == "exp-test"
    assert len(tags["git.commit"]) == 40
    assert child.data.params["optimizer.lr"] == "0.007"
    assert child.data.params["model.arch"] == "mlp"
    history = client.get_metric_history(run.run_id, "loss")
    assert len(history) == 1200
    assert sorted(m.step for m in history)[-1] == 1199
    assert child.data.metrics["accuracy"] == 0.9
    assert "note" not in child.data.metrics
    assert [f.path for f in client.list_artifacts(run.run_id, "train")] == ["train/curve.csv"]
    assert Path(child.info.artifact_uri.removeprefix("file://")).is_relative_to(tmp_path)


def test_failed_stage_marks_its_run_and_the_parent_failed(mlflow_store, monkeypatch):
    client = mlflow.MlflowClient(tracking_uri=mlflow_store)
    # made beforehand without a kind, as an earlier version of the pipeline made it
    experiment_id = client.create_experiment("odt", artifact_location=tracking.artifact_location(mlflow_store))
    parent = client.create_run(experiment_id, run_name="pipeline").info.run_id
    monkeypatch.setenv("ODT_PARENT_RUN_ID", parent)
    with pytest.raises(RuntimeError), tracking.stage_run("convert", load_cfg("tracking=mlflow")) as run:
        raise RuntimeError("boom")
    assert client.get_run(run.run_id).info.status == "FAILED"
    assert client.get_run(parent).info.status == "FAILED"


def test_experiment_gets_an_explicit_artifact_location(tmp_path, monkeypatch, mlflow_template):
    import shutil

    shutil.copy(mlflow_template, tmp_path / "mlflow.db")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("ODT_PARENT_RUN_ID", raising=False)
    monkeypatch.delenv("DVC_STAGE", raising=False)
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)  # never where the artifacts go
    with tracking.stage_run("prepare", load_cfg("tracking=mlflow")) as run:
        assert run.parent_run_id is None  # a hand run outside DVC is a top-level run
    exp = mlflow.MlflowClient(tracking_uri=tracking.tracking_uri()).get_experiment_by_name("odt")
    assert exp.artifact_location == (tmp_path.resolve() / "mlartifacts").as_uri()


def test_unknown_parent_is_a_clean_error(mlflow_store, monkeypatch):
    monkeypatch.setenv("ODT_PARENT_RUN_ID", "0123456789abcdef0123456789abcdef")
    with pytest.raises(TrackingError, match="ODT_PARENT_RUN_ID=0123456789abcdef0123456789abcdef: no such run"), \
            tracking.stage_run("prepare", load_cfg("tracking=mlflow")):
        pass


def test_disabled_tracking_touches_no_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'never.db'}")
    with tracking.stage_run("prepare", load_cfg()) as run:
        run.log_metric("x", 1.0, step=0)
        assert run.run_id is None
    assert not (tmp_path / "never.db").exists()


def test_invocation_key_only_under_dvc(monkeypatch):
    monkeypatch.delenv("DVC_STAGE", raising=False)
    assert tracking.dvc_invocation_key() is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        raw = resp.read().decode()
    return raw if body is None and not raw.startswith("{") else json.loads(raw)


def test_pipeline_runs_are_found_through_a_local_mlflow_server(project, mlflow_store, monkeypatch):
    """Every stage runs as a person runs it (`python -m pipeline.<stage> overrides`),
    logging to SQLite under one pipeline run; a real `mlflow server` on 127.0.0.1 then
    serves the pipeline run, the stage runs, their params, step metrics, evaluation
    metrics and artifacts over its REST API, and is stopped."""
    import importlib

    client = mlflow.MlflowClient(tracking_uri=mlflow_store)
    # made beforehand without a kind, as an earlier version of the pipeline made it
    experiment_id = client.create_experiment("odt", artifact_location=tracking.artifact_location(mlflow_store))
    parent = client.create_run(experiment_id, run_name="pipeline").info.run_id
    monkeypatch.setenv("ODT_PARENT_RUN_ID", parent)
    (project / "params.yaml").write_text(config.compose_yaml(root=project))  # logged by export into the pipeline run
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], cwd=project, check=True)  # stage runs are tagged with it
    stages = [s for s in pipeline_stages() if s != "federate"]  # federate's tracking: tests/federated/test_simulation.py
    for stage in stages:
        assert importlib.import_module(f"pipeline.{stage}").main([*TINY_RUN]) == 0, stage

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", mlflow_store,
         "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    api = f"{base}/api/2.0/mlflow"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                if _get(f"{base}/health").strip() == "OK":
                    break
            except OSError:
                pass
            assert server.poll() is None, "mlflow server exited"
            assert time.monotonic() < deadline, "mlflow server did not answer /health in 240 s"
            time.sleep(0.5)
        experiments = _get(f"{api}/experiments/search", {"max_results": 10})["experiments"]
        odt = next(e for e in experiments if e["name"] == "odt")
        runs = _get(f"{api}/runs/search", {"experiment_ids": [odt["experiment_id"]], "max_results": 50})["runs"]
        by_name = {r["info"]["run_name"]: r for r in runs}
        assert set(by_name) == {"pipeline", *stages}

        def data(run, kind):
            return {x["key"]: x["value"] for x in run["data"].get(kind, [])}

        for stage in stages:
            tags = data(by_name[stage], "tags")
            assert tags["mlflow.parentRunId"] == parent
            assert tags["odt.stage"] == stage
            assert len(tags["git.commit"]) == 40
            assert by_name[stage]["info"]["status"] == "FINISHED"
            params = data(by_name[stage], "params")
            assert params["data.user_samples"] == "100"
            assert params["optimizer.lr"] == "0.003"
        assert data(by_name["prepare"], "metrics")["n_user_train"] == 30
        ev = data(by_name["evaluate"], "metrics")
        assert ev["personalization_gain"] == pytest.approx(ev["user_holdout.personalized.accuracy"] - ev["user_holdout.base.accuracy"])
        assert "forgetting" in ev
        assert "global_test.personalized.accuracy" in ev
        # headline metrics on the pipeline run itself
        assert data(by_name["pipeline"], "metrics")["personalization_gain"] == pytest.approx(ev["personalization_gain"])
        train_id = by_name["train"]["info"]["run_id"]
        history = _get(f"{api}/metrics/get-history?run_id={train_id}&metric_key=loss")["metrics"]
        assert sorted(m["step"] for m in history) == list(range(1, 7))  # the per-step curve
        lr = _get(f"{api}/metrics/get-history?run_id={train_id}&metric_key=lr")["metrics"]
        assert {m["value"] for m in lr} == {0.003}

        def artifacts(run_id, path=""):
            return {f["path"] for f in _get(f"{api}/artifacts/list?run_id={run_id}&path={path}").get("files", [])}

        assert {"train/checkpoint", "train/checkpoints", "train/curve.csv"} <= artifacts(train_id, "train")
        png = {"plots/loss_curve.png"} if plots_available() else set()
        assert png <= artifacts(train_id, "plots")
        ev_id = by_name["evaluate"]["info"]["run_id"]
        assert ({"plots/confusion_user_holdout.png"} if plots_available() else set()) <= artifacts(ev_id, "plots")
        assert {"export/inference.onnx", "export/model.odtdiff"} <= artifacts(by_name["export"]["info"]["run_id"], "export")
        assert "params.yaml" in artifacts(parent)

        # the experiment opens on the model-training view, not MLflow 3's GenAI overview
        kind = {t["key"]: t["value"] for t in _get(f"{api}/experiments/get?experiment_id={odt['experiment_id']}")
                ["experiment"].get("tags", [])}
        assert kind[tracking.EXPERIMENT_KIND_TAG] == tracking.EXPERIMENT_KIND
        # the Dataset column: the splits each stage read, with name, digest and source
        for stage, wanted in {"pretrain": {"global_train", "global_test"}, "train": {"user_train"},
                              "evaluate": {"user_holdout", "global_test"}, "export": {"user_holdout", "global_test"}}.items():
            inputs = by_name[stage].get("inputs", {}).get("dataset_inputs", [])
            assert {i["dataset"]["name"] for i in inputs} == wanted, stage
            assert all(i["dataset"]["digest"] and "data/prepare" in i["dataset"]["source"] for i in inputs)
            contexts = {t["value"] for i in inputs for t in i.get("tags", []) if t["key"] == "mlflow.data.context"}
            assert contexts <= {"training", "evaluation"}
            assert contexts
        # the Models column: the exported model in the onnx flavor, with a signature
        export_id = by_name["export"]["info"]["run_id"]
        models = _get(f"{api}/logged-models/search", {"experiment_ids": [odt["experiment_id"]]})["models"]
        exported = [m for m in models if m["info"].get("source_run_id") == export_id]
        assert len(exported) == 1
        local = mlflow.artifacts.download_artifacts(exported[0]["info"]["artifact_uri"], tracking_uri=mlflow_store)
        mlmodel = (Path(local) / "MLmodel").read_text()
        assert "onnx:" in mlmodel
        assert "signature:" in mlmodel
        assert "inputs:" in mlmodel
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the workers it started
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def plots_available() -> bool:
    from pipeline import plots

    return plots.available()


def test_the_pipeline_run_is_named_after_the_experiment_or_the_commit(tmp_path, monkeypatch):
    """DVC sets DVC_EXP_NAME for `dvc exp run` (its docs: "Environment variables"); `dvc repro`
    sets none, so the commit names the run, marked when tracked files differ from it."""
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    subprocess.run(["git", "add", "params.yaml"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], cwd=tmp_path, check=True)
    monkeypatch.setenv("ODT_PROJECT_ROOT", str(tmp_path))
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    commit = tracking.git_commit(tmp_path)
    assert tracking.pipeline_run_name(tracking.run_tags("pipeline")) == f"repro@{commit[:8]}"
    (tmp_path / "params.yaml").write_text("seed: 1\n")
    assert tracking.pipeline_run_name(tracking.run_tags("pipeline")) == f"repro@{commit[:8]}+changes"
    monkeypatch.setenv("DVC_EXP_NAME", "lr-sweep")
    assert tracking.pipeline_run_name(tracking.run_tags("pipeline")) == "lr-sweep"
