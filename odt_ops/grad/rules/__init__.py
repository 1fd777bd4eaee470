"""Gradient rules, one module per op family (mirroring odt_ops.kernels); importing registers them."""
from odt_ops.grad.rules import cast, control_flow, conv, elementwise, erf, linalg, loss, nn, pool, quantize, reduce, shape  # noqa: F401
