"""The inference model a stage ships (export, federate), at the IR version the configuration asks."""
from __future__ import annotations

import onnx

from pipeline.io import atomic_write_bytes


def export_inference(module, target, ir_version: int):
    """``module``'s inference model written to ``target`` at ``ir_version`` (what export and
    federate ship); returns the model."""
    module.export_model_for_inferencing(target)
    proto = onnx.load(str(target))
    if proto.ir_version != ir_version:
        proto.ir_version = ir_version
        onnx.checker.check_model(proto, full_check=True)
        atomic_write_bytes(target, proto.SerializeToString())
    return proto
