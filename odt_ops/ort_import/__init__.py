"""Import what ONNX Runtime's on-device training left on a device: its checkpoint file and its artifact directory."""
from odt_ops.ort_import.checkpoint import is_ort_checkpoint, parse_ort_checkpoint, read_ort_checkpoint

__all__ = ["is_ort_checkpoint", "parse_ort_checkpoint", "read_ort_checkpoint"]
