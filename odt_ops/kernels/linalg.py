"""Kernels: linalg (MatMul, Gemm, Einsum)."""
from __future__ import annotations

import numpy as np

from odt_ops.kernels.registry import kernel


@kernel("MatMul", since=1)
def mat_mul(A, B):
    # np.matmul follows numpy.matmul semantics (1-D promotion, batch broadcasting),
    # which is what the spec prescribes, and keeps float32 in float32
    return (np.matmul(A, B),)


def _swap_faster(A: np.ndarray, B: np.ndarray, transA, transB) -> bool:
    """Whether A @ B.T (a batch of rows times transposed weights) runs faster as (B @ A.T).T.

    Measured with numpy's single-threaded OpenBLAS: for a few rows M against many output
    columns N, A @ B.T takes 1.1-2x the time of B @ A.T plus the transposing copy (M*N is
    small). Beyond 64 rows, or for narrow outputs, the direct product wins or ties."""
    M, N = A.shape[0], B.shape[0]
    return (transB and not transA and A.dtype == B.dtype and A.dtype in (np.float32, np.float64)
            and A.flags.c_contiguous and B.flags.c_contiguous and M <= 64 and N >= 2 * M and M * N >= 2048)


def _gemm(A, B, C, alpha, beta, transA, transB) -> tuple[np.ndarray]:
    if A.ndim != 2 or B.ndim != 2:
        raise ValueError(f"Gemm needs 2-D A and B, got shapes {A.shape} and {B.shape}")
    if _swap_faster(A, B, transA, transB):
        Y = np.ascontiguousarray(np.matmul(B, A.T).T)  # downstream kernels expect C order
    else:
        # .T is a view: BLAS reads the transposed operand in place, no copy
        Y = np.matmul(A.T if transA else A, B.T if transB else B)
    scalar = Y.dtype.type  # python floats would promote float32 to float64
    if alpha != 1:
        Y *= scalar(alpha)
    if C is not None and beta != 0:
        # Y is a fresh product, so the bias goes in in place (C broadcasts to Y's shape)
        Y += C if beta == 1 else C * scalar(beta)
    return (Y,)


@kernel("Gemm", since=1)
def gemm_1(A, B, C=None, *, alpha=1.0, beta=1.0, transA=0, transB=0, broadcast=0):
    # before opset 7 C broadcasts only when the broadcast attribute says so
    if C is not None and not broadcast and C.shape != (A.shape[1 if transA else 0], B.shape[0 if transB else 1]):
        raise ValueError(f"Gemm with broadcast=0 needs C of shape [M, N], got {C.shape}")
    return _gemm(A, B, C, alpha, beta, transA, transB)


@kernel("Gemm", since=7)
def gemm(A, B, C=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    return _gemm(A, B, C, alpha, beta, transA, transB)


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
