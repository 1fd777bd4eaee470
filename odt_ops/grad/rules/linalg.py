"""Gradient rules: MatMul, Gemm, Einsum.

Transposes are folded into Gemm's transA/transB where the operands are matrices; for
batched MatMul the transposed operand is a Transpose of the last two axes (a view in
the numpy engine). Batch broadcasting is undone by the walker.
"""
from __future__ import annotations

import numpy as np

from odt_ops.grad.registry import gradient


def _swap_last(ctx, x: str, rank: int) -> str:
    return ctx.b.Transpose(x, perm=[*range(rank - 2), rank - 1, rank - 2])


@gradient("MatMul", broadcasting=True)
def matmul_grad(ctx, dY):
    """dA = dY @ B^T, dB = A^T @ dY (1-D operands as matrices; batch dims summed by the walker)"""
    b, (A, B) = ctx.b, ctx.inputs[:2]
    ra, rb = ctx.rank(A), ctx.rank(B)
    if ra == 1 and rb == 1:  # dot product: Y is a scalar
        return (b.Mul(dY, B) if ctx.needs(0) else None, b.Mul(dY, A) if ctx.needs(1) else None)
    # 1-D operands get the matrix axis numpy's matmul gives them, and lose it again at the end
    a_, b_, g = A, B, dY
    if ra == 1:
        a_, g = b.Unsqueeze(A, ctx.ints([0])), b.Unsqueeze(g, ctx.ints([-2]))
    if rb == 1:
        b_, g = b.Unsqueeze(B, ctx.ints([1])), b.Unsqueeze(g, ctx.ints([-1]))
    ra_, rb_ = max(ra, 2), max(rb, 2)
    dA = dB = None
    if ctx.needs(0):
        dA = b.Gemm(g, b_, transB=1) if ra_ == rb_ == 2 else b.MatMul(g, _swap_last(ctx, b_, rb_))
        dA = b.Squeeze(dA, ctx.ints([-2])) if ra == 1 else dA
    if ctx.needs(1):
        if rb_ == 2 and ra_ > 2:  # weight shared across a batch: fold the batch into one Gemm
            dB = b.Gemm(b.Flatten(a_, axis=ra_ - 1), b.Flatten(g, axis=ra_ - 1), transA=1)  # g has rank ra_ here
        elif ra_ == rb_ == 2:
            dB = b.Gemm(a_, g, transA=1)
        else:
            dB = b.MatMul(_swap_last(ctx, a_, ra_), g)
        dB = b.Squeeze(dB, ctx.ints([-1])) if rb == 1 else dB
    return dA, dB


@gradient("Gemm", broadcasting=True)
def gemm_grad(ctx, dY):
    """Y = alpha A' B' + beta C: dA' = alpha dY B'^T, dB' = alpha A'^T dY, dC = beta dY,
    each one Gemm with transA/transB chosen so that no transpose is materialized"""
    b, (A, B, C) = ctx.b, ctx.inputs[:3]
    alpha, beta = ctx.attrs["alpha"], ctx.attrs["beta"]
    ta, tb = ctx.attrs["transA"], ctx.attrs["transB"]
    scale = alpha if alpha != 1 else None
    dA = dB = dC = None
    if ctx.needs(0):
        dA = b.Gemm(B, dY, transA=tb, transB=1, alpha=scale) if ta else b.Gemm(dY, B, transB=1 - tb, alpha=scale)
    if ctx.needs(1):
        dB = b.Gemm(dY, A, transA=1, transB=ta, alpha=scale) if tb else b.Gemm(A, dY, transA=1 - ta, alpha=scale)
    if C and ctx.needs(2):
        dC = dY if beta == 1 else b.Mul(dY, ctx.const(beta, like=C))
    return dA, dB, dC


@gradient("Einsum", broadcasting=True)
def einsum_grad(ctx, dY):
    """for Y = einsum(X_1..X_n -> out): dX_i = einsum(dY, X_j (j != i) -> terms_i), broadcast
    over labels only X_i has (they were summed)"""
    b = ctx.b
    terms, out = _parse_einsum(ctx, ctx.attrs["equation"])
    grads = []
    for i, X in enumerate(ctx.node.input):
        if not ctx.needs(i):
            grads.append(None)
            continue
        full_term = terms[i]
        # a repeated label reads a diagonal: differentiate as if the operand were that diagonal
        # (each label once), then put the gradient back on the diagonal
        term = list(dict.fromkeys(full_term))
        if len(term) != len(full_term) and "..." in full_term:
            raise ctx.fail(f"Einsum gradient with a repeated label and an ellipsis in operand {i} is not supported")
        first = [full_term.index(label) for label in term]
        others = [t for j, t in enumerate(terms) if j != i]
        available = set(out).union(*others) if others else set(out)
        kept = [label for label in term if label in available]
        if not others and kept == out:
            g = dY
        else:
            spec = ",".join("".join(t) for t in [out, *others]) + "->" + "".join(kept)
            g = b.Einsum(dY, *[x for j, x in enumerate(ctx.node.input) if j != i], equation=spec)
        if kept != term:
            if "..." in term:
                raise ctx.fail("Einsum gradient with both an ellipsis and labels summed out of one operand is not supported")
            shape = ctx.shape_of(X) if term == full_term else b.Gather(ctx.shape_of(X), ctx.ints(first), axis=0)
            g = b.Expand(b.Unsqueeze(g, ctx.ints([k for k, label in enumerate(term) if label not in available])), shape)
        if term != full_term:
            g = _onto_diagonal(ctx, g, term, full_term, X)
        grads.append(g)
    return tuple(grads)


def _onto_diagonal(ctx, g: str, term: list[str], full_term: list[str], X: str) -> str:
    """dX for an operand read along a diagonal: ``g`` (labelled ``term``, each label once) times
    an identity matrix for every repeat of a label, which is zero off the diagonal."""
    b = ctx.b
    letters = iter(c for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in set(full_term) | set(term))
    renamed, eyes, eye_terms, seen = [], [], [], set()
    for position, label in enumerate(full_term):
        if label not in seen:
            seen.add(label)
            renamed.append(label)
            continue
        fresh = next(letters)
        size = b.Slice(ctx.shape_of(X), ctx.ints([position]), ctx.ints([position + 1]))
        square = b.ConstantOfShape(b.Concat(size, size, axis=0), value=np.zeros(1, dtype=ctx.dtype(X)))
        eyes.append(b.EyeLike(square))
        eye_terms.append(label + fresh)
        renamed.append(fresh)
    spec = ",".join(["".join(term), *eye_terms]) + "->" + "".join(renamed)
    return b.Einsum(g, *eyes, equation=spec)


def _parse_einsum(ctx, equation: str) -> tuple[list[list[str]], list[str]]:
    """Operand terms and output term as label lists; '...' is one label."""
    equation = equation.replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    terms = [_labels(t) for t in lhs.split(",")]
    if "->" not in equation:  # implicit output: labels seen once, sorted, ellipsis first
        flat = [label for t in terms for label in t]
        rhs_labels = (["..."] if "..." in flat else []) + sorted(x for x in set(flat) if x != "..." and flat.count(x) == 1)
    else:
        rhs_labels = _labels(rhs)
    ranks = {ctx.rank(x) - (len(t) - 1) for t, x in zip(terms, ctx.node.input) if "..." in t}
    if len(ranks) > 1 and any("..." in t and t[0] != "..." for t in terms):
        raise ctx.fail("Einsum gradient needs ellipses of equal rank unless they lead every term")
    return terms, rhs_labels


def _labels(term: str) -> list[str]:
    head, dots, tail = term.partition("...")
    return [*head, *(["..."] if dots else []), *tail]
