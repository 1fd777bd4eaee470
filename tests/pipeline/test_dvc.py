"""The real thing: `dvc repro` and `dvc exp run` in a temporary git copy of the project
(a fresh clone: no outputs, no cache, no MLflow store) at test size.

One scenario, in order (each step builds on the last, and running them as separate
tests would redo the first, most expensive one): a first `dvc repro` runs every stage,
a second does nothing; a new learning rate reruns train, evaluate and export only; a
new trainable set reruns from generate; `-S optimizer.lr=3e-3 -S model=cnn` works;
every experiment shows its metrics in `dvc exp show`; typos and bad values stop with
the key named and leave the outputs in place. Torch is never imported on the way.
"""
from __future__ import annotations

import csv
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.paths import stages
from tests.pipeline.conftest import REPO, TINY_CONF, dvc_env, project_copy

pytest.importorskip("dvc")

ALL = list(stages())


def dvc(repo: Path, env: dict, *args: str, ok: bool = True) -> tuple[list[str], str]:
    """Run `dvc ARGS`; returns the stages that ran and the whole output."""
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, out
    return re.findall(r"Running stage '(\w+)'", out), out


def readme_commands(*prefixes: str) -> list[list[str]]:
    """The README's command lines starting with one of ``prefixes`` (comments cut), as argv."""
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    found = [shlex.split(line.split(" # ")[0]) for line in lines if line.startswith(prefixes)]
    assert len(found) >= len(prefixes), prefixes
    return found


def test_dvc_repro_caching_and_overrides_in_a_fresh_clone(tmp_path):
    repo = project_copy(tmp_path / "clone", TINY_CONF)
    env = dvc_env(tmp_path)

    ran, out = dvc(repo, env, "repro")
    assert [s for s in ran if s != "federate"] == ALL[:-1], out
    assert ran.index("federate") > ran.index("generate"), out
    assert "user holdout: base" in out  # evaluate's one-line summary
    for path in ("data/export/inference.onnx", "data/export/model.odtdiff", "data/train/checkpoint", "data/evaluate/metrics.json",
                 "data/train/curve.csv", "data/generate/training_model.onnx", "data/pretrain/base.onnx",
                 "data/federate/checkpoint", "data/federate/inference.onnx", "data/federate/rounds.csv", "data/federate/metrics.json"):
        assert (repo / path).is_file(), path
    ran, out = dvc(repo, env, "repro")
    assert ran == [], out
    assert out.count("didn't change, skipping") == len(ALL), out

    # metrics and plots as DVC shows them
    _, shown = dvc(repo, {**env, "COLUMNS": "400"}, "metrics", "show")
    assert "personalization_gain" in shown
    assert "data/evaluate/headline.json" in shown
    assert max(len(row) for row in shown.splitlines()) <= 200, shown  # the headline metrics only
    _, plots = dvc(repo, env, "plots", "show", "--json")
    for name in ("data/train/curve.csv", "data/evaluate/confusion_personalized.json", "data/federate/rounds.csv"):
        assert name in plots, plots[:500]
    # what a person commits: the lock, DVC's .gitignore entries and the small metric files, never the cached outputs
    subprocess.run(["git", "add", "-A"], cwd=repo, env=env, check=True)
    staged = subprocess.run(["git", "diff", "--cached", "--name-only"], cwd=repo, env=env, capture_output=True, text=True).stdout.split()
    assert "dvc.lock" in staged
    assert "data/evaluate/metrics.json" in staged
    assert not [p for p in staged if p.endswith((".onnx", ".npz", "checkpoint", ".odtdiff"))], staged
    subprocess.run(["git", "commit", "-q", "-m", "baseline"], cwd=repo, env=env, check=True)

    # a stage run by hand changes its outputs; the README's command puts back what dvc.lock records
    hand = subprocess.run([sys.executable, "-m", "pipeline.train", "optimizer.lr=1e-2"], cwd=repo, env=env, capture_output=True, text=True)
    assert hand.returncode == 0, hand.stderr
    assert "data/train/checkpoint" in dvc(repo, env, "status")[1]
    restore = re.search(r"`git checkout -- (data/train) && dvc (checkout --force train)`", (REPO / "README.md").read_text(encoding="utf-8"))
    assert restore, "the README's restore command for a stage run by hand"
    subprocess.run(["git", "checkout", "--", restore[1]], cwd=repo, env=env, check=True)
    dvc(repo, env, *restore[2].split())
    assert "Data and pipelines are up to date" in dvc(repo, env, "status")[1]
    assert not subprocess.run(["git", "status", "--porcelain"], cwd=repo, env=env, capture_output=True, text=True).stdout

    # the learning rate is a runtime setting: train, evaluate, export only
    ran, out = dvc(repo, env, "exp", "run", "-n", "lr", "-S", "optimizer.lr=1e-2")
    assert ran == ["train", "evaluate", "export"], out
    # what is trainable is baked into the artifacts: from generate on
    ran, out = dvc(repo, env, "exp", "run", "-n", "all", "-S", "trainable=all")
    assert sorted(ran) == sorted(["generate", "train", "evaluate", "export", "federate"]), out
    assert ran[0] == "generate", out
    # a model group switch with a value, as the issue writes it
    ran, out = dvc(repo, env, "exp", "run", "-n", "cnn", "-S", "optimizer.lr=3e-3", "-S", "model=cnn")
    assert sorted(ran) == sorted(ALL[1:]), out
    _, table = dvc(repo, env, "exp", "show", "--csv")
    rows = {r["Experiment"]: r for r in csv.DictReader(io.StringIO(table)) if r.get("Experiment")}
    assert {"lr", "all", "cnn"} <= set(rows), table
    for name in ("lr", "all", "cnn"):  # each experiment's commit holds its metrics
        assert float(rows[name]["personalization_gain"]) == float(rows[name]["personalization_gain"]), rows[name]
    assert rows["lr"]["optimizer.lr"] == "0.01"
    assert rows["cnn"]["model.arch"] == "cnn"
    # the README's readable view: the learning rate beside the holdout accuracy at a terminal's width
    env_width = {**env, "COLUMNS": "160"}
    _, view = dvc(repo, env_width, *readme_commands("dvc exp show --drop")[0][1:], "--no-pager")
    assert max(len(row) for row in view.splitlines()) <= 160, view
    assert "…" not in view, view
    header = next(row for row in view.splitlines() if "Experiment" in row).split()
    assert "optimizer.lr" in header, view
    assert "user_holdout.personalized.accuracy" in header, view
    assert all(name in view for name in ("lr", "all", "cnn")), view

    # a typo and a wrong type stop before any work, naming the key; outputs stay
    before = {p: (repo / p).read_bytes() for p in ("data/convert/base.onnx", "data/train/checkpoint")}
    _, out = dvc(repo, env, "exp", "run", "-S", "optimizer.lrr=1", ok=False)
    assert "optimizer.lrr" in out, out
    ran, out = dvc(repo, env, "exp", "run", "-S", "optimizer.lr=abc", ok=False)  # back to the mlp: convert is first to run
    assert ran == ["convert"], out
    assert "convert: error: optimizer.lr='abc': expected a number" in out, out
    assert {p: (repo / p).read_bytes() for p in before} == before  # persist: DVC left them, the stage never replaced them
    # a missing data file: prepare names it and the fix; every output is still there
    ran, out = dvc(repo, env, "exp", "run", "-S", "data.user_data=data/user/mine.npz", ok=False)
    assert ran == ["prepare"], out
    assert "data/user/mine.npz" in out, out
    assert "data.user_data=null" in out, out
    assert (repo / "data/prepare/user_train.npz").is_file()
    assert (repo / "data/export/inference.onnx").is_file()

    assert not (tmp_path / "torch-imported").exists(), (tmp_path / "torch-imported").read_text()
