"""Nodes that write their result straight into a preallocated array.

A plan given destinations (``Plan(..., destinations=[outputs])``, the arrays passed to
each run) binds the node producing such an output to one of these writers when there is
one for its op, so the result is computed in its final place instead of in a fresh array
that is then copied. A writer takes the destination as the keyword ``out``.
Each writer performs its kernel's arithmetic, operation for operation, only with
``out=``, and only where that arithmetic is a product (in the formulation its node's
ProductRecord chooses, as the kernel would: the tests hold the two equal bit for bit); when the values it meets are not the case it handles (another
rank or dtype), it runs the ordinary kernel and copies.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import onnx

from odt_ops.domain import is_default
from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels.products import ProductRecord, compute_into

Writer = Callable[..., tuple]


def writer(node: onnx.NodeProto, kernel: Callable[..., tuple]) -> Writer | None:
    """``node``'s kernel writing into the array given as ``out=``, or None when its op has no writer.
    A product takes the formulation the kernel's own ProductRecord chooses (kernels/products.py)."""
    make = _WRITERS.get(node.op_type) if is_default(node.domain) else None
    record = kernel.keywords.get("_products") if isinstance(kernel, functools.partial) else None
    return None if make is None else make(node_attributes(node), kernel, record)


def _copied(kernel: Callable[..., tuple], out: np.ndarray, args) -> tuple:
    np.copyto(out, kernel(*args)[0])
    return (out,)


def _gemm(attrs: dict, kernel, record: ProductRecord | None) -> Writer | None:
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    ta, tb = attrs.get("transA", 0), attrs.get("transB", 0)
    # a weight gradient contracts the batch: A' = A^T, which the kernel multiplies as it is
    # (a batch of rows times weights may take the kernel's faster operand order instead)
    if set(attrs) - {"alpha", "beta", "transA", "transB"} or not ta:
        return None

    def run(A, B, C=None, *, out):
        if A.ndim != 2 or B.ndim != 2 or not A.dtype == B.dtype == out.dtype \
                or (A.shape[1 if ta else 0], B.shape[0 if tb else 1]) != out.shape:
            return _copied(kernel, out, (A, B) if C is None else (A, B, C))
        A, B = A.T if ta else A, B.T if tb else B
        compute_into(A, B, "direct" if record is None else record.choose(A, B), out)
        scalar = out.dtype.type
        if alpha != 1:
            np.multiply(out, scalar(alpha), out=out)
        if C is not None and beta != 0:
            np.add(out, C if beta == 1 else C * scalar(beta), out=out)
        return (out,)

    return run


def _mat_mul(attrs: dict, kernel, record: ProductRecord | None) -> Writer:
    def run(A, B, *, out):
        if A.ndim != 2 or B.ndim != 2 or not A.dtype == B.dtype == out.dtype or (A.shape[0], B.shape[1]) != out.shape:
            return _copied(kernel, out, (A, B))
        compute_into(A, B, "direct" if record is None else record.choose(A, B), out)
        return (out,)

    return run


_WRITERS = {"Gemm": _gemm, "MatMul": _mat_mul}
