"""Import the artifact directory ONNX Runtime's on-device training left on a device (its checkpoint
file itself is read by odt_ops.checkpoint, as one of the checkpoint's two formats)."""
