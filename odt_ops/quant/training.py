"""Where artifacts generation meets a QDQ model."""
from __future__ import annotations

from collections.abc import Sequence

from odt_ops.errors import QuantizationError
from odt_ops.ir.model import Model
from odt_ops.quant.qat import learned_scales, prepare

QAT_MODES = (False, True, "lsq")


def for_training(forward: Model, qat: bool | str, requires_grad: Sequence[str] | None) -> tuple[Model, list[str] | None]:
    """A QDQ model made differentiable (odt_ops.quant.qat), and what trains: with ``qat`` the
    float master copy of every quantized weight too, and with ``qat="lsq"`` every scale as well
    (learned step size). A float model passes through unchanged."""
    if qat not in QAT_MODES or isinstance(qat, int) and not isinstance(qat, bool):
        raise QuantizationError(f"qat={qat!r}: give False, True (train float master weights) or 'lsq' (and learn the scales)")
    if not any(n.op_type == "DequantizeLinear" for n in forward.graph.node):
        if qat:
            raise QuantizationError(f"{forward.source}: qat={qat!r}, but the model has no DequantizeLinear node; quantize it first "
                                    "(onnxruntime.quantization.quantize_static with QuantFormat.QDQ) or pass qat=False")
        return forward, requires_grad
    prepared, sites = prepare(forward, weights=bool(qat), activations=True, learn_scales=qat == "lsq")
    masters = [s.master for s in sites if s.master]
    if qat and not masters:
        raise QuantizationError(f"{forward.source}: qat={qat!r}, but no DequantizeLinear reads a quantized weight initializer")
    if not qat:
        return prepared, requires_grad
    chosen = masters + learned_scales(prepared.proto)
    return prepared, chosen + [n for n in requires_grad or [] if n not in chosen]


__all__ = ["QAT_MODES", "for_training"]
