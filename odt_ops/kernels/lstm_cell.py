"""One LSTM time step and its gradient as single calls: the arithmetic of the per-step nodes that
odt_ops/ir/recurrent.py unrolls an LSTM into (and of their gradient rules), one line per node.

The plan's fused cell nodes (runtime/fusion/recurrent.py) run these instead of a dozen kernels on
[batch, 4*hidden] arrays, where the dispatch cost more than the arithmetic. They give the same
bits as the nodes: every line applies the same ufunc or kernel to the same operands, with the same
memory layout wherever it could matter (tanh and exp take SIMD or scalar paths by the strides of
their operands; products, sums and differences are exact in any layout, so those may be written
straight into a slice of the array a Concat would have built).

For float32 and float64 (``fast``) the activations and their gradients are called as the bare
ufunc sequences their kernels run (elementwise._sigmoid, np.tanh; activation_grad's three ufuncs)
without the kernels' wrappers, which on these small arrays cost about as much as the arithmetic
(they only ever split large contiguous arrays across threads, which gives the same bits); other
dtypes go through the kernels.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from odt_ops.kernels.elementwise import _sigmoid
from odt_ops.kernels.products import ProductRecord

Kernel = Callable[..., tuple]

FAST = (np.dtype(np.float32), np.dtype(np.float64))

# the values of one step, in the order the fused forward node lists them as outputs
CELL_VALUES = ("product", "gates", "iof", "candidate", "sigmoid", "input", "output", "forget", "tanh_candidate",
               "kept_input", "kept_state", "state", "tanh_state", "hidden")
# the values of one step's gradient, in the order the fused gradient node lists them as outputs
GRAD_VALUES = ("d_recurrent", "d_hidden", "d_output", "d_tanh_state", "d_state_from_hidden", "d_state", "d_forget",
               "d_previous_state", "d_input", "d_tanh_candidate", "d_candidate", "d_iof", "d_iof_pre", "d_gates")


def activations(dtype: np.dtype, sigmoid: Kernel, tanh: Kernel) -> tuple[Callable, Callable]:
    """(sigmoid, tanh) as one-array functions: the bare ufunc sequences for FAST dtypes, else the kernels."""
    if dtype in FAST:
        return _sigmoid, np.tanh
    return (lambda X: sigmoid(X)[0]), (lambda X: tanh(X)[0])


# (shapes, strides, dtype) of h and RT -> whether h @ RT on RT's row-major copy gives the bits of the
# product as the unrolled graph's MatMul computes it: probed once per key for the whole process
_SAME_BITS: dict[tuple, bool] = {}


def recurrent_product(record: ProductRecord, h: np.ndarray, RT: np.ndarray, RT_rows: np.ndarray | None) -> np.ndarray:
    """h @ RT as the unrolled graph's MatMul node computes it (through ``record``, the formulation the
    rule chose), or np.matmul on ``RT_rows`` (RT's row-major copy, made once per sequence) where a
    probe has shown that both give the same bits for these shapes and layouts.

    RT is a transposed view of the recurrent weight R; OpenBLAS (0.3.31, SkylakeX kernels on Zen 4)
    takes 14 us for [16, 64] @ that view of [256, 64] and 5.7 us for the same product on a row-major
    copy. Both sum each output's K products in the same order there, so they agree bit for bit; the
    probe (seeded random operands of the same shapes and layouts, compared with np.array_equal) checks
    that on the machine that runs it instead of assuming it, and otherwise the product stays as the
    graph computes it."""
    if RT_rows is None or not h.flags.c_contiguous or h.dtype not in FAST or RT.dtype != h.dtype or h.ndim != 2:
        return record(h, RT)
    key = (h.shape, RT.shape, RT.strides, h.dtype.str)
    same = _SAME_BITS.get(key)
    if same is None:
        same = _SAME_BITS[key] = _same_bits(record, h, RT)
    return np.matmul(h, RT_rows) if same else record(h, RT)


def _same_bits(record: ProductRecord, h: np.ndarray, RT: np.ndarray) -> bool:
    rng = np.random.default_rng(0)
    probe_h = rng.standard_normal(h.shape).astype(h.dtype)
    probe_RT = np.empty_like(RT)  # RT's layout (a transposed view's copy is column-major too)
    probe_RT[...] = rng.standard_normal(RT.shape)
    if probe_RT.strides != RT.strides:  # a layout empty_like does not keep: leave the product as it is
        return False
    return bool(np.array_equal(record(probe_h, probe_RT), np.matmul(probe_h, np.ascontiguousarray(probe_RT))))


def tanh_grad_into(dY, Y, one, out, tanh_grad: Kernel):
    """TanhGrad(dY, Y, one) written into ``out``: activation_grad's ufuncs t = Y * Y; t = 1 - t; dY * t."""
    return _grad_into(dY, Y, one, out, tanh_grad, lambda t: (np.multiply(Y, Y, out=t), np.subtract(one, t, out=t)))


def sigmoid_grad_into(dY, Y, one, out, sigmoid_grad: Kernel):
    """SigmoidGrad(dY, Y, one) written into ``out``: activation_grad's ufuncs t = 1 - Y; t = Y * t; dY * t."""
    return _grad_into(dY, Y, one, out, sigmoid_grad, lambda t: (np.subtract(one, Y, out=t), np.multiply(Y, t, out=t)))


def _grad_into(dY, Y, one, out, kernel: Kernel, factor: Callable[[np.ndarray], object]):
    """dY * factor(Y) into ``out``: ``factor`` writes the activation's derivative into its scratch
    array with the kernel's ufuncs in the kernel's order (FAST dtypes; others run the kernel)."""
    if Y.dtype not in FAST or one.dtype != Y.dtype:
        np.copyto(out, kernel(dY, Y, one)[0])
        return out
    t = np.empty_like(Y)
    factor(t)
    return np.multiply(dY, t, out=out)


def lstm_cell(x, h, RT, c, RT_rows=None, *, hidden: int, record: ProductRecord, sigmoid: Kernel, tanh: Kernel) -> tuple:
    """gates = x + h @ RT; i, o, f = sigmoid(gates[:, :3H]) split; c' = i * tanh(gates[:, 3H:]) + f * c;
    h' = o * tanh(c'). Returns CELL_VALUES (the unrolled graph's order: i, o, f share one sigmoid).
    ``RT_rows``: RT's row-major copy, if the graph made one (see recurrent_product)."""
    H = hidden
    product = recurrent_product(record, h, RT, RT_rows)
    gates = np.add(x, product)
    sig, tnh = activations(gates.dtype, sigmoid, tanh)
    iof, candidate = gates[:, :3 * H], gates[:, 3 * H:]  # Split's views
    s = sig(iof)
    i, o, f = s[:, :H], s[:, H:2 * H], s[:, 2 * H:]
    tc = tnh(candidate)  # on the strided view, as the Tanh node gets it
    kept_input = np.multiply(i, tc)
    kept_state = np.multiply(f, c)
    state = np.add(kept_input, kept_state)
    tanh_state = tnh(state)
    return product, gates, iof, candidate, s, i, o, f, tc, kept_input, kept_state, state, tanh_state, np.multiply(o, tanh_state)


def lstm_cell_grad(dY, d_next, RT, d_hidden, d_state_in, tanh_state, o, tc, i, f, c, s, one_state, one_candidate, one_gates,
                   *, gemm: Kernel | None, carry: bool, tanh_grad: Kernel, sigmoid_grad: Kernel) -> tuple:
    """The gradient rules' nodes for one step, from d h' (given, or Gemm(d gates of the next step, RT)
    plus this step's dY) to d gates = [SigmoidGrad(d i, d o, d f), TanhGrad(d candidate)]; d c (the
    previous state's share, ``carry``) when the graph wants it. Returns GRAD_VALUES."""
    H = tc.shape[-1]
    d_recurrent = None
    if gemm is not None:
        d_recurrent = gemm(d_next, RT)[0]
        d_hidden = d_recurrent if dY is None else np.add(dY, d_recurrent)  # Sum(dY, Gemm)
    dtype = d_hidden.dtype
    if any(v is not None and v.dtype != dtype for v in (tanh_state, o, tc, i, f, c, s)) or d_hidden.ndim != 2:
        raise ValueError("the fused LSTM cell gradient needs 2-D operands of one dtype")
    batch = d_hidden.shape[0]
    # both Concats' results built in place: each value lands in the slice Concat would copy it to
    d_gates = np.empty((batch, 4 * H), dtype=dtype)
    d_iof = np.empty((batch, 3 * H), dtype=dtype)
    d_output = np.multiply(d_hidden, tanh_state, out=d_iof[:, H:2 * H])
    d_tanh_state = np.multiply(d_hidden, o)
    d_from_hidden = tanh_grad_into(d_tanh_state, tanh_state, one_state, np.empty_like(d_tanh_state), tanh_grad)
    d_state = d_from_hidden if d_state_in is None else np.add(d_state_in, d_from_hidden)  # Sum(carried, TanhGrad)
    d_input = np.multiply(d_state, tc, out=d_iof[:, :H])
    d_forget = np.multiply(d_state, c, out=d_iof[:, 2 * H:])
    d_previous_state = np.multiply(d_state, f) if carry else None
    d_tanh_candidate = np.multiply(d_state, i)
    d_candidate = tanh_grad_into(d_tanh_candidate, tc, one_candidate, d_gates[:, 3 * H:], tanh_grad)
    d_iof_pre = sigmoid_grad_into(d_iof, s, one_gates, d_gates[:, :3 * H], sigmoid_grad)
    return (d_recurrent, d_hidden, d_output, d_tanh_state, d_from_hidden, d_state, d_forget, d_previous_state, d_input,
            d_tanh_candidate, d_candidate, d_iof, d_iof_pre, d_gates)
