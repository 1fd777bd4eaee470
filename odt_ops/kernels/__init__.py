"""Numpy forward kernels, one module per op family; importing this package registers them."""
from odt_ops.kernels import cast, control_flow, conv, elementwise, erf, linalg, loss, nn, pool, reduce, shape  # noqa: F401
from odt_ops.kernels.registry import kernel, lookup, registered_ops
from odt_ops.quant import quantize as _quant_kernels  # noqa: F401,E402 (QuantizeLinear, DequantizeLinear register themselves)

__all__ = ["kernel", "lookup", "registered_ops"]
