"""`dvc exp run -S trainable=lora` as a user runs it in a fresh clone (a temporary git copy of the
project at test size: no outputs, no cache, no MLflow store), with DVC's Hydra composition
choosing conf/trainable/lora.yaml.

Oracle: onnxruntime, outside the pipeline: the exported adapter file, loaded with
onnxruntime.LoraAdapter and activated per run on the adapter base, gives the merged
inference model's outputs on the user's holdout, and the base alone gives the pretrained
model's; the trainable set DVC's params recorded is the adapters.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from pipeline.export import ADAPTER_BASE, ADAPTER_FILE
from tests.pipeline.conftest import TINY_CONF, dvc_env, project_copy
from tests.pipeline.test_dvc import dvc

ort = pytest.importorskip("onnxruntime", reason="the adapter file's oracle is onnxruntime")
pytest.importorskip("dvc")


def _session(path):
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the adapter base's inputs are overridable initializers: that is the point
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@pytest.mark.slow
def test_dvc_exp_run_trainable_lora_in_a_fresh_clone(tmp_path):
    repo = project_copy(tmp_path / "clone", TINY_CONF)
    env = dvc_env(tmp_path)
    ran, out = dvc(repo, env, "exp", "run", "-n", "lora", "-S", "trainable=lora")
    assert {"generate", "train", "export"} <= set(ran), out
    params = yaml.safe_load((repo / "params.yaml").read_text(encoding="utf-8"))
    assert params["trainable"]["select"] == "lora", "DVC's Hydra composition chose conf/trainable/lora.yaml"
    summary = json.loads((repo / "data/generate/artifacts.json").read_text(encoding="utf-8"))
    assert summary["trainable"], out
    assert all(".lora_" in name for name in summary["trainable"]), summary["trainable"]

    export = repo / "data/export"
    holdout = np.load(repo / "data/prepare/user_holdout.npz")["x"]
    adapter = ort.LoraAdapter()
    adapter.Load(str(export / ADAPTER_FILE))
    run = ort.RunOptions()
    run.add_active_adapter(adapter)
    server = _session(export / ADAPTER_BASE)
    (name,) = [i.name for i in server.get_inputs() if i.name not in {n for n in summary["trainable"]}]
    merged = _session(export / "inference.onnx").run(None, {name: holdout})[0]
    with_adapter = server.run(None, {name: holdout}, run)[0]
    base = server.run(None, {name: holdout})[0]
    pretrained = _session(repo / "data/pretrain/base.onnx").run(None, {name: holdout})[0]
    scale = float(np.abs(merged).max())
    np.testing.assert_allclose(with_adapter, merged, rtol=1e-4, atol=1e-5 * scale)  # the merge folds the adapters in exactly (float base)
    np.testing.assert_allclose(base, pretrained, rtol=1e-4, atol=1e-5 * scale)  # adapter inputs default to zero: the base model
    assert np.abs(merged - pretrained).max() > 1e-4 * scale, "the adapters trained: the merged model is not the pretrained one"
    _, table = dvc(repo, env, "exp", "show", "--csv")
    assert "lora" in table, table
    assert not (tmp_path / "torch-imported").exists()
