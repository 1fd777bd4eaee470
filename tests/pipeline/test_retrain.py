"""Scheduled retraining (python -m pipeline.retrain): the pieces as functions, then the
real job in a temporary git copy: labelled PNGs in the inbox are what the promoted
model trained on (prepare's output holds exactly them, MLflow's dataset digest is the
inbox's sha256 as sha256sum computes it), the workspace stays clean, nothing to do
without new data, a regressing run kept with the reason, a busy lock, an interrupted
job; the promoted model is only ever swapped whole."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline import promotion, retrain
from tests.pipeline.conftest import TINY_CONF, dvc_env, load_cfg, project_copy

pytest.importorskip("dvc")


# --------------------------------------------------------------------------- pieces


def sha256sum_digest(folder: Path) -> str:
    """The inbox digest as coreutils computes it: sha256 of ``sha256sum`` over the data files."""
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                   if p.is_file() and not p.name.startswith((".", "README")))
    listing = subprocess.run(["sha256sum", "--", *files], cwd=folder, capture_output=True, check=True).stdout
    return hashlib.sha256(listing).hexdigest()


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
    (inbox / "3").mkdir()
    (inbox / "3" / "a.png").write_bytes(b"png")
    one = retrain.inbox_digest(inbox)
    assert one == (sha256sum_digest(inbox), 2)
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
    assert d.promote is promote, d.reason
    assert needle in d.reason, d.reason


def test_promote_swaps_a_symlink_and_keeps_a_few_versions(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "inference.onnx").write_bytes(b"model")
    promoted, versions = tmp_path / "data" / "promoted", tmp_path / "state" / "models"
    promoted.parent.mkdir()
    for i in range(5):
        (src / "inference.onnx").write_bytes(f"model {i}".encode())
        promotion.promote({"inference.onnx": src / "inference.onnx"}, {"job": {"id": f"job-{i}"}}, promoted, versions)
        assert promoted.is_symlink()
        assert (promoted / "inference.onnx").read_text() == f"model {i}"
        assert json.loads((promoted / "metrics.json").read_text())["job"]["id"] == f"job-{i}"
    assert sorted(p.name for p in versions.iterdir()) == ["job-2", "job-3", "job-4"]
    with pytest.raises(FileNotFoundError):  # a promotion that fails half way leaves the current one
        promotion.promote({"inference.onnx": src / "gone.onnx"}, {"job": {"id": "job-5"}}, promoted, versions)
    assert (promoted / "inference.onnx").read_text() == "model 4"
    assert not (versions / "job-5").exists()
    assert sorted(p.name for p in versions.iterdir()) == ["job-2", "job-3", "job-4"]  # no staging left behind


def test_job_lock_is_exclusive_and_names_the_holder(tmp_path):
    lock = tmp_path / "lock"
    with promotion.job_lock(lock), pytest.raises(promotion.Busy, match=rf"{lock} \(pid {os.getpid()}, started "), promotion.job_lock(lock, wait=0.2):
        pass
    with promotion.job_lock(lock):  # released
        pass


@pytest.mark.parametrize(
    "setup,args,code,needles",
    [
        (lambda d: np.savez(d / "mine.npz", x=np.zeros((4, 64)), y=np.arange(4)), ["data.user_data=elsewhere/mine.npz"], 2,
         ["data.user_data=elsewhere/mine.npz", "outside the inbox", "retrain.inbox"]),
        (lambda d: None, ["retrain.inbox=elsewhere"], 2, ["retrain.inbox=elsewhere", "data/user"]),
        (lambda d: None, ["--wait", "soon"], 2, ["--wait", "invalid float value"]),
        (lambda d: None, ["--frobnicate"], 2, ["unrecognized arguments: --frobnicate"]),
    ],
    ids=["user-data-outside-inbox", "inbox-outside-user-folder", "bad-wait", "unknown-flag"],
)
def test_a_job_that_cannot_train_on_its_inbox_refuses_in_one_line(project, capsys, setup, args, code, needles):
    (project / "data" / "user").mkdir(parents=True)
    np.savez(project / "data" / "user" / "day1.npz", x=np.zeros((4, 64)), y=np.arange(4))
    (project / "elsewhere").mkdir()
    setup(project / "elsewhere")
    with pytest.raises(SystemExit) if args[0].startswith("-") else contextlib.nullcontext() as exit_info:
        assert retrain.main(["tracking=disabled", *args]) == code
    if exit_info is not None:
        assert exit_info.value.code == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2, err
    assert all(n in err[-1] for n in needles), err  # argparse: usage line, then the error


def test_a_mixed_inbox_names_data_user_format(project, capsys):
    Image = pytest.importorskip("PIL.Image")
    inbox = project / "data" / "user"
    (inbox / "3").mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(inbox / "3" / "a.png")
    np.savez(inbox / "day1.npz", x=np.zeros((4, 64)), y=np.arange(4))
    assert retrain.main(["tracking=disabled"]) == 1
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "data/user" in err, err
    assert "more than one kind" in err, err
    assert "data.user_format" in err, err


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


def drop_pngs(inbox: Path, per_class: int, offset: int = 0) -> dict[bytes, int]:
    """``per_class`` real digits per class as 8-bit PNGs in ``inbox/<class>/``; returns
    their pixels (bytes) -> label, as Pillow reads the files back."""
    from PIL import Image

    from pipeline.datasets import load_digits_demo

    x, y = load_digits_demo()
    for c in range(10):
        (inbox / str(c)).mkdir(parents=True, exist_ok=True)
        for i in np.flatnonzero(y == c)[offset:offset + per_class]:
            Image.fromarray(np.round(x[i, 0] * 255).astype(np.uint8)).save(inbox / str(c) / f"{i}.png")
    return {np.asarray(Image.open(f)).tobytes(): int(f.parent.name) for f in inbox.glob("*/*.png")}


def git_changes(repo: Path, env: dict) -> list[str]:
    """What git sees changed or new, the inbox aside (the user's own untracked data)."""
    out = subprocess.run(["git", "status", "--porcelain"], cwd=repo, env=env, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if not line.startswith("?? data/user/")]


def test_retrain_job_trains_on_the_inbox_and_keeps_the_workspace(tmp_path, mlflow_store):
    pytest.importorskip("PIL")
    from dvc.api import DVCFileSystem
    from mlflow import MlflowClient

    repo = project_copy(tmp_path / "clone", TINY_CONF)
    env = dvc_env(tmp_path)
    inbox = repo / "data" / "user"
    # 0. an empty inbox: nothing to do
    out = job(repo, env)
    assert "no device data in data/user (0 file(s)" in out, out
    assert "nothing to do" in out, out

    # 1. 60 labelled PNGs arrive: the candidate trains on exactly them and is promoted over the base
    pngs = drop_pngs(inbox, 6)
    assert len(pngs) == 60
    out = job(repo, {**env, "MLFLOW_TRACKING_URI": mlflow_store}, "tracking.enabled=true")
    assert "new device data in data/user (60 file(s)" in out, out
    assert "data.user_data=data/user" in out, out
    assert "retrain: promoted: holdout accuracy" in out, out
    assert "of the pretrained base" in out, out
    assert git_changes(repo, env) == []  # params.yaml, dvc.lock and the metrics files as committed
    record = json.loads((repo / "data/promoted/metrics.json").read_text())["job"]
    fs = DVCFileSystem(str(repo), rev=record["experiment_rev"])  # the experiment as DVC recorded it
    seen = {}
    for split in ("user_train", "user_holdout"):
        with fs.open(f"data/prepare/{split}.npz", "rb") as f, np.load(f) as npz:
            for xi, yi in zip(npz["x"], npz["y"]):
                seen[np.round(xi[0] * 255).astype(np.uint8).tobytes()] = int(yi)
    assert seen == pngs  # prepare's user splits hold the inbox's samples and labels, nothing else

    client = MlflowClient(tracking_uri=mlflow_store)
    in_service = client.get_model_version_by_alias("odt-personalized", "in-service")
    assert str(in_service.version) == str(record["registry_version"])
    (inbox_input,) = [d for d in client.get_run(in_service.run_id).inputs.dataset_inputs if d.dataset.name == "inbox"]
    digest = sha256sum_digest(inbox)
    assert inbox_input.dataset.digest == digest[:36]
    assert json.loads(inbox_input.dataset.profile)["sha256"] == digest
    assert {t.key: t.value for t in inbox_input.tags}["mlflow.data.context"] == "training"
    runs = client.search_runs([client.get_experiment_by_name("odt").experiment_id])
    (job_run,) = [r for r in runs if r.info.run_name == "retrain"]
    assert job_run.info.run_id == in_service.run_id == record["mlflow_run_id"]
    assert job_run.data.tags["retrain.decision"] == "promoted"
    assert job_run.data.tags["dvc.exp"] == record["id"]
    children = {r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == job_run.info.run_id}
    assert {"prepare", "train", "evaluate", "export"} <= children, sorted(children)
    assert {a.path for a in client.list_artifacts(job_run.info.run_id, "job")} >= {"job/params.yaml", "job/dvc.lock", "job/metrics.json"}

    # 2. no new device data: nothing to do
    out = job(repo, env)
    assert "no new device data in data/user (60 file(s)" in out, out
    assert "nothing to do" in out, out
    first = promoted_state(repo)

    # 3. more data, and a learning rate that wrecks the head: kept out with the reason, continued from the promoted model
    drop_pngs(inbox, 1, offset=6)
    out = job(repo, env, "optimizer.lr=5")
    assert "continuing from data/promoted/checkpoint" in out, out
    assert "retrain: kept the current model: holdout accuracy" in out
    assert "it would regress" in out
    assert "data/promoted/ unchanged" in out
    assert promoted_state(repo) == first
    assert git_changes(repo, env) == []
    out = job(repo, env, "optimizer.lr=5")  # the same data again: already tried
    assert "already tried" in out, out
    assert "--force" in out, out
    history = [json.loads(line) for line in (repo / "data/retrain/history.jsonl").read_text().splitlines()]
    assert [(h["decision"], h["inbox_files"]) for h in history] == [("promoted", 60), ("kept", 70)]

    # 3b. a damaged image: the job fails in prepare, naming the file where the user put it (not in DVC's
    # temporary copy), and its history line keeps that stage's error; the promoted model stays
    (inbox / "3" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n cut short")
    out = job(repo, env, code=1)
    (error,) = [line for line in out.splitlines() if line.startswith("prepare: error:")]
    assert error.startswith("prepare: error: data/user/3/broken.png: not a readable image"), out
    failed = json.loads((repo / "data/retrain/history.jsonl").read_text().splitlines()[-1])
    assert failed["decision"] == "failed"
    assert failed["reason"].startswith("the pipeline failed: prepare: error: data/user/3/broken.png: not a readable image"), failed
    assert promoted_state(repo) == first
    (inbox / "3" / "broken.png").unlink()

    # 4. a second job while one holds the lock exits at once with a clear message (75: try again later)
    with promotion.job_lock(repo / "data/retrain/lock"):
        out = job(repo, env, "--force", code=75)
    assert "another retrain job holds" in out, out
    assert "data/retrain/lock" in out, out
    assert f"pid {os.getpid()}" in out, out

    # 5. an interrupted job (a scheduler's SIGTERM) leaves the promoted model as it was
    drop_pngs(inbox, 1, offset=7)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.retrain"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen_lines = []
    for line in proc.stdout:
        seen_lines.append(line)
        if "Running stage" in line:
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, "".join(seen_lines) + rest
    assert "interrupted; the promoted model is unchanged" in rest
    assert promoted_state(repo) == first
    assert git_changes(repo, env) == []
    assert not [p for p in (repo / "data").iterdir() if p.name.startswith(".promoted")]
    assert not list((repo / "data/retrain").glob(".candidate-*"))
    shutil.rmtree(repo / ".dvc" / "tmp", ignore_errors=True)
