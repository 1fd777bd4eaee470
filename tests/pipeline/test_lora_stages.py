"""trainable=lora through the real stages at test size: generate adds adapters and trains
only them, train leaves the base weights as they were, export writes the merged model and
onnxruntime's adapter file (checked on onnxruntime inside the stage), and the model
difference carries the adapters only."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from odt_ops.checkpoint import load_checkpoint
from odt_ops.export import load_diff
from pipeline import export, generate
from pipeline.errors import ConfigError
from tests.pipeline.conftest import TINY_RUN, copy_outputs, load_cfg, run_stages

ort = pytest.importorskip("onnxruntime", reason="export's adapter check runs on onnxruntime")

LORA = [*TINY_RUN, "trainable=lora"]


def test_lora_stages_train_adapters_only_and_export_merged_and_adapter(tiny_run, tmp_path):
    paths = copy_outputs(tiny_run, tmp_path, stages=("prepare", "convert", "pretrain"))
    cfg = load_cfg(*LORA)
    metrics = run_stages(cfg, paths, ("generate", "train", "evaluate", "export"))
    summary = json.loads((paths.out("generate") / "artifacts.json").read_text())
    assert summary["trainable"] == ["fc1.lora_A", "fc1.lora_B", "head.lora_A", "head.lora_B"]
    assert summary["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["Gemm", "Conv"]}
    base = load_checkpoint(paths.out("generate") / "checkpoint")
    trained = load_checkpoint(paths.out("train") / "checkpoint")
    for name in ("fc1.weight", "fc1.bias", "head.weight", "head.bias"):  # frozen, in the checkpoint: the whole model
        np.testing.assert_array_equal(trained.parameters[name], base.parameters[name])
    assert np.abs(trained.parameters["head.lora_B"]).max() > 0  # the adapters moved
    assert sorted(trained.optimizer.states) == summary["trainable"]  # optimizer state for the adapters only

    exported = onnx.load(str(paths.inference_model))
    pretrained = onnx.load(str(paths.pretrained_model))
    assert [n.op_type for n in exported.graph.node] == [n.op_type for n in pretrained.graph.node], "merged: the base graph"
    m = metrics["export"]
    assert m["adapter.onnxruntime_max_abs_diff"] < cfg.export.check_atol
    assert m["onnxruntime.checked"] == 1
    assert (paths.out("export") / export.ADAPTER_FILE).is_file()
    assert (paths.out("export") / export.ADAPTER_BASE).is_file()
    diff = load_diff(paths.model_diff)
    assert sorted(diff.deltas) == summary["trainable"]
    full = sum(int(np.prod(t.dims)) for t in pretrained.graph.initializer)
    assert m["diff.parameters"] == sum(d.size for d in diff.deltas.values()) < full / 4


def test_lora_bad_target_names_the_glob(tiny_run, tmp_path):
    from odt_ops.errors import LoraError

    paths = copy_outputs(tiny_run, tmp_path, stages=("pretrain",))
    with pytest.raises(LoraError, match=r"'attn\*' matches no weight or node"):
        generate.run(load_cfg(*LORA, "trainable.lora.targets=[attn*]"), paths)
    with pytest.raises(ConfigError, match="trainable.lora.rank"):
        load_cfg(*LORA, "trainable.lora.rank=0")
    with pytest.raises(ConfigError, match="trainable.lora"):
        load_cfg(*TINY_RUN, "trainable.select=lora")


def test_qat_stages_quantize_train_master_weights_and_export_qdq(tiny_run, tmp_path):
    paths = copy_outputs(tiny_run, tmp_path, stages=("prepare", "convert", "pretrain"))
    cfg = load_cfg(*TINY_RUN, "trainable=qat")
    metrics = run_stages(cfg, paths, ("generate", "train", "evaluate", "export"))
    summary = json.loads((paths.out("generate") / "artifacts.json").read_text())
    assert summary["qat"]
    assert sorted(summary["trainable"]) == ["fc1.weight", "head.weight"]  # float masters of the int8 weights
    assert metrics["generate"]["n_trained_layers"] == 2
    exported = onnx.load(str(paths.inference_model))
    ops = [n.op_type for n in exported.graph.node]
    assert "QuantizeLinear" in ops
    assert "DequantizeLinear" in ops
    int8 = {t.name for t in exported.graph.initializer if t.data_type == onnx.TensorProto.INT8}
    assert {"fc1.weight_quantized", "head.weight_quantized"} <= int8
    assert metrics["export"]["onnxruntime.checked"] == 1
    assert metrics["export"]["onnxruntime.max_abs_diff"] <= cfg.export.check_atol
    assert metrics["train"]["last_epoch_loss"] < metrics["train"]["first_epoch_loss"]
