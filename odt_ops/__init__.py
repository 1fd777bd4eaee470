"""odt_ops: on-device training for ONNX models, in numpy.

The engine needs numpy and onnx only. The public surface speaks onnxruntime's
vocabulary (InferenceSession, generate_artifacts, CheckpointState, Module, Optimizer).
"""
from odt_ops.errors import (
    InputError,
    KernelError,
    ModelCheckError,
    ModelLoadError,
    OdtError,
    UnsupportedOpError,
)
from odt_ops.ir import TARGET_OPSET, Model, load_model, save_model
from odt_ops.kernels import registered_ops
from odt_ops.runtime import InferenceSession

__version__ = "0.1.0"


def supported_ops() -> list[str]:
    """The standard ONNX op types the engine claims to execute (the conformance suite's scope)."""
    return sorted(op for domain, op in registered_ops() if domain == "")


__all__ = [
    "InferenceSession",
    "InputError",
    "KernelError",
    "Model",
    "ModelCheckError",
    "ModelLoadError",
    "OdtError",
    "TARGET_OPSET",
    "UnsupportedOpError",
    "load_model",
    "save_model",
    "supported_ops",
]
