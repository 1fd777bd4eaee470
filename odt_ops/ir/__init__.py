"""Loading, checking and normalizing ONNX models; graph rewrites as named passes."""
from odt_ops.ir.load import load_model, save_model
from odt_ops.ir.model import TARGET_IR_VERSION, TARGET_OPSET, Model

__all__ = ["Model", "TARGET_IR_VERSION", "TARGET_OPSET", "load_model", "save_model"]
