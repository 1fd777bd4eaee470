"""onnxblock.save_checkpoint and load_checkpoint_to_model, as ONNX Runtime names them: a
TrainingBlock's parameters to a checkpoint file, and a checkpoint's values into a model."""
from __future__ import annotations

import os

import onnx
from onnx import numpy_helper

from odt_ops.checkpoint import Checkpoint, load_checkpoint
from odt_ops.checkpoint import save_checkpoint as _save
from odt_ops.errors import CheckpointError


def save_checkpoint(parameters: tuple[list[onnx.TensorProto], list[onnx.TensorProto]], path_to_checkpoint: str | os.PathLike,
                    nominal_checkpoint: bool = False) -> None:
    """Write ``(trainable, frozen)`` initializers (a TrainingBlock's ``parameters()``) as a checkpoint."""
    trainable, frozen = parameters
    ckpt = Checkpoint()
    for tensors, requires_grad in ((trainable, True), (frozen, False)):
        for t in tensors:
            ckpt.parameters[t.name] = numpy_helper.to_array(t)
            ckpt.requires_grad[t.name] = requires_grad
    if nominal_checkpoint:
        ckpt.make_nominal()
    _save(ckpt, path_to_checkpoint)


def load_checkpoint_to_model(path_to_checkpoint: str | os.PathLike, model: onnx.ModelProto, allow_unused: bool = False) -> None:
    """Replace ``model``'s initializers (in place) with the checkpoint's parameters and buffers of
    the same names. A checkpoint value the model has no initializer for is an error unless
    ``allow_unused``."""
    ckpt = load_checkpoint(path_to_checkpoint)
    if ckpt.nominal:
        raise CheckpointError(f"{path_to_checkpoint}: a nominal checkpoint has no values to load into a model")
    values = {**ckpt.parameters, **ckpt.buffers}
    initializers = {t.name: t for t in model.graph.initializer}
    unused = sorted(set(values) - set(initializers))
    if unused and not allow_unused:
        raise CheckpointError(f"{path_to_checkpoint}: {unused} are not initializers of the model; pass allow_unused=True "
                              "to load the others anyway")
    for name, value in values.items():
        if name in initializers:
            t = initializers[name]
            if tuple(t.dims) != value.shape:
                raise CheckpointError(f"{path_to_checkpoint}: {name!r} is {list(value.shape)} in the checkpoint but "
                                      f"{list(t.dims)} in the model")
            t.CopyFrom(numpy_helper.from_array(value, name))
