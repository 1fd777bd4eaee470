"""Gradient rules, one module per op family (mirroring odt_ops.kernels); importing registers them."""
from odt_ops.grad.rules import conv, elementwise, linalg, loss, nn, reduce, shape  # noqa: F401
from odt_ops.quant.rules import quantize as _quant_rules  # noqa: F401,E402 (DequantizeLinear's scale gradient)
