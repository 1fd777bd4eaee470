"""A stage is its dvc.yaml block, its module and its conf/ group, and these agree.

dvc.yaml's stage list is the only one (pipeline.paths.stages reads it); each stage runs
its own module through stage.sh; each module has main() running that stage and one
``run(cfg, paths, tracker)``; the config sections the modules declare are exactly the
composed configuration's; each params key a stage lists exists; each out and metric lives
in the stage's own folder."""
from __future__ import annotations

import importlib
import inspect
from dataclasses import fields
from pathlib import Path

import yaml

from pipeline import config
from pipeline.config.schema import SECTION_OWNERS, config_class
from pipeline.io import flatten
from pipeline.paths import Paths, stages

ROOT = Path(__file__).resolve().parents[2]


def _dvc_stages() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


def test_dvc_yaml_runs_exactly_the_stage_list_each_by_its_own_module():
    blocks = _dvc_stages()
    assert stages() == tuple(blocks)
    modules = sorted(p.stem for p in (ROOT / "pipeline").glob("*.py") if "def run(cfg, paths" in p.read_text(encoding="utf-8"))
    assert modules == sorted(blocks), "a module with a stage's run() but no dvc.yaml block, or the reverse"
    for name, block in blocks.items():
        assert block["cmd"] == f"sh pipeline/stage.sh {name}", name
        assert f"pipeline/{name}.py" in block["deps"], f"{name}: its module is not a dependency"
        module = importlib.import_module(f"pipeline.{name}")
        assert f'"{name}"' in inspect.getsource(module.main), f"{name}: main() runs another stage"
        assert list(inspect.signature(module.run).parameters) == ["cfg", "paths", "tracker"], name


def test_the_configuration_is_the_sections_the_stage_modules_declare():
    """No section without an owner module, none declared twice (config_class raises), and
    each conf/ group is a section, or a choice inside one."""
    declared = {"seed"}
    for name in (*stages(), *SECTION_OWNERS):
        declared |= set(getattr(importlib.import_module(f"pipeline.{name}"), "CONFIG", {}))
    composed = config.compose(["tracking=disabled"], root=ROOT)
    assert declared == {f.name for f in fields(config_class())} == set(composed)
    assert set(config.group_options(ROOT)) <= declared


def test_each_stage_reads_params_that_exist_and_writes_only_its_own_folder():
    composed = config.to_container(config.load([], root=ROOT))
    flat = flatten(composed)
    for name, block in _dvc_stages().items():
        for key in block.get("params", []):
            key = key if isinstance(key, str) else next(iter(key))
            assert key in composed or any(k == key or k.startswith(key + ".") for k in flat), f"{name}: params key {key!r}"
        for kind in ("outs", "metrics", "plots"):
            for entry in block.get(kind, []):
                path = entry if isinstance(entry, str) else next(iter(entry))
                assert path.startswith(f"data/{name}"), f"{name}: {kind} {path} is outside data/{name}/"


def test_outputs_other_stages_read_are_outputs_dvc_tracks():
    """Each output named in Paths (what readers use) is, or sits in, an out of the stage that writes it."""
    paths = Paths(ROOT)
    tracked = {next(iter(e)) if isinstance(e, dict) else e for b in _dvc_stages().values() for kind in ("outs", "metrics")
               for e in b.get(kind, [])}
    named = [paths.base_model, paths.pretrained_model, paths.trained_checkpoint, paths.inference_model, paths.model_diff,
             paths.federated_model, *paths.artifacts.required(), paths.artifacts.nominal_checkpoint,
             *(paths.metrics(s) for s in ("pretrain", "train", "evaluate", "export", "federate"))]
    for path in named:
        rel = path.relative_to(ROOT).as_posix()
        assert any(rel == t or rel.startswith(t + "/") for t in tracked), rel


def test_dvc_metrics_show_fits_a_terminal(tmp_path):
    """`dvc metrics show` (DVC's own rendering) of the committed metrics: each stage's
    headline.json, a few columns, under 200 characters wide; the detail stays in metrics.json."""
    import shutil
    import subprocess
    import sys

    import pytest

    from pipeline.stage import write_headline

    pytest.importorskip("dvc")
    blocks = _dvc_stages()
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True)
    shown_keys = set()
    for name, block in blocks.items():
        for entry in block.get("metrics", []):
            path = next(iter(entry)) if isinstance(entry, dict) else entry
            headline = importlib.import_module(f"pipeline.{name}").HEADLINE
            assert path == f"data/{name}/headline.json", name
            (tmp_path / "data" / name).mkdir(parents=True)
            shutil.copy(ROOT / "data" / name / "metrics.json", tmp_path / "data" / name / "metrics.json")  # the committed detail
            write_headline(tmp_path / "data" / name, headline)
            shown_keys |= set(headline)
    out = subprocess.run([sys.executable, "-m", "dvc", "metrics", "show"], cwd=tmp_path, capture_output=True, text=True,
                         env={**__import__("os").environ, "COLUMNS": "400", "DVC_NO_ANALYTICS": "1"}, check=True).stdout
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 200, out
    header = lines[0].split()
    assert header[0] == "Path", out
    assert set(header[1:]) == shown_keys, out
    assert len(lines) == 1 + sum(1 for b in blocks.values() if b.get("metrics")), out
    assert "optimizer" not in out
    assert "onnxruntime" not in out  # export's checks: metrics.json and MLflow only
