"""The inference model of a fine-tuned QDQ model, in the QDQ layout it came in."""
from __future__ import annotations

import os

import onnx

from odt_ops.checkpoint import Checkpoint
from odt_ops.export import export_inference_model
from odt_ops.ir.load import read_model, save_model
from odt_ops.ir.model import Model
from odt_ops.ir.passes import prune_unused
from odt_ops.quant.qat import read_sites
from odt_ops.quant.requantize import strip_straight_through


def inference_without_ste(eval_model, checkpoint: Checkpoint, path: str | os.PathLike) -> onnx.ModelProto:
    """export_inference_model, then (for a model prepared by odt_ops.quant.qat) the straight-through
    nodes dropped and the trained master weights re-quantized; not yet checked or saved."""
    source = read_model(eval_model)
    sites = read_sites(source.proto)
    proto = export_inference_model(source, checkpoint, path)
    if sites:
        strip_straight_through(proto.graph, sites)
        model = Model(proto, source=str(path))
        prune_unused(model)
        proto = model.proto
    return proto


def export_quantized(eval_model, checkpoint: Checkpoint, path: str | os.PathLike) -> onnx.ModelProto:
    """The QAT-fine-tuned model as QDQ ONNX: int weights re-quantized with the model's own
    scales and zero points, QuantizeLinear/DequantizeLinear where the original had them."""
    proto = inference_without_ste(eval_model, checkpoint, path)
    proto = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True)
    onnx.checker.check_model(proto, full_check=True)
    save_model(proto, path)
    return proto
