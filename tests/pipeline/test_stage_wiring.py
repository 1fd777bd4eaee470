"""A stage is its module, its dvc.yaml block and its params: these agree, one source each.
dvc.yaml's stages are pipeline.paths.STAGES in order; each runs its own module through
stage.sh; each module has a main() that runs that stage; each params key a stage lists
exists in the composed configuration; each out and metric lives in the stage's own folder."""
from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import yaml

from pipeline import config
from pipeline.paths import STAGES

ROOT = Path(__file__).resolve().parents[2]


def _stages() -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


def test_dvc_yaml_runs_exactly_the_stage_list_each_by_its_own_module():
    stages = _stages()
    assert list(stages) == list(STAGES)
    for name, block in stages.items():
        assert block["cmd"] == f"sh pipeline/stage.sh {name}", name
        assert f"pipeline/{name}.py" in block["deps"], f"{name}: its module is not a dependency"
        module = importlib.import_module(f"pipeline.{name}")
        assert f'"{name}"' in inspect.getsource(module.main), f"{name}: main() runs another stage"


def test_each_stage_reads_params_that_exist_and_writes_only_its_own_folder():
    composed = config.to_container(config.load([], root=ROOT))
    flat = config.flatten(composed)
    for name, block in _stages().items():
        for key in block.get("params", []):
            key = key if isinstance(key, str) else next(iter(key))
            assert key in composed or any(k == key or k.startswith(key + ".") for k in flat), f"{name}: params key {key!r}"
        for kind in ("outs", "metrics", "plots"):
            for entry in block.get(kind, []):
                path = entry if isinstance(entry, str) else next(iter(entry))
                assert path.startswith(f"data/{name}"), f"{name}: {kind} {path} is outside data/{name}/"
