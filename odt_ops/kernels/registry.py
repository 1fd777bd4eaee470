"""The kernel registry: (domain, op_type) -> {since_version: kernel}.

A kernel is a plain function registered next to its definition::

    @kernel("LeakyRelu", since=6)
    def leaky_relu(X, *, alpha=0.01):
        return (np.where(X >= 0, X, X * X.dtype.type(alpha)),)

Contract (the execution plan relies on it):
- Inputs arrive positionally in the node's input order as numpy arrays; an omitted
  optional input in the middle arrives as ``None``; trailing omitted inputs are not
  passed, so the parameter's default applies.
- Attributes arrive as keyword-only arguments named exactly as in the ONNX spec, with
  the spec's defaults in the signature. Strings are ``str``, tensors ``np.ndarray``.
- Engine-supplied keywords may be declared: ``_num_outputs`` (how many outputs the
  node asks for), ``_rng`` (the session's ``np.random.Generator``, for Dropout and
  friends, so one seed governs every random draw) and ``_products`` (the plan node's
  record of matrix-product formulations, kernels/products.py; None outside a plan).
- The return value is a tuple of numpy arrays, one per output (extra trailing outputs
  the node did not ask for are ignored). Outputs keep the dtype the spec prescribes.
- A kernel never mutates its inputs (the plan may share them between consumers).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from odt_ops.domain import canonical

Kernel = Callable[..., tuple]

ENGINE_KEYWORDS = ("_num_outputs", "_rng", "_products")


@dataclass(frozen=True)
class KernelEntry:
    fn: Kernel
    since: int
    attributes: frozenset[str]  # attribute names the kernel accepts
    engine_keywords: frozenset[str]


_KERNELS: dict[tuple[str, str], dict[int, KernelEntry]] = {}


def kernel(op_type: str, *, since: int = 1, domain: str = "") -> Callable[[Kernel], Kernel]:
    """Register ``fn`` as the kernel of ``op_type`` from opset ``since`` on."""

    def register(fn: Kernel) -> Kernel:
        params = inspect.signature(fn).parameters.values()
        kw = {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}
        versions = _KERNELS.setdefault((domain, op_type), {})
        assert since not in versions, f"{op_type} since {since} registered twice"
        versions[since] = KernelEntry(
            fn=fn,
            since=since,
            attributes=frozenset(kw - set(ENGINE_KEYWORDS)),
            engine_keywords=frozenset(kw & set(ENGINE_KEYWORDS)),
        )
        return fn

    return register


def lookup(domain: str, op_type: str, opset: int) -> KernelEntry | None:
    """The kernel in force for ``op_type`` at ``opset``, or None."""
    versions = _KERNELS.get((canonical(domain), op_type))
    if not versions:
        return None
    eligible = [v for v in versions if v <= opset]
    return versions[max(eligible)] if eligible else None


def registered_ops() -> list[tuple[str, str]]:
    """Every (domain, op_type) with at least one kernel, sorted."""
    return sorted(_KERNELS)
