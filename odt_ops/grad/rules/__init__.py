"""Gradient rules, one module per op family (mirroring odt_ops.kernels); importing registers them."""
from odt_ops.grad.rules import control_flow, conv, elementwise, linalg, loss, nn, reduce, shape  # noqa: F401
