"""generate_artifacts: a forward ONNX model in, training artifacts in standard ONNX out.

Mirrors ``onnxruntime.training.artifacts`` (same names, same options) so its users
switch by changing an import; unlike it, every node written is a plain ai.onnx op, so
onnxruntime's ordinary inference build and ``onnx.reference`` run the artifacts too,
and gradient coverage is checked for the whole model before anything is built.

Files written to ``artifact_directory``: ``{prefix}training_model.onnx``,
``{prefix}eval_model.onnx``, ``{prefix}optimizer_model.onnx`` (when an optimizer is
given), ``{prefix}checkpoint`` and, when asked, ``{prefix}nominal_checkpoint``.
What the runtime needs to know is recorded in each model's metadata (see ``meta``).
"""
from __future__ import annotations

import enum
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx

from odt_ops.checkpoint import Checkpoint, save_checkpoint
from odt_ops.errors import ArtifactError, UnsupportedOpError
from odt_ops.grad.build import missing_gradients
from odt_ops.ir.load import ModelSource, load_model, read_model, save_model
from odt_ops.ir.lowering import lower_opset
from odt_ops.ir.model import TARGET_OPSET, Model
from odt_ops.lora import LoraConfig, with_adapters
from odt_ops.onnxblock import Block, optim
from odt_ops.onnxblock import loss as losses
from odt_ops.onnxblock.base import building_into
from odt_ops.onnxblock.blocks import PassThrough
from odt_ops.onnxblock.optim import build_optimizer_model
from odt_ops.quant.training import for_training
from odt_ops.training_models import classify_parameters, default_trainable, training_graphs


class LossType(enum.Enum):
    MSELoss = 1
    CrossEntropyLoss = 2
    BCEWithLogitsLoss = 3
    L1Loss = 4


class OptimType(enum.Enum):
    AdamW = 1
    SGD = 2


_LOSSES = {LossType.MSELoss: losses.MSELoss, LossType.CrossEntropyLoss: losses.CrossEntropyLoss,
           LossType.BCEWithLogitsLoss: losses.BCEWithLogitsLoss, LossType.L1Loss: losses.L1Loss}
# OptimType.AdamW means onnxruntime's defaults: its AdamWOptimizer, eps 1e-6, no weight decay
_OPTIMIZERS = {OptimType.AdamW: lambda: optim.AdamW(), OptimType.SGD: lambda: optim.SGD()}

def check_coverage(model: ModelSource, requires_grad: Sequence[str] | None = None) -> dict:
    """Pre-flight report: nodes lacking a kernel or a gradient rule, and parameter counts."""
    normalized = model if isinstance(model, Model) else load_model(model)
    split = classify_parameters(normalized, requires_grad, None)
    arrays = normalized.initializer_arrays()
    return {
        "missing": missing_gradients(normalized, split.trainable),
        "trainable_parameters": int(sum(arrays[n].size for n in split.trainable)),
        "all_parameters": int(sum(a.size for a in arrays.values() if a.dtype.kind == "f")),
        "nodes": len(normalized.graph.node),
    }


def generate_artifacts(
    model: ModelSource,
    requires_grad: Sequence[str] | None = None,
    frozen_params: Sequence[str] | None = None,
    loss: LossType | Block | None = None,
    optimizer: OptimType | optim.Optimizer | None = None,
    artifact_directory: str | os.PathLike | None = None,
    prefix: str = "",
    ort_format: bool = False,
    custom_op_library: str | os.PathLike | None = None,
    additional_output_names: Sequence[str] | None = None,
    nominal_checkpoint: bool = False,
    loss_input_names: Sequence[str] | None = None,
    *,
    opset: int | None = None,
    lora: LoraConfig | None = None,
    qat: bool | str = False,
) -> dict[str, Path]:
    """Write the training artifacts for ``model``; returns the written paths by kind.

    The parameters are ONNX Runtime's, in its order. ``ort_format`` and ``custom_op_library``
    exist so ported calls run; only their defaults can be honoured (see _refuse_ort_only).
    ``opset`` is the opset the artifacts are written at: by default the base model's, as
    ONNX Runtime does (or our own, 21, with a warning saying why, when the model cannot be
    expressed at it); given explicitly, a model that cannot be expressed at it is an error.
    ``lora`` (odt_ops.lora.LoraConfig) first adds LoRA adapters beside the targeted weights
    and trains them (plus whatever ``requires_grad`` names); the base weights stay as stored.
    A QDQ model (QuantizeLinear/DequantizeLinear) trains through straight-through fake
    quantization (odt_ops.quant.qat); ``qat=True`` also trains a float master copy of every
    quantized weight, which odt_ops.quant.export.export_quantized re-quantizes; ``qat="lsq"``
    learns every scale too (LSQ's gradient)."""
    _refuse_ort_only(ort_format, custom_op_library)
    raw = read_model(model)
    base_opset = raw.opset
    forward = load_model(raw)
    forward, requires_grad = for_training(forward, qat, requires_grad)
    if lora is not None:
        forward, requires_grad = with_adapters(forward, lora, requires_grad)
    split = classify_parameters(forward, requires_grad, frozen_params)
    missing = missing_gradients(forward, split.trainable)
    if missing:  # every node at once, before anything is built
        raise UnsupportedOpError(missing, what="kernel or gradient rule")
    out_dir = Path(artifact_directory if artifact_directory is not None else os.getcwd())
    loss_block = _loss_block(loss)
    opt = _optimizer(optimizer) if optimizer is not None else None
    extra = list(additional_output_names or [])

    with_loss, loss_name = _apply_loss(forward, loss_block, loss_input_names, extra)
    arrays = forward.initializer_arrays()
    forward_inputs = [i.name for i in forward.graph.input]
    train_model, eval_model = training_graphs(with_loss, split, loss_name, extra, forward_inputs,
                                              [o.name for o in forward.graph.output], prefix)
    models = {"training_model": train_model, "eval_model": eval_model}
    if opt is not None:
        models["optimizer_model"] = build_optimizer_model(opt, {n: arrays[n] for n in split.trainable})
    models = _at_opset(models, opset if opset is not None else base_opset, explicit=opset is not None, prefix=prefix)
    paths = {}
    for kind, proto in models.items():  # written only once every model is built and checked
        paths[kind] = out_dir / f"{prefix}{kind}.onnx"
        save_model(proto, paths[kind])
    ckpt = Checkpoint(
        parameters={n: np.asarray(arrays[n]) for n in (*split.trainable, *split.frozen)},
        requires_grad={**{n: True for n in split.trainable}, **{n: False for n in split.frozen}},
        buffers={n: np.asarray(arrays[n]) for n in split.buffers},
    )
    paths["checkpoint"] = out_dir / f"{prefix}checkpoint"
    save_checkpoint(ckpt, paths["checkpoint"])
    if nominal_checkpoint:
        ckpt.make_nominal()
        paths["nominal_checkpoint"] = out_dir / f"{prefix}nominal_checkpoint"
        save_checkpoint(ckpt, paths["nominal_checkpoint"])
    return paths


def _at_opset(models: dict[str, onnx.ModelProto], target: int, *, explicit: bool, prefix: str) -> dict[str, onnx.ModelProto]:
    """Every model at ``target``, or (when the target was only the default) all at ours."""
    try:
        return {kind: lower_opset(proto, target, f"{prefix}{kind}.onnx") for kind, proto in models.items()}
    except ArtifactError as exc:
        if explicit:
            raise
        warnings.warn(f"the artifacts are written at opset {TARGET_OPSET}, not at the base model's opset {target}: {exc}",
                      stacklevel=3)
        return models


def _refuse_ort_only(ort_format: bool, custom_op_library) -> None:
    if ort_format:
        raise ArtifactError(
            "generate_artifacts(ort_format=True): the .ort format is ONNX Runtime's own flatbuffer for its minimal "
            "builds; odt_ops writes and runs the .onnx artifacts only. Pass ort_format=False (onnxruntime can "
            "convert the .onnx files with python -m onnxruntime.tools.convert_onnx_models_to_ort)"
        )
    if custom_op_library is not None:
        raise ArtifactError(
            f"generate_artifacts(custom_op_library={str(custom_op_library)!r}): a custom op library is native code "
            "for ONNX Runtime's kernels; odt_ops runs standard ONNX ops only. Pass custom_op_library=None and "
            "express the custom ops with standard ones (python -m odt_ops check MODEL lists what is missing)"
        )


def _loss_block(loss: LossType | Block | None) -> Block:
    if loss is None:
        return PassThrough()
    if isinstance(loss, LossType):
        return _LOSSES[loss]()
    if isinstance(loss, Block):
        return loss
    raise ArtifactError(f"loss must be an odt_ops.artifacts.LossType or an onnxblock.Block, got {type(loss).__name__}")


def _optimizer(optimizer: OptimType | optim.Optimizer) -> optim.Optimizer:
    if isinstance(optimizer, OptimType):
        return _OPTIMIZERS[optimizer]()
    if isinstance(optimizer, optim.Optimizer):
        return optimizer
    raise ArtifactError(f"optimizer must be an odt_ops.artifacts.OptimType or an onnxblock.optim optimizer, got {type(optimizer).__name__}")


def _apply_loss(forward: Model, loss_block: Block, loss_input_names, extra: list[str]) -> tuple[onnx.ModelProto, str]:
    """A copy of the forward graph with the loss block built on its outputs; returns it and the loss's name."""
    proto = onnx.ModelProto()
    proto.CopyFrom(forward.proto)
    graph = proto.graph
    outputs = [o.name for o in graph.output]
    known = outputs + [v.name for v in graph.value_info]
    absent = [n for n in (*(loss_input_names or []), *extra) if n not in known]
    if absent:
        raise ArtifactError(f"{absent} are not values of the model; its outputs are {outputs}")
    loss_inputs = list(loss_input_names) if loss_input_names else (outputs if loss_block.takes_all_outputs else outputs[:1])
    with building_into(proto):  # proto is this function's copy of the forward model
        loss_name = loss_block(*loss_inputs)
    if not isinstance(loss_name, str):
        raise ArtifactError("the loss block must return the name of one scalar value")
    return proto, loss_name


__all__ = ["LossType", "OptimType", "build_optimizer_model", "check_coverage", "classify_parameters", "default_trainable",
           "generate_artifacts"]
