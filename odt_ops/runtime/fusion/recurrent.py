"""An unrolled LSTM's or GRU's time steps, forward and gradient, as one node per step each.

odt_ops/ir/recurrent.py unrolls an LSTM into eleven nodes per step (MatMul, Add, two Splits, a
Sigmoid over the three gates, two Tanh, three Mul and an Add), and the gradient rules (with the
activation_grad fusion) add sixteen more per step: an LSTM of 20 steps made some 580 plan nodes
on [batch, 4*hidden] arrays (a GRU: fourteen and thirteen per step). The pass matches each step's
nodes by structure and puts one fused node in their place that runs the same arithmetic
(odt_ops/kernels/lstm_cell.py, gru_cell.py) without a kernel call, a plan line and a freed
value per node: the benchmark's lstm-adamw plan has 124 nodes instead of 580. (What that saves is
only the dispatch, some 6% of its train step at batch 16; the rest is the ufuncs and small
products themselves, which the bit-for-bit contract keeps as they are.) The pass also gives the
cells of one direction a row-major copy of R^T, made once (a RowMajor node): OpenBLAS multiplies
the step's [batch, H] state by the Transpose node's view of R at less than half the speed, and the
cells use the copy only where a probe shows it gives the same bits (kernels/lstm_cell.py,
recurrent_product). Each fused node lists
every value of its nodes as an output, in a fixed order, with "" for the values nothing outside
reads, so the rest of the graph (the next step, the gradient, the Concats of all steps) reads
them under the same names.

Matched: the cells that recurrent.py emits for LSTM's default activations (Sigmoid, Tanh, Tanh)
without peepholes, input_forget or clip, and for GRU's (Sigmoid, Tanh) with linear_before_reset
and a bias (PyTorch's GRU), without clip; each with a state coming in (every step but the first
of one without initial_h / initial_c). Any other step stays as written.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import onnx

from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels import gru_cell as gru
from odt_ops.kernels.lstm_cell import CELL_VALUES, GRAD_VALUES, lstm_cell, lstm_cell_grad
from odt_ops.kernels.products import ProductRecord
from odt_ops.runtime.fusion.graph import DOMAIN, STANDARD, Graph, bind, fused_node, fused_op, fusion, kernel_of


class _Walk:
    """Producer and consumer lookups for one match, remembering the nodes they pass."""

    def __init__(self, g: Graph):
        self.g = g
        self.nodes: list[onnx.NodeProto] = []

    def keep(self, node: onnx.NodeProto | None) -> onnx.NodeProto:
        if node is None:
            raise LookupError
        if all(node is not n for n in self.nodes):
            self.nodes.append(node)
        return node

    def producer(self, name: str, op_type: str, domains: tuple[str, ...] = STANDARD) -> onnx.NodeProto:
        return self.keep(self.g.producer(name, op_type, domains))

    def reader(self, name: str, op_type: str, test: Callable[[onnx.NodeProto], bool]) -> onnx.NodeProto:
        """The one ``op_type`` node reading ``name`` that passes ``test``."""
        found = [n for n in self.g.consumers(name) if n.op_type == op_type and n.domain in STANDARD and test(n)]
        if len(found) != 1:
            raise LookupError
        return self.keep(found[0])


def _inputs(node: onnx.NodeProto, count: int) -> list[str]:
    if len(node.input) != count or not all(node.input):
        raise LookupError
    return list(node.input)


def _other(node: onnx.NodeProto, name: str) -> str:
    """The input of a two-input (commutative) node that is not ``name``."""
    a, b = _inputs(node, 2)
    if (a == name) == (b == name):
        raise LookupError
    return b if a == name else a


def _split_sizes(g: Graph, split: onnx.NodeProto, parts: int) -> list[int]:
    """The sizes of a Split of a 2-D value along axis 1 into ``parts`` (raises LookupError otherwise)."""
    sizes = g.ints(split, 1, "split")
    if len(split.output) != parts or sizes is None or len(sizes) != parts or node_attributes(split).get("axis", 0) not in (1, -1):
        raise LookupError
    return sizes


def _concat_on_columns(node: onnx.NodeProto, count: int) -> list[str]:
    if node_attributes(node).get("axis") not in (1, -1):
        raise LookupError
    return _inputs(node, count)


def _outputs(g: Graph, nodes: list[onnx.NodeProto], values: dict[str, str], order: tuple[str, ...]) -> list[str]:
    """Each value in ``order`` by its name in the graph, or "" where nothing outside ``nodes`` (nor
    the caller) reads it."""
    inside = {id(n) for n in nodes}
    wanted = {name for name in values.values()
              if name and (name in g.keep or any(id(r) not in inside for r in g.consumers(name)))}
    return [values.get(role, "") if values.get(role, "") in wanted else "" for role in order]


# ---------------------------------------------------------------- LSTM: the forward step


def _match_lstm_cell(g: Graph, sigmoid: onnx.NodeProto):
    """(nodes, inputs, values by CELL_VALUES role, attributes) if ``sigmoid`` is the gate
    activation of an unrolled LSTM step, else None."""
    walk = _Walk(g)
    try:
        walk.keep(sigmoid)
        cut = walk.producer(sigmoid.input[0], "Split")
        three, H = _split_sizes(g, cut, 2)
        iof, candidate = cut.output
        if iof != sigmoid.input[0] or three != 3 * H:
            raise LookupError
        gates = cut.input[0]
        add = walk.producer(gates, "Add")
        a, b = _inputs(add, 2)
        product = walk.producer(b, "MatMul") if g.producer(b, "MatMul") else walk.producer(a, "MatMul")
        x = _other(add, product.output[0])
        h, RT = _inputs(product, 2)
        s = sigmoid.output[0]
        gate_cut = walk.reader(s, "Split", lambda n: n.input[0] == s)
        if _split_sizes(g, gate_cut, 3) != [H, H, H]:
            raise LookupError
        i, o, f = gate_cut.output
        tanh_candidate = walk.reader(candidate, "Tanh", lambda n: True)
        tc = tanh_candidate.output[0]
        kept_input = walk.reader(tc, "Mul", lambda n: _other(n, tc) == i)
        state_add = walk.reader(kept_input.output[0], "Add", lambda n: True)
        kept_state = walk.producer(_other(state_add, kept_input.output[0]), "Mul")
        c = _other(kept_state, f)
        state = state_add.output[0]
        tanh_state = walk.reader(state, "Tanh", lambda n: True)
        output = walk.reader(tanh_state.output[0], "Mul", lambda n: _other(n, tanh_state.output[0]) == o)
    except LookupError:
        return None
    named = (product.output[0], gates, iof, candidate, s, i, o, f, tc, kept_input.output[0], kept_state.output[0],
             state, tanh_state.output[0], output.output[0])
    return walk.nodes, [x, h, RT, c], dict(zip(CELL_VALUES, named)), {"hidden_size": H}


def _product(op_type: str, opset: int, **attrs) -> Callable[..., tuple]:
    """The MatMul or Gemm kernel with a record of its formulations (kernels/products.py), as the plan binds
    that node: a product's formulation is chosen once per shape for the whole process, so the fused
    node multiplies as the unrolled graph's node does (both meet the same shapes)."""
    return functools.partial(kernel_of(op_type, opset, **attrs), _products=ProductRecord())


@fused_op("LSTMCell")
def _lstm_cell(attrs: dict, opset: int) -> Callable[..., tuple]:
    record, sigmoid, tanh = ProductRecord(), kernel_of("Sigmoid", opset), kernel_of("Tanh", opset)
    hidden = int(attrs["hidden_size"])
    return lambda *args: lstm_cell(*args, hidden=hidden, record=record, sigmoid=sigmoid, tanh=tanh)


@fused_op("RowMajor")
def _row_major(attrs: dict, opset: int) -> Callable[..., tuple]:
    return lambda X: (np.ascontiguousarray(X),)


def _row_major_weights(g: Graph, op_type: str, inputs: int) -> bool:
    """Give each ``op_type`` cell of ``inputs`` inputs one more: a row-major copy of its RT (input 2, a
    transposed view of R), made by one RowMajor node per RT for all the steps that read it; the cells
    multiply on it where that gives the same bits (kernels/lstm_cell.py, recurrent_product)."""
    position = 2
    cells = [n for n in g.nodes if n.op_type == op_type and n.domain == DOMAIN and len(n.input) == inputs]
    if not cells:
        return False
    copies: dict[str, str] = {}
    added = []
    taken = {name for n in g.nodes for name in (*n.input, *n.output)}
    for cell in cells:
        RT = cell.input[position]
        if RT not in copies:
            name = f"{RT}/row_major"
            while name in taken:
                name += "_"
            taken.add(name)
            copies[RT] = name
            added.append(fused_node("RowMajor", [RT], [name], f"fused/{name}"))
        cell.input.append(copies[RT])
    g.rewrite([*g.nodes, *added])  # the plan sorts the nodes again
    return True


# ---------------------------------------------------------------- LSTM: the gradient of a step


def _match_lstm_cell_grad(g: Graph, gates_concat: onnx.NodeProto):
    """(nodes, inputs, values by GRAD_VALUES role, attributes) if ``gates_concat`` joins an unrolled
    LSTM step's gate gradients (Concat(SigmoidGrad(Concat(d i, d o, d f)), TanhGrad(d candidate))), else None."""
    walk = _Walk(g)
    fused = (DOMAIN,)
    try:
        walk.keep(gates_concat)
        pre, d_candidate = _concat_on_columns(gates_concat, 2)
        sigmoid_grad = walk.producer(pre, "SigmoidGrad", fused)
        candidate_grad = walk.producer(d_candidate, "TanhGrad", fused)
        d_iof, s, one_gates = _inputs(sigmoid_grad, 3)
        d_tanh_candidate, tc, one_candidate = _inputs(candidate_grad, 3)
        iof_concat = walk.producer(d_iof, "Concat")
        d_input, d_output, d_forget = _concat_on_columns(iof_concat, 3)
        input_mul, output_mul, forget_mul = (walk.producer(v, "Mul") for v in (d_input, d_output, d_forget))
        candidate_mul = walk.producer(d_tanh_candidate, "Mul")
        d_state = input_mul.input[0]
        if [input_mul.input[1], forget_mul.input[0], candidate_mul.input[0]] != [tc, d_state, d_state]:
            raise LookupError
        c, i = forget_mul.input[1], candidate_mul.input[1]
        d_hidden, tanh_state = _inputs(output_mul, 2)
        values = {"d_output": d_output, "d_forget": d_forget, "d_input": d_input, "d_tanh_candidate": d_tanh_candidate,
                  "d_candidate": d_candidate, "d_iof": d_iof, "d_iof_pre": pre, "d_gates": gates_concat.output[0],
                  "d_state": d_state}
        # d c = TanhGrad(d h * o) [+ the next step's share]
        carried = g.producer(d_state, "Sum")
        if carried is not None:
            walk.keep(carried)
            d_state_in, d_from_hidden = _inputs(carried, 2)
        else:
            d_state_in, d_from_hidden = "", d_state
        state_grad = walk.producer(d_from_hidden, "TanhGrad", fused)
        d_tanh_state, tanh_state_again, one_state = _inputs(state_grad, 3)
        hidden_mul = walk.producer(d_tanh_state, "Mul")
        if tanh_state_again != tanh_state or hidden_mul.input[0] != d_hidden:
            raise LookupError
        o = _inputs(hidden_mul, 2)[1]
        values.update(d_from_hidden=d_from_hidden, d_tanh_state=d_tanh_state, d_hidden=d_hidden)
        # the previous state's share d c * f, if the graph wants it
        carry = [n for n in g.consumers(d_state) if n.op_type == "Mul" and n.domain in STANDARD and n.input[0] == d_state
                 and all(n is not m for m in walk.nodes)]
        f = ""
        if len(carry) == 1:
            f = _inputs(walk.keep(carry[0]), 2)[1]
            values["d_previous_state"] = carry[0].output[0]
        dY, d_next, RT, gemm_attrs = _recurrent_head(g, walk, d_hidden, values)
    except LookupError:
        return None
    inputs = [dY, d_next, RT, "" if RT else d_hidden, d_state_in, tanh_state, o, tc, i, f, c, s, one_state,
              one_candidate, one_gates]
    return walk.nodes, inputs, values, {"carry": int(bool(f)), **gemm_attrs}


def _recurrent_head(g: Graph, walk: _Walk, d_hidden: str, values: dict[str, str]):
    """d h = [dY +] Gemm(d gates of the next step, RT): (dY or "", d gates, RT, Gemm attributes),
    or ("", "", "", {}) when d h comes from elsewhere (the last step)."""
    total = g.producer(d_hidden, "Sum")
    gemm_out, dY = d_hidden, ""
    if total is not None and len(total.input) == 2:
        a, b = _inputs(total, 2)
        gemm_out, dY = (b, a) if g.producer(b, "Gemm") else (a, b)
    gemm = g.producer(gemm_out, "Gemm")
    if gemm is None or len(gemm.input) != 2 or (total is not None and not dY):
        return "", "", "", {}
    if total is not None:
        walk.keep(total)
    walk.keep(gemm)
    values["d_recurrent"] = gemm_out
    attrs = node_attributes(gemm)
    d_next, RT = _inputs(gemm, 2)
    return dY, d_next, RT, {"trans_a": int(attrs.get("transA", 0)), "trans_b": int(attrs.get("transB", 0)),
                            "alpha": float(attrs.get("alpha", 1.0))}


def _activation_grads(opset: int) -> tuple[Callable[..., tuple], Callable[..., tuple]]:
    """TanhGrad and SigmoidGrad as the activation_grad fusion binds them: the same bits as its nodes."""
    tanh_grad, sigmoid_grad = (bind(fused_node(op, ["dY", "Y", "one"], ["dX"], op), opset) for op in ("TanhGrad", "SigmoidGrad"))
    return tanh_grad, sigmoid_grad


@fused_op("LSTMCellGrad")
def _lstm_cell_grad(attrs: dict, opset: int) -> Callable[..., tuple]:
    tanh_grad, sigmoid_grad = _activation_grads(opset)
    gemm = None
    if "trans_b" in attrs:
        gemm = _product("Gemm", opset, transA=int(attrs["trans_a"]), transB=int(attrs["trans_b"]), alpha=float(attrs["alpha"]))
    carry = bool(attrs["carry"])
    return lambda *args: lstm_cell_grad(*args, gemm=gemm, carry=carry, tanh_grad=tanh_grad, sigmoid_grad=sigmoid_grad)


# ---------------------------------------------------------------- LSTM: the pass


@fusion("lstm_cell")
def _lstm_cells(g: Graph) -> bool:
    """Every matched LSTM step -> one LSTMCell node; every matched step of its gradient -> one LSTMCellGrad
    (after activation_grad, whose SigmoidGrad and TanhGrad nodes it matches)."""
    return (_fuse_each(g, "Sigmoid", STANDARD, _match_lstm_cell, "LSTMCell", CELL_VALUES)
            | _row_major_weights(g, "LSTMCell", 4)
            | _fuse_each(g, "Concat", STANDARD, _match_lstm_cell_grad, "LSTMCellGrad", GRAD_VALUES))


def _fuse_each(g: Graph, anchor: str, domains: tuple[str, ...], match: Callable, op_type: str, order: tuple[str, ...]) -> bool:
    """Each ``anchor`` node that ``match`` places in a step -> that step's nodes as one ``op_type`` node."""
    changed = False
    for node in [n for n in g.nodes if n.op_type == anchor and n.domain in domains]:
        found = match(g, node)
        if found is not None:
            nodes, inputs, values, attrs = found
            fused = fused_node(op_type, inputs, _outputs(g, nodes, values, order), f"fused/{node.name or node.output[0]}", **attrs)
            changed = g.replace(nodes, fused) or changed
    return changed


# ---------------------------------------------------------------- GRU (linear_before_reset, PyTorch's)


def _match_gru_cell(g: Graph, sigmoid: onnx.NodeProto):
    """(nodes, inputs, values by gru.CELL_VALUES role, attributes) if ``sigmoid`` is the z and r
    activation of an unrolled GRU step with linear_before_reset and a recurrent bias, else None."""
    walk = _Walk(g)
    try:
        walk.keep(sigmoid)
        add = walk.producer(sigmoid.input[0], "Add")
        a, b = _inputs(add, 2)
        from_product = [v for v in (a, b) if (s := g.producer(v, "Split")) is not None and g.producer(s.input[0], "MatMul")]
        if len(from_product) != 1:
            raise LookupError
        h_cut = walk.producer(from_product[0], "Split")
        x_cut = walk.producer(_other(add, from_product[0]), "Split")
        two, H = _split_sizes(g, h_cut, 2)
        if two != 2 * H or _split_sizes(g, x_cut, 2) != [2 * H, H] or h_cut.output[0] not in (a, b) or x_cut.output[0] not in (a, b):
            raise LookupError
        product = walk.producer(h_cut.input[0], "MatMul")
        h, RT = _inputs(product, 2)
        x = x_cut.input[0]
        (x_gates, x_candidate), (h_gates, h_candidate) = x_cut.output, h_cut.output
        s = sigmoid.output[0]
        pair_cut = walk.reader(s, "Split", lambda n: n.input[0] == s)
        if _split_sizes(g, pair_cut, 2) != [H, H]:
            raise LookupError
        update, reset = pair_cut.output
        inner_add = walk.reader(h_candidate, "Add", lambda n: True)
        inner = inner_add.output[0]
        recurrent_bias = _other(inner_add, h_candidate)
        reset_inner = walk.reader(inner, "Mul", lambda n: _other(n, inner) == reset)
        pre_add = walk.reader(reset_inner.output[0], "Add", lambda n: _other(n, reset_inner.output[0]) == x_candidate)
        tanh = walk.reader(pre_add.output[0], "Tanh", lambda n: True)
        candidate = tanh.output[0]
        keep_new = walk.reader(update, "Sub", lambda n: list(n.input[1:]) == [update] and g.is_one(n.input[0]))
        new = walk.reader(keep_new.output[0], "Mul", lambda n: _other(n, keep_new.output[0]) == candidate)
        kept = walk.reader(update, "Mul", lambda n: _other(n, update) == h)
        output = walk.reader(new.output[0], "Add", lambda n: _other(n, new.output[0]) == kept.output[0])
    except LookupError:
        return None
    named = (product.output[0], x_gates, x_candidate, h_gates, h_candidate, add.output[0], s, update, reset, inner,
             reset_inner.output[0], pre_add.output[0], candidate, keep_new.output[0], new.output[0], kept.output[0],
             output.output[0])
    return walk.nodes, [x, h, RT, recurrent_bias, keep_new.input[0]], dict(zip(gru.CELL_VALUES, named)), {"hidden_size": H}


@fused_op("GRUCell")
def _gru_cell(attrs: dict, opset: int) -> Callable[..., tuple]:
    record, sigmoid, tanh = ProductRecord(), kernel_of("Sigmoid", opset), kernel_of("Tanh", opset)
    hidden = int(attrs["hidden_size"])
    return lambda *args: gru.gru_cell(*args, hidden=hidden, record=record, sigmoid=sigmoid, tanh=tanh)


def _match_gru_cell_grad(g: Graph, sigmoid_grad: onnx.NodeProto):
    """(nodes, inputs, values by gru.GRAD_VALUES role, attributes) if ``sigmoid_grad`` is the z and r
    gradient of an unrolled GRU step (from d h' to the Concats that feed the recurrent Gemm and
    the input projection's gradient), else None."""
    walk = _Walk(g)
    try:
        walk.keep(sigmoid_grad)
        d_gate_pair, s, one_gates = _inputs(sigmoid_grad, 3)
        pair = walk.producer(d_gate_pair, "Concat")
        d_update, d_reset = _concat_on_columns(pair, 2)
        total = walk.producer(d_update, "Sum")
        a, b = _inputs(total, 2)
        negated = walk.producer(b if g.producer(b, "Neg") else a, "Neg")
        update_kept = walk.producer(_other(total, negated.output[0]), "Mul")
        keep_new_mul = walk.producer(negated.input[0], "Mul")
        d_hidden, h = _inputs(update_kept, 2)
        candidate = keep_new_mul.input[1]
        reset_mul = walk.producer(d_reset, "Mul")
        d_pre, inner = _inputs(reset_mul, 2)
        candidate_grad = walk.producer(d_pre, "TanhGrad", (DOMAIN,))
        d_candidate, candidate_again, one_candidate = _inputs(candidate_grad, 3)
        candidate_mul = walk.producer(d_candidate, "Mul")
        if keep_new_mul.input[0] != d_hidden or candidate_again != candidate or candidate_mul.input[0] != d_hidden:
            raise LookupError
        keep_new = candidate_mul.input[1]
        inner_mul = walk.reader(d_pre, "Mul", lambda n: n.input[0] == d_pre and n is not reset_mul)
        reset = inner_mul.input[1]
        d_gates = sigmoid_grad.output[0]
        d_inner = inner_mul.output[0]
        to_product = walk.reader(d_gates, "Concat", lambda n: list(n.input) == [d_gates, d_inner])
        to_x = walk.reader(d_gates, "Concat", lambda n: list(n.input) == [d_gates, d_pre])
        _concat_on_columns(to_product, 2), _concat_on_columns(to_x, 2)
        carry = [n for n in g.consumers(d_hidden) if n.op_type == "Mul" and n.domain in STANDARD and n.input[0] == d_hidden
                 and all(n is not m for m in walk.nodes)]
        update = ""
        values = {"d_update_kept": update_kept.output[0], "d_keep_new": keep_new_mul.output[0], "d_candidate": d_candidate,
                  "d_keep_new_neg": negated.output[0], "d_pre": d_pre, "d_reset": d_reset, "d_inner": d_inner,
                  "d_update": d_update, "d_gate_pair": d_gate_pair, "d_gates": d_gates,
                  "d_product": to_product.output[0], "d_x": to_x.output[0]}
        if len(carry) == 1:
            update = _inputs(walk.keep(carry[0]), 2)[1]
            values["d_previous"] = carry[0].output[0]
    except LookupError:
        return None
    inputs = [d_hidden, h, update, candidate, keep_new, inner, reset, s, one_candidate, one_gates]
    return walk.nodes, inputs, values, {"carry": int(bool(update))}


@fused_op("GRUCellGrad")
def _gru_cell_grad(attrs: dict, opset: int) -> Callable[..., tuple]:
    tanh_grad, sigmoid_grad = _activation_grads(opset)
    carry = bool(attrs["carry"])
    return lambda *args: gru.gru_cell_grad(*args, carry=carry, tanh_grad=tanh_grad, sigmoid_grad=sigmoid_grad)


@fusion("gru_cell")
def _gru_cells(g: Graph) -> bool:
    """Every matched GRU step -> one GRUCell node; every matched step of its gradient -> one GRUCellGrad
    (after activation_grad, whose SigmoidGrad and TanhGrad nodes it matches)."""
    return (_fuse_each(g, "Sigmoid", STANDARD, _match_gru_cell, "GRUCell", gru.CELL_VALUES)
            | _row_major_weights(g, "GRUCell", 5)
            | _fuse_each(g, "SigmoidGrad", (DOMAIN,), _match_gru_cell_grad, "GRUCellGrad", gru.GRAD_VALUES))
