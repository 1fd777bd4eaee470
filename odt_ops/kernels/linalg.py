"""Kernels: linalg (MatMul, Gemm, Einsum)."""
from __future__ import annotations

import functools
import math

import numpy as np

from odt_ops.kernels.products import ProductRecord, multiply
from odt_ops.kernels.reduce import ROW_DOT_MIN, row_dots
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
    if len(terms) == 2 and terms[0] == terms[1]:
        rows = _row_products(equation, *Inputs)
        if rows is not None:
            return (rows.astype(dtype, copy=False),)
    out = np.einsum(equation, *Inputs, optimize=not (len(terms) == 2 and terms[0] == terms[1]))
    return (np.asarray(out).astype(dtype, copy=False),)


def _row_products(equation: str, A: np.ndarray, B: np.ndarray) -> np.ndarray | None:
    """"abc,abc->ab"-style equations (one term twice, the output its leading labels: per-row sums of
    products over the trailing axes, as a normalization's gradient writes them) as one BLAS dot per
    row; None for any other equation. numpy's einsum runs them as an unvectorized loop: at
    (32, 4, 4096) float32 0.107 ms against 0.034 ms (AMD EPYC Zen 4, one thread)."""
    form = _row_form(equation)
    if form is None or A.shape != B.shape or A.dtype != B.dtype or A.dtype not in (np.float32, np.float64) or A.ndim != form[0]:
        return None
    kept = form[1]
    lead, size = A.shape[:kept], math.prod(A.shape[kept:])
    if size < ROW_DOT_MIN:
        return None
    return row_dots(A.reshape(*lead, size), B.reshape(*lead, size))


@functools.lru_cache(maxsize=64)
def _row_form(equation: str) -> tuple[int, int] | None:
    """(the term's rank, the output's) when ``equation`` is a per-row sum of products, else None:
    parsed once per equation, not on every call of a plan's node."""
    term, _, out = equation.partition("->")
    term = term.split(",")[0]
    if not out or "." in term or len(set(term)) != len(term) or term[:len(out)] != out or len(out) == len(term):
        return None
    return len(term), len(out)
