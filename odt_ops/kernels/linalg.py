"""Kernels: linalg (MatMul, Gemm, Einsum)."""
from __future__ import annotations

import numpy as np

from odt_ops.kernels.products import ProductRecord, multiply
from odt_ops.kernels.registry import kernel


@kernel("MatMul", since=1)
def mat_mul(A, B, *, _products: ProductRecord | None = None):
    # np.matmul follows numpy.matmul semantics (1-D promotion, batch broadcasting),
    # which is what the spec prescribes, and keeps float32 in float32; a 2-D product goes
    # through the formulation its plan node chose (kernels/products.py)
    return (multiply(A, B, _products),)


def _gemm(A, B, C, alpha, beta, transA, transB, products: ProductRecord | None) -> tuple[np.ndarray]:
    if A.ndim != 2 or B.ndim != 2:
        raise ValueError(f"Gemm needs 2-D A and B, got shapes {A.shape} and {B.shape}")
    # .T is a view: BLAS reads the transposed operand in place unless the node's formulation copies
    Y = multiply(A.T if transA else A, B.T if transB else B, products)
    scalar = Y.dtype.type  # python floats would promote float32 to float64
    if alpha != 1:
        Y *= scalar(alpha)
    if C is not None and beta != 0:
        # Y is a fresh product, so the bias goes in in place (C broadcasts to Y's shape)
        Y += C if beta == 1 else C * scalar(beta)
    return (Y,)


@kernel("Gemm", since=1)
def gemm_1(A, B, C=None, *, alpha=1.0, beta=1.0, transA=0, transB=0, broadcast=0, _products: ProductRecord | None = None):
    # before opset 7 C broadcasts only when the broadcast attribute says so
    if C is not None and not broadcast and C.shape != (A.shape[1 if transA else 0], B.shape[0 if transB else 1]):
        raise ValueError(f"Gemm with broadcast=0 needs C of shape [M, N], got {C.shape}")
    return _gemm(A, B, C, alpha, beta, transA, transB, _products)


@kernel("Gemm", since=7)
def gemm(A, B, C=None, *, alpha=1.0, beta=1.0, transA=0, transB=0, _products: ProductRecord | None = None):
    return _gemm(A, B, C, alpha, beta, transA, transB, _products)


@kernel("Einsum", since=12)
def einsum(*Inputs, equation):
    if not Inputs:
        raise ValueError("Einsum needs at least one input")
    dtype = Inputs[0].dtype
    if dtype.kind == "V":  # ml_dtypes' bfloat16: numpy's einsum has no loop for it
        Inputs = tuple(x.astype(np.float32) for x in Inputs)
    # numpy's einsum rejects spaces, which the spec allows; optimize=True contracts
    # pairwise through BLAS (tensordot) instead of one big nested loop, except for a product
    # of two operands with the same labels reduced (a normalization's per-channel sums of
    # products, "nchw,nchw->c"), where the optimized path copies transposes and ran 3-8x slower
    equation = equation.replace(" ", "")
    terms = equation.split("->")[0].split(",")
    out = np.einsum(equation, *Inputs, optimize=not (len(terms) == 2 and terms[0] == terms[1]))
    return (np.asarray(out).astype(dtype, copy=False),)
