"""LoRA adapters on any ONNX model: add them for training, fold them in or export them alone.

``generate_artifacts(model, lora=LoraConfig(rank=8, alpha=16, targets=["MatMul"]))`` trains
the adapters only; ``export_merged`` writes the inference model with every adapter folded
into its weight; ``export_adapter`` writes onnxruntime's adapter file beside a base model
whose adapter inputs default to zero (``export_adapter_base``).
"""
from __future__ import annotations

from collections.abc import Sequence

from odt_ops.ir.model import Model
from odt_ops.lora.config import ADAPTABLE_OPS, LoraConfig
from odt_ops.lora.export import adapter_arrays, export_adapter, export_adapter_base, export_merged
from odt_ops.lora.rewrite import Adapter, adapter_names, add_adapters, read_adapters


def with_adapters(forward: Model, config: LoraConfig, requires_grad: Sequence[str] | None) -> tuple[Model, list[str]]:
    """The forward model with adapters, and what trains: every adapter, plus ``requires_grad``."""
    adapted, adapters = add_adapters(forward, config)
    names = [n for a in adapters for n in (a.A, a.B)]
    return adapted, names + [n for n in requires_grad or [] if n not in names]


__all__ = ["ADAPTABLE_OPS", "Adapter", "LoraConfig", "adapter_arrays", "adapter_names", "add_adapters", "export_adapter", "export_adapter_base",
           "export_merged", "read_adapters", "with_adapters"]
