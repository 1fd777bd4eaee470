"""The gradient registry: (domain, op_type) -> rule, keyed like the kernels.

A rule is a small pure function registered next to its definition; its docstring is
the formula::

    @gradient("Mul", broadcasting=True)
    def mul_grad(ctx, dY):
        "dA = dY * B, dB = dY * A"
        A, B = ctx.inputs
        return (ctx.b.Mul(dY, B) if ctx.needs(0) else None,
                ctx.b.Mul(dY, A) if ctx.needs(1) else None)

Contract:
- A rule receives the context and one gradient name per forward output (None for an
  output nothing downstream differentiates) and returns one gradient name, or None,
  per forward input (trailing Nones may be left off). None means "no gradient flows
  here": non-differentiable inputs (indices, shapes, axes, integer tensors) and inputs
  whose gradient nobody needs (``ctx.needs(i)`` is False).
- Rules emit standard ai.onnx nodes only, through ``ctx.b`` (a GraphBuilder).
- The central walker (build.py) does the chores once: it sums fan-out, and for rules
  registered with ``broadcasting=True`` it reduces each returned gradient back to its
  input's shape (numpy broadcasting undone). Rules never unbroadcast themselves.
- A rule that cannot handle a node's attributes raises GradientError with the reason;
  the walker collects every such error and reports them together.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import onnx

from odt_ops.domain import canonical
from odt_ops.errors import GradientError
from odt_ops.ir.attributes import attribute_value, node_attributes
from odt_ops.ir.builder import Dim, GraphBuilder

Rule = Callable[..., tuple]


@dataclass(frozen=True)
class GradientRule:
    fn: Rule
    broadcasting: bool  # the walker unbroadcasts the gradients this rule returns


_GRADIENTS: dict[tuple[str, str], GradientRule] = {}
GRADIENTS = _GRADIENTS  # read-only view for introspection


def gradient(op_type: str, *, domain: str = "", broadcasting: bool = False) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the gradient rule of ``op_type``."""

    def register(fn: Rule) -> Rule:
        key = (domain, op_type)
        assert key not in _GRADIENTS, f"gradient of {op_type} registered twice"
        _GRADIENTS[key] = GradientRule(fn, broadcasting)
        return fn

    return register


def lookup_gradient(domain: str, op_type: str) -> GradientRule | None:
    return _GRADIENTS.get((canonical(domain), op_type))


def registered_gradients() -> list[str]:
    """Every op type with a gradient rule, sorted (domain-qualified outside ai.onnx)."""
    return sorted(op if not domain else f"{domain}::{op}" for domain, op in _GRADIENTS)


@cache
def _spec_defaults(domain: str, op_type: str, opset: int) -> dict[str, Any]:
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return {}
    return {name: attribute_value(a.default_value) for name, a in schema.attributes.items() if a.default_value.name}


@cache
def _max_inputs(domain: str, op_type: str, opset: int) -> int | None:
    """How many inputs the schema allows; None when variadic or unknown."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None
    return None if schema.max_input > 64 else schema.max_input


@cache
def _output_names(domain: str, op_type: str, opset: int) -> tuple[str, ...]:
    try:
        return tuple(o.name for o in onnx.defs.get_schema(op_type, opset, domain).outputs)
    except onnx.defs.SchemaError:
        return ()


def attributes_with_defaults(node: onnx.NodeProto, opset: int) -> dict[str, Any]:
    """The node's attributes, with the spec's defaults for the ones it leaves out."""
    return {**_spec_defaults(node.domain, node.op_type, opset), **node_attributes(node)}


class GradContext:
    """What a rule may know about the forward node, plus the builder ``b`` to emit with."""

    def __init__(self, node: onnx.NodeProto, b: GraphBuilder, opset: int, needs: tuple[bool, ...]):
        self.node = node
        self.b = b
        self.opset = opset
        self.attrs = attributes_with_defaults(node, opset)
        self._needs = needs

    # ---- the forward node ------------------------------------------------------------
    @property
    def inputs(self) -> list[str]:
        """Input names, padded with "" up to the schema's input count (optional inputs absent)."""
        names = list(self.node.input)
        return names + [""] * (self._max_inputs() - len(names))

    @property
    def outputs(self) -> list[str]:
        return list(self.node.output)

    def needs(self, i: int) -> bool:
        """Whether the gradient of input ``i`` is wanted (it leads back to a trainable parameter)."""
        return i < len(self._needs) and self._needs[i]

    def output(self, i: int) -> str:
        """Forward output ``i``, asking the forward node to produce it if it is optional and unnamed
        (Dropout's mask, LayerNormalization's mean, MaxPool's indices): forward results are
        reused, never recomputed."""
        while len(self.node.output) <= i:
            self.node.output.append("")
        if not self.node.output[i]:
            label = _output_names(self.node.domain, self.node.op_type, self.opset)
            label = label[i] if i < len(label) else f"output{i}"
            self.node.output[i] = self.b.fresh(f"{self.node.name or self.node.op_type}/{label}", scoped=False)
            self.b.infer(self.node)
        return self.node.output[i]

    def _max_inputs(self) -> int:
        most = _max_inputs(self.node.domain, self.node.op_type, self.opset)
        return len(self.node.input) if most is None else max(most, len(self.node.input))

    def fail(self, reason: str) -> GradientError:
        return GradientError(f"{self.node.op_type} node {self.node.name!r}: {reason}")

    # ---- static facts (from shape inference) ----------------------------------------------
    def dtype(self, name: str) -> np.dtype:
        dtype = self.b.dtype(name)
        if dtype is None:
            raise self.fail(f"the type of {name!r} is unknown; run shape inference first")
        return dtype

    def shape(self, name: str) -> tuple[Dim, ...] | None:
        return self.b.shape(name)

    def rank(self, name: str) -> int:
        shape = self.b.shape(name)
        if shape is None:
            raise self.fail(f"the rank of {name!r} is unknown")
        return len(shape)

    def static_shape(self, name: str) -> tuple[int, ...] | None:
        shape = self.b.shape(name)
        return shape if shape is not None and all(isinstance(d, int) for d in shape) else None

    def value(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if it is a constant (an initializer), else None."""
        return self.b.value(name) if name else None

    # ---- small emitters shared by many rules ---------------------------------------------
    def const(self, value, like: str) -> str:
        """A constant with the dtype of ``like``."""
        return self.b.constant(np.asarray(value, dtype=self.dtype(like)))

    def ints(self, values) -> str:
        return self.b.constant(np.asarray(values, dtype=np.int64))

    def shape_of(self, name: str) -> str:
        """The int64 shape of ``name``: a constant when static, a Shape node otherwise."""
        static = self.static_shape(name)
        return self.ints(static) if static is not None else self.b.Shape(name)

    def reshape_target(self, name: str) -> str:
        """A Reshape target giving ``name``'s shape: constant when at most one dim is unknown (as -1,
        which Reshape infers from the size), a Shape node otherwise. Saves a Shape node per
        reshape-like gradient under a dynamic batch."""
        shape = self.b.shape(name)
        if shape is not None:
            unknown = [i for i, d in enumerate(shape) if not isinstance(d, int)]
            if len(unknown) <= 1 and all(d > 0 for d in shape if isinstance(d, int)):
                return self.ints([d if isinstance(d, int) else -1 for d in shape])
        return self.b.Shape(name)

    def zeros_like(self, name: str, dtype: np.dtype | None = None) -> str:
        zero = np.zeros((1,), dtype=dtype or self.dtype(name))
        return self.b.ConstantOfShape(self.shape_of(name), value=zero)

    def axes(self, axes, rank: int) -> list[int]:
        """Axes made non-negative and sorted."""
        return sorted(a + rank if a < 0 else a for a in axes)


__all__ = ["GRADIENTS", "GradContext", "GradientRule", "attributes_with_defaults", "gradient", "lookup_gradient", "registered_gradients"]
