"""onnxblock: compose losses and optimizers in Python, as onnxruntime.training.onnxblock does.

A ``Block`` is a callable whose ``build(*input_names)`` emits standard ONNX nodes into
the model currently open with ``base(model)`` and returns its output name(s)::

    class WeightedMSE(onnxblock.Block):
        def build(self, output_name):
            diff = onnxblock.blocks.Sub()(output_name, onnxblock.blocks.InputLike(output_name)("target"))
            return onnxblock.blocks.ReduceMean()(onnxblock.blocks.Mul()(diff, diff))

``generate_artifacts(..., loss=WeightedMSE())`` accepts such a block as the loss.

Custom graphs as ONNX Runtime users write them work too: ``ForwardBlock`` and
``TrainingBlock`` subclasses (``requires_grad``, ``parameters()``, ``to_model_proto()``),
optimizer blocks called on ``parameters()``, ``save_checkpoint`` and
``load_checkpoint_to_model``.
"""
from odt_ops.onnxblock import blocks, loss, optim
from odt_ops.onnxblock.base import Block, base, current_builder, empty_base, onnx_model
from odt_ops.onnxblock.checkpoint_utils import load_checkpoint_to_model, save_checkpoint
from odt_ops.onnxblock.model_blocks import ForwardBlock, TrainingBlock

# ONNX Runtime 1.14's names, still in its published examples (the Android app's preparation script)
TrainingModel, Model = TrainingBlock, ForwardBlock

__all__ = ["Block", "ForwardBlock", "Model", "TrainingBlock", "TrainingModel", "base", "blocks", "current_builder", "empty_base",
           "load_checkpoint_to_model", "loss", "onnx_model", "optim", "save_checkpoint"]
