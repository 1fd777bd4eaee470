"""export: what leaves the device.

- ``inference.onnx``: the personalized model as a plain forward ONNX model
  (Module.export_model_for_inferencing: the eval graph without loss and labels, the
  trained weights baked in), written at ``export.ir_version``. It is checked on the
  user's holdout and the global test set: odt_ops' InferenceSession must equal the
  Module's eval step, and onnxruntime (when installed and
  ``export.check_onnxruntime``) must agree with the engine within ``export.check_atol``.
- ``model.odtdiff``: the model difference for federated learning
  (odt_ops.export.model_diff: trained minus pretrained per trainable parameter, the
  base's hash, the number of examples and steps behind it), checked by applying it
  back to the base.
- ``web/``: the web bundle (odt_ops.web_bundle: the three models and the base checkpoint's
  tensors as a JSON manifest and one binary, with the user's train and holdout samples), what
  odt-web trains in a browser tab.
- with ``trainable=lora``: ``inference.onnx`` is the merged model (every adapter folded
  into its weight: the base graph, new weights), and beside it ``adapter.onnx_adapter``
  (the adapter alone, onnxruntime's adapter file) with ``adapter_base.onnx`` (the base
  model whose adapter inputs default to zero), both logged to MLflow beside the model;
  onnxruntime running the base with the adapter must equal the merged model.
- with ``trainable=qat``: ``inference.onnx`` is the re-quantized int8 QDQ model (the trained
  master weights quantized with the model's scales), checked on onnxruntime as written.
- ``metrics.json``: the checks' numbers and the files' sizes.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

import numpy as np

import odt_ops
from odt_ops.api import CheckpointState, Module
from odt_ops.checkpoint import load_checkpoint
from odt_ops.export import apply_diff, load_diff, model_diff, save_diff
from odt_ops.lora import adapter_arrays, export_adapter, export_adapter_base, export_merged
from odt_ops.lora.rewrite import METADATA_KEY as LORA_KEY
from odt_ops.quant.export import export_quantized
from odt_ops.quant.qat import METADATA_KEY as QAT_KEY
from odt_ops.web_bundle import write_web_bundle
from pipeline import inference, inputs, loop, scoring
from pipeline.config import MISSING, Section
from pipeline.errors import PipelineError
from pipeline.io import nest, write_json
from pipeline.paths import Paths
from pipeline.tracking import NO_TRACKING, NullRun

# headline.json (dvc metrics show, dvc exp show): the size of the model that ships
HEADLINE = {"model_bytes": "inference_model_bytes"}


@dataclass
class ExportConfig(Section):
    ir_version: int = MISSING
    check_onnxruntime: bool = MISSING
    check_atol: float = MISSING

    def check(self) -> None:
        self.need(10 <= self.ir_version <= 13, "ir_version", "an integer in [10, 13] (opset 21 models need IR >= 10; onnxruntime loads <= 13)")
        self.need(self.check_atol > 0, "check_atol", "a number > 0")


CONFIG = {"export": ExportConfig}
ADAPTER_FILE = "adapter.onnx_adapter"  # trainable=lora: the user's adapter, onnxruntime's adapter file
ADAPTER_BASE = "adapter_base.onnx"  # the base model it plugs into (adapter inputs default to zero)


class ExportCheckError(PipelineError):
    """The exported model does not compute what the engine computes."""


def run(cfg, paths: Paths, tracker: NullRun = NO_TRACKING) -> dict:
    gen = inputs.generated(paths)
    ckpt = inputs.upstream(paths.trained_checkpoint, "train", paths)
    state = CheckpointState.load_checkpoint(ckpt)
    module = Module(gen.training_model, state, gen.eval_model)
    target = paths.inference_model
    lora, qat = _has_metadata(gen.eval_model, LORA_KEY), _has_metadata(gen.eval_model, QAT_KEY)
    if lora:
        proto = _with_ir_version(export_merged(gen.eval_model, state.checkpoint, target), target, cfg.export.ir_version)
    elif qat:
        proto = _with_ir_version(export_quantized(gen.eval_model, state.checkpoint, target), target, cfg.export.ir_version)
    else:
        proto = inference.export_inference(module, target, cfg.export.ir_version)

    splits = [inputs.load_split(paths, name) for name in ("user_holdout", "global_test")]
    x = np.concatenate([s.x for s in splits])
    y = np.concatenate([s.y for s in splits])
    encode = inputs.target_encoder(gen.eval_model)
    module.eval()
    reference = scoring.batched(lambda xb, tb: module(xb, tb)[1], x, encode(y), 512)
    engine = odt_ops.InferenceSession(target)
    (inp,) = engine.input_names()
    ours = engine.run(None, {inp: x})[0]
    atol = cfg.export.check_atol
    vs_module = float(np.max(np.abs(ours - reference)))
    if vs_module > atol:
        raise ExportCheckError(f"{paths.show(target)}: odt_ops runs the exported model {vs_module:.3g} away from the Module's eval step "
                               f"(export.check_atol={atol:g}); a bug in the export, please report it")
    metrics: dict = {"inference_model_bytes": target.stat().st_size, "ir_version": proto.ir_version,
                     "engine.max_abs_diff_vs_module": vs_module, "check_samples": len(x)}
    metrics.update(_check_onnxruntime(cfg, paths, target, inp, x, ours, as_written=qat))
    if lora:
        metrics.update(_export_adapter(cfg, paths, gen, state, inp, x, ours))

    n_train = len(inputs.load_split(paths, "user_train"))
    steps = int(state.properties.get(loop.TOTAL_STEPS, 0))
    diff = model_diff(gen.checkpoint, state, num_examples=n_train, num_steps=steps,
                      metadata={"producer": "odt pipeline"})
    diff_path = paths.model_diff
    save_diff(diff, diff_path)
    restored = apply_diff(load_checkpoint(gen.checkpoint), load_diff(diff_path))
    trained = state.checkpoint.parameters
    roundtrip = max(float(np.max(np.abs(restored.parameters[n] - trained[n]))) for n in diff.deltas)
    if roundtrip > 1e-5:
        raise ExportCheckError(f"{paths.show(diff_path)}: base + difference is {roundtrip:.3g} away from the trained weights; please report it")
    metrics.update({
        "diff.bytes": diff_path.stat().st_size,
        "diff.parameters": int(sum(d.size for d in diff.deltas.values())),
        "diff.l2_norm": float(np.sqrt(sum(float(np.sum(d.astype(np.float64) ** 2)) for d in diff.deltas.values()))),
        "diff.roundtrip_max_abs_error": roundtrip,
        "diff.examples": n_train,
        "diff.steps": steps,
    })
    # the same artifacts as a browser tab trains them (odt_ops.web_bundle; README "Train in a browser")
    web = write_web_bundle(gen.directory, paths.out("export") / "web", samples={"train": paths.split("user_train"), "holdout": paths.split("user_holdout")})
    metrics["web_bundle.bytes"] = web["binary"]["bytes"]
    write_json(paths.metrics("export"), nest(metrics))
    return metrics


def _check_onnxruntime(cfg, paths: Paths, target, inp: str, x: np.ndarray, ours: np.ndarray, *, as_written: bool = False) -> dict:
    """``as_written``: onnxruntime runs the Quantize/DequantizeLinear nodes as the graph says (its
    optimizer would swap in integer kernels that round differently), so the check stays exact."""
    if not cfg.export.check_onnxruntime:
        return {"onnxruntime.checked": 0}
    try:
        import onnxruntime
    except ImportError:
        print("export: onnxruntime is not installed; the exported model was checked with odt_ops only", file=sys.stderr)
        return {"onnxruntime.checked": 0}
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    if as_written:
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = onnxruntime.InferenceSession(str(target), options, providers=["CPUExecutionProvider"])
    theirs = sess.run(None, {inp: x})[0]
    diff = float(np.max(np.abs(theirs - ours)))
    if diff > cfg.export.check_atol:
        raise ExportCheckError(f"{paths.show(target)}: onnxruntime {onnxruntime.__version__} and odt_ops differ by {diff:.3g} on the "
                               f"logits (export.check_atol={cfg.export.check_atol:g})")
    return {"onnxruntime.checked": 1, "onnxruntime.max_abs_diff": diff,
            "onnxruntime.argmax_agreement": float(np.mean(theirs.argmax(axis=1) == ours.argmax(axis=1)))}


def _has_metadata(eval_model, key: str) -> bool:
    import onnx

    return key in {p.key for p in onnx.load(str(eval_model), load_external_data=False).metadata_props}


def _with_ir_version(proto, target, ir_version: int):
    import onnx

    from pipeline.io import atomic_write_bytes

    if proto.ir_version != ir_version:
        proto.ir_version = ir_version
        onnx.checker.check_model(proto, full_check=True)
        atomic_write_bytes(target, proto.SerializeToString())
    return proto


def _export_adapter(cfg, paths: Paths, gen, state, inp: str, x: np.ndarray, merged: np.ndarray) -> dict:
    """The adapter alone (onnxruntime's adapter file) and the base model it plugs into; on
    onnxruntime the base with the adapter must compute what the merged model computes."""
    base, adapter = paths.out("export") / ADAPTER_BASE, paths.out("export") / ADAPTER_FILE
    _with_ir_version(export_adapter_base(gen.eval_model, state.checkpoint, base), base, cfg.export.ir_version)
    export_adapter(gen.eval_model, state.checkpoint, adapter)
    metrics = {"adapter.bytes": adapter.stat().st_size, "adapter.base_bytes": base.stat().st_size,
               "adapter.parameters": int(sum(a.size for a in adapter_arrays(gen.eval_model, state.checkpoint).values()))}
    if not cfg.export.check_onnxruntime:
        return metrics
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(str(base), options, providers=["CPUExecutionProvider"])
    loaded = onnxruntime.LoraAdapter()
    loaded.Load(str(adapter))
    run_options = onnxruntime.RunOptions()
    run_options.add_active_adapter(loaded)
    theirs = session.run(None, {inp: x}, run_options)[0]
    diff = float(np.max(np.abs(theirs - merged)))
    if diff > cfg.export.check_atol:
        raise ExportCheckError(f"{paths.show(adapter)}: onnxruntime running {paths.show(base)} with this adapter is {diff:.3g} away "
                               f"from the merged model (export.check_atol={cfg.export.check_atol:g}); please report it")
    return {**metrics, "adapter.onnxruntime_max_abs_diff": diff}


def after(cfg, paths: Paths, tracker) -> None:
    """The inference model as an MLflow model (onnx flavor, signature from an input example
    of the user's holdout), and params.yaml and dvc.lock (as DVC has written it so far:
    every stage before this one) on the pipeline run and this one."""
    example = inputs.load_split(paths, "user_holdout").x[:2]
    tracker.log_onnx_model(paths.inference_model, example)
    for name in (ADAPTER_FILE, ADAPTER_BASE):  # trainable=lora: the adapter and its base, beside the model
        if (paths.out("export") / name).is_file():
            tracker.log_artifact(paths.out("export") / name, "lora")
    for name in ("params.yaml", "dvc.lock"):
        path = paths.root / name
        if path.is_file():
            tracker.log_artifact(path, "pipeline")
            tracker.log_parent_artifact(path)


def main(argv=None) -> int:
    from pipeline.stage import main as stage_main

    return stage_main("export", run, argv, after=after,
                      datasets={"user_holdout": "evaluation", "global_test": "evaluation"}, headline=HEADLINE)


if __name__ == "__main__":  # run the imported pipeline.<module>, whose classes the configuration holds (pipeline/stage.py)
    sys.exit(importlib.import_module(__spec__.name).main())
