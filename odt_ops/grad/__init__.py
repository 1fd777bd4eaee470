"""Gradient graphs in standard ONNX: rules per op, and the reverse walk that applies them."""
from odt_ops.grad import rules  # noqa: F401  (registers every rule)
from odt_ops.grad.build import Gradients, build_gradients, missing_gradients, unbroadcast
from odt_ops.grad.registry import GradContext, gradient, lookup_gradient, registered_gradients

__all__ = ["GradContext", "Gradients", "build_gradients", "gradient", "lookup_gradient", "missing_gradients", "registered_gradients", "unbroadcast"]
