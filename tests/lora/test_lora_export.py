"""LoRA exports on onnxruntime: the merged model, and the base model with onnxruntime's adapter file.

Oracles: onnxruntime runs what we write (its own inference build, its own LoraAdapter
loading); our engine's eval step of the trained artifacts is what both must compute.
Also: the first forward with adapters equals the base model (B = 0), the model difference
carries the adapters only, and bad options are typed errors naming the glob or weight.
"""
from __future__ import annotations

import numpy as np
import pytest

from odt_ops import InferenceSession, artifacts, load_model
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.errors import LoraError
from odt_ops.export import model_diff, save_diff
from odt_ops.lora import LoraConfig, export_adapter, export_adapter_base, export_merged
from tests.lora.torch_models import data, export, make

ort = pytest.importorskip("onnxruntime", reason="the export oracle is onnxruntime (pip install -e '.[dev]')")


def _session(path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _trained(kind: str, targets, tmp_path, steps: int = 5):
    x, y = data(kind, 64)
    base = export(make(kind), x[:2])
    paths = artifacts.generate_artifacts(base, loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                         artifact_directory=tmp_path, lora=LoraConfig(rank=2, alpha=4, targets=targets, dropout=0.1))
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    module = Module(paths["training_model"], state, paths["eval_model"])
    opt = Optimizer(paths["optimizer_model"], module)
    opt.set_learning_rate(0.05)
    module.train()
    for i in range(steps):
        module.lazy_reset_grad()
        module(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])
        opt.step()
    module.eval()
    return base, paths, state, module, x, y


@pytest.mark.parametrize("kind,targets", [("transformer", ["MatMul", "Gemm"]), ("cnn", ["Conv", "fc.weight"])])
def test_merged_and_adapter_exports_run_on_onnxruntime_as_our_engine_does(kind, targets, tmp_path):
    base, paths, state, module, x, y = _trained(kind, targets, tmp_path)
    merged_path, base_path, adapter_path = tmp_path / "merged.onnx", tmp_path / "base.onnx", tmp_path / "user.onnx_adapter"
    module.export_model_for_inferencing(tmp_path / "adapted.onnx")
    engine = _session(tmp_path / "adapted.onnx").run(None, {"x": x})[0]
    np.testing.assert_allclose(InferenceSession(str(tmp_path / "adapted.onnx")).run(None, {"x": x})[0], engine, rtol=1e-5, atol=1e-5)

    merged = export_merged(paths["eval_model"], state.checkpoint, merged_path)
    normalized = load_model(base).graph.node
    assert sorted(n.op_type for n in merged.graph.node) == sorted(n.op_type for n in normalized), "merging leaves the base graph"
    np.testing.assert_allclose(_session(merged_path).run(None, {"x": x})[0], engine, rtol=1e-4, atol=1e-5)

    export_adapter_base(paths["eval_model"], state.checkpoint, base_path)
    export_adapter(paths["eval_model"], state.checkpoint, adapter_path)
    server = _session(base_path)
    reference = ort.InferenceSession(base.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(server.run(None, {"x": x})[0], reference, rtol=1e-5, atol=1e-6,
                               err_msg="without an adapter the base model computes the original model")
    adapter = ort.LoraAdapter()
    adapter.Load(str(adapter_path))
    options = ort.RunOptions()
    options.add_active_adapter(adapter)
    np.testing.assert_allclose(server.run(None, {"x": x}, options)[0], engine, rtol=1e-4, atol=1e-5,
                               err_msg="the base model with the user's adapter computes the trained model")
    assert np.abs(engine - reference).max() > 1e-3, "training moved the model, so the comparisons above mean something"


def test_first_forward_equals_the_base_and_the_difference_carries_adapters_only(tmp_path):
    base, paths, state, module, x, y = _trained("transformer", ["MatMul", "Gemm"], tmp_path, steps=0)
    module.export_model_for_inferencing(tmp_path / "adapted.onnx")
    reference = ort.InferenceSession(base.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(_session(tmp_path / "adapted.onnx").run(None, {"x": x})[0], reference, rtol=1e-5, atol=1e-6)
    diff = model_diff(paths["checkpoint"], state)
    assert all(".lora_" in n for n in diff.deltas)
    assert len(diff.deltas) == 16
    save_diff(diff, tmp_path / "lora.odtdiff")
    n_adapter = sum(d.size for d in diff.deltas.values())
    n_model = sum(int(np.prod(t.dims)) for t in base.graph.initializer)
    assert n_adapter < n_model


@pytest.mark.parametrize("config,message", [
    (dict(targets=["*attention*"]), "'*attention*' matches no weight or node"),
    (dict(rank=17, targets=["block.q.weight"]), "rank 17 is larger than weight 'block.q.weight'"),
    (dict(targets=["Conv"]), r"targets \[.Conv.\] select no Conv node"),
])
def test_bad_targets_are_typed_errors_naming_the_glob_or_weight(config, message, tmp_path):
    x, _ = data("transformer", 2)
    with pytest.raises(LoraError, match=message.replace("*", r"\*").replace("(", r"\(")):
        artifacts.generate_artifacts(export(make("transformer"), x), loss=artifacts.LossType.CrossEntropyLoss,
                                     artifact_directory=tmp_path, lora=LoraConfig(**config))
    assert not list(tmp_path.iterdir()), "nothing is written"


@pytest.mark.parametrize("kwargs", [dict(rank=0), dict(alpha=0), dict(dropout=1.0), dict(targets="MatMul"), dict(targets=[])])
def test_bad_options_are_typed_errors(kwargs):
    with pytest.raises(LoraError, match="LoraConfig"):
        LoraConfig(**kwargs)


def test_onnxblock_users_build_on_the_adapted_model(tmp_path):
    """The onnxblock path: add_adapters gives the adapted model and the names to mark trainable;
    the training graph it builds computes the same adapter gradients as generate_artifacts(lora=...)."""
    from odt_ops import onnxblock
    from odt_ops.lora import add_adapters

    class Training(onnxblock.TrainingBlock):
        def __init__(self):
            super().__init__()
            self.loss = onnxblock.loss.CrossEntropyLoss()

        def build(self, output_name):
            return self.loss(output_name)

    x, y = data("cnn", 8)
    base = export(make("cnn"), x[:2])
    config = LoraConfig(rank=2, alpha=4, targets=["Conv", "Gemm"])
    adapted, adapters = add_adapters(load_model(base), config)
    block = Training()
    names = [n for a in adapters for n in (a.A, a.B)]
    for name in names:
        block.requires_grad(name)
    with onnxblock.base(adapted.proto):
        block(adapted.graph.output[0].name)
    training, _ = block.to_model_proto()
    paths = artifacts.generate_artifacts(base, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path, lora=config)
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    module = Module(paths["training_model"], state, paths["eval_model"])
    module.train()
    module(x, y)
    feeds = {training.graph.input[0].name: x, training.graph.input[1].name: y}
    feeds.update({n: state.parameters[n].data for n in names})
    feeds.update({i.name: np.zeros([d.dim_value for d in i.type.tensor_type.shape.dim], np.float32)
                  for i in training.graph.input if i.name.endswith("_grad.accumulation.buffer")})
    feeds.update({i.name: np.array([True]) for i in training.graph.input if i.name == "lazy_reset_grad"})
    outs = dict(zip([o.name for o in training.graph.output], ort.InferenceSession(training.SerializeToString(),
                                                                                    providers=["CPUExecutionProvider"]).run(None, feeds)))
    for name in names:
        got = next(v for k, v in outs.items() if k.startswith(name) and "grad" in k)
        np.testing.assert_allclose(got, state.parameters[name].grad, rtol=1e-4, atol=1e-7, err_msg=name)
