"""Quantized (QDQ) models (QuantizeLinear/DequantizeLinear's kernels are odt_ops/kernels/quantize.py): quantization-aware
fine-tuning (a float master copy per quantized weight, fake-quantized in the forward with the
model's scales and zero points, straight-through gradients zero outside the clip range), and
the export that re-quantizes to the QDQ layout onnxruntime runs.

Import the parts from their modules (odt_ops.quant.qat, .export, .training)."""
