"""Gradient rules of the quantization ops, in the module named like their kernels' (odt_ops.quant.quantize)."""
