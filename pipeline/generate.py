"""generate: the training artifacts for the device, from the pretrained model.

What is trainable comes from the ``trainable`` section (pipeline/selection.py: the
whole model, the last N layers, parameter globs, or LoRA adapters beside the chosen
weights; the head only by default); the
loss block from the ``loss`` node and the optimizer graph from the ``optimizer.block``
node (``_target_`` nodes naming odt_ops.onnxblock classes, built with Hydra's
instantiate; the optimizer's hyperparameters are baked into the graph). The learning rate and its schedule are
fed at run time, so they are not params of this stage: changing them reruns train,
never generate.

Before anything is written, odt_ops.artifacts.check_coverage lists every node that
lacks a kernel or a gradient rule on the way to a trainable parameter, all at once.

Outputs (data/generate/): ``training_model.onnx``, ``eval_model.onnx``,
``optimizer_model.onnx``, ``checkpoint`` (the pretrained weights, trainable and
frozen), ``nominal_checkpoint`` (names, shapes and dtypes only: what a server ships
to devices that already hold the weights) and ``artifacts.json`` (what is trained).
The eval and training models also output the logits (an extra output), which
evaluate reads.
"""
from __future__ import annotations

import importlib
import sys

import odt_ops
from odt_ops import artifacts
from odt_ops.checkpoint import load_checkpoint
from odt_ops.errors import UnsupportedOpError
from pipeline import config, inputs, selection
from pipeline.errors import DataError
from pipeline.io import write_digests, write_json
from pipeline.paths import Paths
from pipeline.tracking import NO_TRACKING, NullRun

CONFIG = {"trainable": selection.TrainableConfig, "loss": config.LOSS}
SUMMARY = "artifacts.json"  # what is trained (the models and checkpoints stay out of MLflow)


def run(cfg, paths: Paths, tracker: NullRun = NO_TRACKING) -> dict:
    source = inputs.upstream(paths.pretrained_model, "pretrain", paths)
    model = odt_ops.load_model(source)
    chosen = selection.select(model, cfg.trainable)
    lora = cfg.trainable.lora.engine() if cfg.trainable.select is selection.Select.lora else None
    coverage = artifacts.check_coverage(model, chosen.trainable)
    if coverage["missing"]:
        raise UnsupportedOpError(coverage["missing"], what="kernel or gradient rule")
    output = model.graph.output[0].name
    out = paths.out("generate")
    loss, optimizer = config.build(cfg.loss), config.build(cfg.optimizer.block)
    qat = cfg.trainable.select is selection.Select.qat
    source_model, frozen = (_quantized(paths, model, out, chosen.trainable) if qat else (model, chosen.frozen))
    artifacts.generate_artifacts(
        source_model,
        requires_grad=chosen.trainable,
        frozen_params=frozen,
        qat=qat,
        loss=loss,
        optimizer=optimizer,
        artifact_directory=out,
        additional_output_names=[output],
        nominal_checkpoint=True,
        lora=lora,
    )
    arrays = model.initializer_arrays()
    trained = load_checkpoint(out / "checkpoint")  # with LoRA: the adapters the rewrite added, plus chosen.trainable
    trainable = trained.trainable_names()
    n_trainable = int(sum(trained.parameters[n].size for n in trainable))
    n_all = int(coverage["all_parameters"])
    summary = {
        "input": next(i.name for i in model.graph.input if i.name not in arrays),
        "output": output,
        "trainable": trainable,
        "frozen": chosen.frozen,
        "trained_layers": chosen.trained_layers() + _adapted_nodes(out, lora) + (_requantized_nodes(out) if qat else []),
        "layers": [name for name, _ in chosen.layers],
        "loss": cfg.loss["_target_"],
        "optimizer": cfg.optimizer.block["_target_"],
        "n_trainable_params": n_trainable,
        "n_params": n_all,
        "qat": qat,
        "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "targets": list(lora.targets)},
    }
    write_json(out / SUMMARY, summary)
    write_digests(out)  # inputs.generated() checks the artifacts against it
    return {"n_trainable_params": n_trainable, "n_params": n_all, "trainable_fraction": n_trainable / max(1, n_all),
            "n_trained_layers": len(summary["trained_layers"])}


def _quantized(paths: Paths, model, out, trainable: list[str]):
    """trainable=qat: the pretrained model as int8 QDQ (pipeline/quantize.py), and no frozen
    parameters: the quantized weights' master copies train, the int8 tensors, scales and zero
    points stay constants of the graphs."""
    from pipeline import inputs, quantize

    split = inputs.load_split(paths, "global_train")
    arrays = model.initializer_arrays()
    input_name = next(i.name for i in model.graph.input if i.name not in arrays)
    qdq = odt_ops.load_model(quantize.quantize_qdq(paths.pretrained_model, out / "base_qdq.onnx", split.x, input_name))
    missing = [n for n in trainable if n not in qdq.initializer_arrays()]
    if missing:
        raise DataError(f"trainable.params: {missing} are quantized in the QDQ model; with trainable=qat their float master copies "
                        "train already, name only parameters that stay float")
    return qdq, []


def _requantized_nodes(out) -> list[str]:
    """trainable=qat: the DequantizeLinear nodes whose weights train (as their master copies)."""
    import onnx

    from odt_ops.quant.qat import read_sites

    return [s.dequantize for s in read_sites(onnx.load(str(out / "eval_model.onnx"))) if s.master]


def _adapted_nodes(out, lora) -> list[str]:
    if lora is None:
        return []
    import onnx

    from odt_ops.lora import read_adapters

    return [n for a in read_adapters(onnx.load(str(out / "eval_model.onnx")))[1] for n in a.nodes]


def main(argv=None) -> int:
    from pipeline.stage import main as stage_main

    return stage_main("generate", run, argv, artifacts=lambda paths: [paths.out("generate") / SUMMARY])


if __name__ == "__main__":  # run the imported pipeline.<module>, whose classes the configuration holds (pipeline/stage.py)
    sys.exit(importlib.import_module(__spec__.name).main())
