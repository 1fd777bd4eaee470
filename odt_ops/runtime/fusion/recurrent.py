"""An unrolled LSTM's time steps, forward and gradient, as one node per step each.

odt_ops/ir/recurrent.py unrolls an LSTM into eleven nodes per step (MatMul, Add, two Splits, a
Sigmoid over the three gates, two Tanh, three Mul and an Add), and the gradient rules (with the
activation_grad fusion) add sixteen more per step: an LSTM of 20 steps made some 580 plan nodes
on [batch, 4*hidden] arrays, where dispatching a kernel cost more than its arithmetic. The pass
matches each step's nodes by structure and puts one fused node in their place that runs the same
arithmetic (odt_ops/kernels/lstm_cell.py). Each fused node lists every value of its nodes as an
output, in a fixed order, with "" for the values nothing outside reads, so the rest of the
graph (the next step, the gradient, the Concats of all steps) reads them under the same names.

Matched: the cell that recurrent.py emits for LSTM's default activations (Sigmoid, Tanh, Tanh)
without peepholes, input_forget or clip, with a state coming in (every step but the first of
one without initial_h / initial_c); any other step stays as written.
"""
from __future__ import annotations

from collections.abc import Callable

import onnx

from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels.lstm_cell import CELL_VALUES, GRAD_VALUES, lstm_cell, lstm_cell_grad
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


# ---------------------------------------------------------------- the forward step


def _match_cell(g: Graph, sigmoid: onnx.NodeProto):
    """(nodes, inputs, values by CELL_VALUES role, hidden size) if ``sigmoid`` is the gate
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
    return walk.nodes, [x, h, RT, c], dict(zip(CELL_VALUES, named)), H


@fused_op("LSTMCell")
def _lstm_cell(attrs: dict, opset: int) -> Callable[..., tuple]:
    matmul, sigmoid, tanh = kernel_of("MatMul", opset), kernel_of("Sigmoid", opset), kernel_of("Tanh", opset)
    hidden = int(attrs["hidden_size"])
    return lambda x, h, RT, c: lstm_cell(x, h, RT, c, hidden=hidden, matmul=matmul, sigmoid=sigmoid, tanh=tanh)


# ---------------------------------------------------------------- the gradient of a step


def _match_cell_grad(g: Graph, gates_concat: onnx.NodeProto):
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


@fused_op("LSTMCellGrad")
def _lstm_cell_grad(attrs: dict, opset: int) -> Callable[..., tuple]:
    # the activation gradients as the activation_grad fusion binds them: the same bits as its nodes
    tanh_grad, sigmoid_grad = (bind(fused_node(op, ["dY", "Y", "one"], ["dX"], op), opset) for op in ("TanhGrad", "SigmoidGrad"))
    gemm = None
    if "trans_b" in attrs:
        gemm = kernel_of("Gemm", opset, transA=int(attrs["trans_a"]), transB=int(attrs["trans_b"]), alpha=float(attrs["alpha"]))
    carry = bool(attrs["carry"])
    return lambda *args: lstm_cell_grad(*args, gemm=gemm, carry=carry, tanh_grad=tanh_grad, sigmoid_grad=sigmoid_grad)


# ---------------------------------------------------------------- the pass


@fusion("lstm_cell")
def _lstm_cells(g: Graph) -> bool:
    """Every matched LSTM step -> one LSTMCell node; every matched step of its gradient -> one LSTMCellGrad
    (after activation_grad, whose SigmoidGrad and TanhGrad nodes it matches)."""
    changed = False
    for sigmoid in [n for n in g.nodes if n.op_type == "Sigmoid" and n.domain in STANDARD]:
        match = _match_cell(g, sigmoid)
        if match is not None:
            nodes, inputs, values, H = match
            fused = fused_node("LSTMCell", inputs, _outputs(g, nodes, values, CELL_VALUES),
                               f"fused/{sigmoid.name or sigmoid.output[0]}", hidden_size=H)
            changed = g.replace(nodes, fused) or changed
    for concat in [n for n in g.nodes if n.op_type == "Concat" and n.domain in STANDARD]:
        match = _match_cell_grad(g, concat)
        if match is not None:
            nodes, inputs, values, attrs = match
            fused = fused_node("LSTMCellGrad", inputs, _outputs(g, nodes, values, GRAD_VALUES),
                               f"fused/{concat.name or concat.output[0]}", **attrs)
            changed = g.replace(nodes, fused) or changed
    return changed
