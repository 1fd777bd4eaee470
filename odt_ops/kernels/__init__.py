"""Numpy forward kernels, one module per op family; importing this package registers them."""
from odt_ops.kernels import cast, control_flow, conv, elementwise, erf, linalg, loss, nn, pool, quantize, reduce, shape  # noqa: F401
from odt_ops.kernels.registry import kernel, lookup, registered_ops

__all__ = ["kernel", "lookup", "registered_ops"]
