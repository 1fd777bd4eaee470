"""Where artifacts generation meets a QDQ model."""
from __future__ import annotations

from collections.abc import Sequence

from odt_ops.errors import QuantizationError
from odt_ops.ir.model import Model
from odt_ops.quant.qat import prepare


def for_training(forward: Model, qat: bool, requires_grad: Sequence[str] | None) -> tuple[Model, list[str] | None]:
    """A QDQ model made differentiable (odt_ops.quant.qat), and what trains: with ``qat`` the
    float master copy of every quantized weight too. A float model passes through unchanged."""
    if not any(n.op_type == "DequantizeLinear" for n in forward.graph.node):
        if qat:
            raise QuantizationError(f"{forward.source}: qat=True, but the model has no DequantizeLinear node; quantize it first "
                                    "(onnxruntime.quantization.quantize_static with QuantFormat.QDQ) or pass qat=False")
        return forward, requires_grad
    prepared, sites = prepare(forward, weights=qat, activations=True)
    masters = [s.master for s in sites if s.master]
    if qat and not masters:
        raise QuantizationError(f"{forward.source}: qat=True, but no DequantizeLinear reads a quantized weight initializer")
    return prepared, masters + [n for n in requires_grad or [] if n not in masters] if qat else requires_grad


__all__ = ["for_training"]
