"""One GRU time step (linear_before_reset, as PyTorch exports it) and its gradient as single calls:
the arithmetic of the per-step nodes that odt_ops/ir/recurrent.py unrolls a GRU into (and of their
gradient rules), one line per node, with the same operands and layouts (see lstm_cell.py: the same
bits as the nodes; only exact operations write into a slice of a joined result; float32 and float64
run the activations and their gradients as bare ufuncs).
"""
from __future__ import annotations

import numpy as np

from odt_ops.kernels.lstm_cell import Kernel, activations, recurrent_product, sigmoid_grad_into, tanh_grad_into
from odt_ops.kernels.products import ProductRecord

# the values of one step, in the order the fused forward node lists them as outputs
CELL_VALUES = ("product", "x_gates", "x_candidate", "h_gates", "h_candidate", "gates", "sigmoid", "update", "reset",
               "inner", "reset_inner", "pre", "candidate", "keep_new", "new", "kept", "hidden")
# the values of one step's gradient, in the order the fused gradient node lists them as outputs
GRAD_VALUES = ("d_update_kept", "d_previous", "d_keep_new", "d_candidate", "d_keep_new_neg", "d_pre", "d_reset",
               "d_inner", "d_update", "d_gate_pair", "d_gates", "d_product", "d_x")


def gru_cell(x, h, RT, recurrent_bias, one, RT_rows=None, *, hidden: int, record: ProductRecord, sigmoid: Kernel,
             tanh: Kernel) -> tuple:
    """z, r = sigmoid(x_zr + (h @ RT)_zr) split; n = tanh(x_n + r * ((h @ RT)_n + Rb_n));
    h' = (1 - z) * n + z * h. Returns CELL_VALUES. ``RT_rows``: as lstm_cell's."""
    H = hidden
    product = recurrent_product(record, h, RT, RT_rows)
    x_gates, x_candidate = x[:, :2 * H], x[:, 2 * H:]  # Split's views
    h_gates, h_candidate = product[:, :2 * H], product[:, 2 * H:]
    gates = np.add(x_gates, h_gates)
    sig, tnh = activations(gates.dtype, sigmoid, tanh)
    s = sig(gates)
    update, reset = s[:, :H], s[:, H:]
    inner = np.add(h_candidate, recurrent_bias)
    reset_inner = np.multiply(reset, inner)
    pre = np.add(x_candidate, reset_inner)
    candidate = tnh(pre)
    keep_new = np.subtract(one, update)
    new = np.multiply(keep_new, candidate)
    kept = np.multiply(update, h)
    return (product, x_gates, x_candidate, h_gates, h_candidate, gates, s, update, reset, inner, reset_inner, pre,
            candidate, keep_new, new, kept, np.add(new, kept))


def gru_cell_grad(d_hidden, h, update, candidate, keep_new, inner, reset, s, one_candidate, one_gates,
                  *, carry: bool, tanh_grad: Kernel, sigmoid_grad: Kernel) -> tuple:
    """The gradient rules' nodes for one step, from d h' to d of the gate pre-activations, of the
    recurrent product ([d gates, d inner]) and of the input projection ([d gates, d pre]); d h (the
    previous state's share through z * h, ``carry``) when the graph wants it. Returns GRAD_VALUES."""
    H = candidate.shape[-1]
    if d_hidden.ndim != 2 or any(v is not None and v.dtype != d_hidden.dtype for v in (h, update, candidate, keep_new, inner, reset, s)):
        raise ValueError("the fused GRU cell gradient needs 2-D operands of one dtype")
    # the Concats' results built in place: each result lands in the slice Concat would copy it to
    batch, dtype = d_hidden.shape[0], d_hidden.dtype
    d_gate_pair = np.empty((batch, 2 * H), dtype=dtype)
    d_product = np.empty((batch, 3 * H), dtype=dtype)  # [d gates, d inner]
    d_x = np.empty((batch, 3 * H), dtype=dtype)  # [d gates, d pre]
    d_update_kept = np.multiply(d_hidden, h)
    d_previous = np.multiply(d_hidden, update) if carry else None
    d_keep_new = np.multiply(d_hidden, candidate)
    d_candidate = np.multiply(d_hidden, keep_new)
    d_keep_new_neg = np.negative(d_keep_new)  # Sub(1, z)'s gradient for z
    d_pre = tanh_grad_into(d_candidate, candidate, one_candidate, d_x[:, 2 * H:], tanh_grad)
    d_reset = np.multiply(d_pre, inner, out=d_gate_pair[:, H:])
    d_inner = np.multiply(d_pre, reset, out=d_product[:, 2 * H:])
    d_update = np.add(d_update_kept, d_keep_new_neg, out=d_gate_pair[:, :H])  # Sum of z's two uses
    d_gates = sigmoid_grad_into(d_gate_pair, s, one_gates, d_product[:, :2 * H], sigmoid_grad)
    d_x[:, :2 * H] = d_gates
    return (d_update_kept, d_previous, d_keep_new, d_candidate, d_keep_new_neg, d_pre, d_reset, d_inner, d_update,
            d_gate_pair, d_gates, d_product, d_x)
