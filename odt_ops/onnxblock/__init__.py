"""onnxblock: compose losses and optimizers in Python, as onnxruntime.training.onnxblock does.

A ``Block`` is a callable whose ``build(*input_names)`` emits standard ONNX nodes into
the model currently open with ``base(model)`` and returns its output name(s)::

    class WeightedMSE(onnxblock.Block):
        def build(self, output_name):
            diff = onnxblock.blocks.Sub()(output_name, onnxblock.blocks.InputLike(output_name)("target"))
            return onnxblock.blocks.ReduceMean()(onnxblock.blocks.Mul()(diff, diff))

``generate_artifacts(..., loss=WeightedMSE())`` accepts such a block as the loss.
"""
from odt_ops.onnxblock import blocks, loss, optim
from odt_ops.onnxblock.base import Block, base, current_builder, empty_base

__all__ = ["Block", "base", "blocks", "current_builder", "empty_base", "loss", "optim"]
