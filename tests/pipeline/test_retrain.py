"""Scheduled retraining (python -m pipeline.retrain): the pieces as functions, then the
real job in a temporary git copy: the first model promoted over the base, nothing to
do without new data, a continued run promoted, a regressing run kept with the reason,
a busy lock, an interrupted job; the promoted model is only ever swapped whole."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline import retrain
from tests.pipeline.conftest import TINY_CONF, dvc_env, load_cfg, project_copy

pytest.importorskip("dvc")


# --------------------------------------------------------------------------- pieces


def test_inbox_digest_sees_data_files_only(tmp_path):
    inbox = tmp_path / "user"
    inbox.mkdir()
    (inbox / "README.md").write_text("docs")
    empty = retrain.inbox_digest(inbox)
    assert empty[1] == 0
    (inbox / ".DS_Store").write_bytes(b"x")
    (inbox / "README.md").write_text("other docs")
    assert retrain.inbox_digest(inbox) == empty
    (inbox / "day1.npz").write_bytes(b"1")
    one = retrain.inbox_digest(inbox)
    assert one[1] == 1 and one[0] != empty[0]
    (inbox / "day1.npz").write_bytes(b"2")
    assert retrain.inbox_digest(inbox)[0] != one[0]
    assert retrain.inbox_digest(tmp_path / "missing") == empty


@pytest.mark.parametrize(
    "overrides,candidate,current,forgetting,promote,needle",
    [
        ([], 0.80, 0.80, 0.1, True, ">= 0.8000"),  # no regression is enough
        ([], 0.79, 0.80, 0.1, False, "< 0.8000"),
        (["retrain.min_delta=0.02"], 0.81, 0.80, 0.1, False, "+ min_delta 0.02"),
        (["retrain.max_forgetting=0.05"], 0.90, 0.80, 0.1, False, "forgets 10.0 points"),
    ],
)
def test_decide(overrides, candidate, current, forgetting, promote, needle):
    d = retrain.decide(load_cfg(*overrides), {"user_holdout.personalized.accuracy": candidate, "forgetting": forgetting},
                       {"user_holdout": current}, "promoted")
    assert d.promote is promote and needle in d.reason, d.reason


def test_promote_swaps_a_symlink_and_keeps_a_few_versions(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "inference.onnx").write_bytes(b"model")
    promoted, versions = tmp_path / "data" / "promoted", tmp_path / "state" / "models"
    promoted.parent.mkdir()
    for i in range(5):
        (src / "inference.onnx").write_bytes(f"model {i}".encode())
        retrain.promote({"inference.onnx": src / "inference.onnx"}, {"job": {"id": f"job-{i}"}}, promoted, versions)
        assert promoted.is_symlink() and (promoted / "inference.onnx").read_text() == f"model {i}"
        assert json.loads((promoted / "metrics.json").read_text())["job"]["id"] == f"job-{i}"
    assert sorted(p.name for p in versions.iterdir()) == ["job-2", "job-3", "job-4"]
    with pytest.raises(FileNotFoundError):  # a promotion that fails half way leaves the current one
        retrain.promote({"inference.onnx": src / "gone.onnx"}, {"job": {"id": "job-5"}}, promoted, versions)
    assert (promoted / "inference.onnx").read_text() == "model 4" and not (versions / "job-5").exists()


def test_job_lock_is_exclusive_and_names_the_holder(tmp_path):
    lock = tmp_path / "lock"
    with retrain.job_lock(lock):
        with pytest.raises(retrain.Busy, match=rf"{lock} \(pid {os.getpid()}, started "):
            with retrain.job_lock(lock, wait=0.2):
                pass
    with retrain.job_lock(lock):  # released
        pass


# --------------------------------------------------------------------------- the job


def job(repo: Path, env: dict, *args: str, code: int = 0) -> str:
    proc = subprocess.run([sys.executable, "-m", "pipeline.retrain", *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out
    return out


def promoted_state(repo: Path) -> dict:
    p = repo / "data" / "promoted"
    return {"target": os.readlink(p), **{f.name: f.read_bytes() for f in sorted(p.iterdir())}}


def test_retrain_job_promotes_continues_keeps_and_locks(tmp_path, mlflow_store):
    repo = project_copy(tmp_path / "clone", TINY_CONF)
    env = dvc_env(tmp_path)
    inbox = repo / "data" / "user"

    # 1. nothing promoted yet: the candidate is measured against the pretrained base
    out = job(repo, env)
    assert "running the pipeline as experiment retrain-" in out and "retrain: promoted: holdout accuracy" in out, out
    assert "of the pretrained base" in out
    first = promoted_state(repo)
    assert first["target"].startswith("retrain/models/retrain-")  # data/promoted -> data/retrain/models/<job>
    assert {"inference.onnx", "checkpoint", "model.odtdiff", "metrics.json"} <= set(first)
    # 2. no new device data: nothing to do
    out = job(repo, env)
    assert "no new device data in data/user (0 file(s)" in out and "nothing to do" in out, out

    # 3. new data arrives: the job continues from the promoted checkpoint (weights and optimizer
    #    state), tracked as one MLflow run with the stage runs nested under it
    np.savez(inbox / "day1.npz", x=np.zeros((4, 64)), y=np.arange(4))
    out = job(repo, {**env, "MLFLOW_TRACKING_URI": mlflow_store}, "train.epochs=10", "tracking.enabled=true")
    assert "continuing from data/promoted/checkpoint" in out and "retrain: promoted: " in out and "of the promoted model" in out, out
    trained = json.loads((repo / "data/train/metrics.json").read_text())
    assert trained["continued"] == 1 and trained["resumed_optimizer_state"] == 1 and trained["total_steps"] == 6 + 20
    second = promoted_state(repo)
    assert second["target"] != first["target"]
    record = json.loads((repo / "data/promoted/metrics.json").read_text())["job"]
    assert record["decision"] == "promoted" and record["continued_from"] == "data/promoted/checkpoint"
    assert record["inbox_files"] == 1 and record["current_model"] == "promoted"

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store)
    runs = client.search_runs([client.get_experiment_by_name("odt").experiment_id])
    (job_run,) = [r for r in runs if r.info.run_name == "retrain"]
    assert job_run.data.tags["retrain.decision"] == "promoted" and job_run.data.metrics["promoted"] == 1
    assert job_run.data.tags["dvc.exp"] == record["id"] and job_run.info.run_id == record["mlflow_run_id"]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == job_run.info.run_id}
    assert {"prepare", "train", "evaluate", "export"} <= set(children), sorted(children)
    assert children["train"].data.tags["dvc.exp"] == record["id"] and children["train"].data.params["train.init_checkpoint"]
    assert {a.path for a in client.list_artifacts(job_run.info.run_id, "job")} >= {"job/params.yaml", "job/dvc.lock", "job/metrics.json"}
    # the promoted model is a version in MLflow's registry, and the in-service alias points at it
    in_service = client.get_model_version_by_alias("odt-personalized", "in-service")
    assert in_service.run_id == job_run.info.run_id and str(in_service.version) == str(record["registry_version"])

    # 4. a run that regresses (a learning rate that wrecks the head) is kept out, with the reason
    np.savez(inbox / "day2.npz", x=np.zeros((4, 64)), y=np.arange(4))
    out = job(repo, env, "optimizer.lr=5")
    assert "retrain: kept the current model: holdout accuracy" in out and "it would regress" in out and "data/promoted/ unchanged" in out, out
    assert promoted_state(repo) == second
    out = job(repo, env, "optimizer.lr=5")  # the same data again: already tried
    assert "already tried" in out and "--force" in out, out
    history = [json.loads(line) for line in (repo / "data/retrain/history.jsonl").read_text().splitlines()]
    assert [h["decision"] for h in history] == ["promoted", "promoted", "kept"]

    # 5. a second job while one holds the lock exits at once with a clear message (75: try again later)
    with retrain.job_lock(repo / "data/retrain/lock"):
        out = job(repo, env, "--force", code=75)
    assert "another retrain job holds" in out and "data/retrain/lock" in out and f"pid {os.getpid()}" in out, out

    # 6. an interrupted job (a scheduler's SIGTERM) leaves the promoted model as it was
    np.savez(inbox / "day3.npz", x=np.zeros((4, 64)), y=np.arange(4))
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.retrain"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "Running stage" in line:
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, "".join(seen) + rest
    assert "interrupted; the promoted model is unchanged" in rest
    assert promoted_state(repo) == second
    assert not [p for p in (repo / "data").iterdir() if p.name.startswith(".promoted")]
