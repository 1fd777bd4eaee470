"""Gradient rule: Loop whose trip count is known only at run time.

Loops with a trip count known at load are unrolled (odt_ops/ir/control_flow.py) and never
reach this rule; the ones left run a body a data-dependent number of times (TorchScript's
EmbeddingBag with offsets: one iteration per bag). Loading moves every float value a body
reads from outside into the loop-carried values, so the gradient is only ever wanted for
carried values.

    forward:  v[t+1], s[t] = body(t, v[t])       t = 0 .. M-1 (M decided at run time)
    backward: dv[t] = d/dv[t] (v[t+1] . dv[t+1] + s[t] . ds[t])   t = M-1 .. 0

The forward Loop also puts out, as scan outputs, the carried values each iteration starts
from (except the ones the body passes through unchanged: weights) and the iteration count.
The backward Loop runs M times over t = M-1-j: it rebuilds v[t] from those, reruns the body
(recomputation, as checkpointing does) and the body's own gradient graph, built by the same
walker from the pseudo-loss sum(v[t+1] * dv[t+1]) + sum(s[t] * ds[t]) whose gradient with
respect to v[t] is exactly the vector-Jacobian product above.
"""
from __future__ import annotations

import onnx
from onnx import helper

from odt_ops.grad.registry import gradient
from odt_ops.ir.attributes import node_attributes
from odt_ops.ir.graph import has_subgraphs, outer_reads

_FLOAT = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def _passed_through(body: onnx.GraphProto, j: int) -> bool:
    """The body hands carried value j on unchanged (a weight moved into the carried values)."""
    vin, vout = body.input[2 + j].name, body.output[1 + j].name
    if vin == vout:
        return True
    producer = next((n for n in body.node if vout in n.output), None)
    return producer is not None and producer.op_type == "Identity" and producer.input[0] == vin


def _renamed(body: onnx.GraphProto, prefix: str) -> onnx.GraphProto:
    """A copy of ``body`` whose own values (inputs, node outputs) are prefixed, so the backward
    body, which recomputes them, shadows no value of the enclosing graph (onnx.checker's SSA rule);
    the values it reads from outside keep their names."""
    own = {v.name for v in body.input} | {o for n in body.node for o in n.output if o} | {t.name for t in body.initializer}
    copy = onnx.GraphProto()
    copy.CopyFrom(body)
    rename = {name: f"{prefix}{name}" for name in own}
    for value in (*copy.input, *copy.output, *copy.value_info, *copy.initializer):
        value.name = rename.get(value.name, value.name)
    for node in copy.node:
        node.input[:] = [rename.get(i, i) for i in node.input]
        node.output[:] = [rename.get(o, o) for o in node.output]
        if node.name:
            node.name = f"{prefix}{node.name}"
    return copy


@gradient("Loop")
def loop_grad(ctx, *dout):
    """dv0 = the body's vector-Jacobian product run backwards over the saved iterations."""
    from odt_ops.grad.build import build_gradients  # the walker itself: the body's gradient graph

    b, node = ctx.b, ctx.node
    body = node_attributes(node)["body"]
    n = len(node.input) - 2
    k = len(body.output) - 1 - n
    carried_types = [body.input[2 + j].type for j in range(n)]
    is_float = [t.tensor_type.elem_type in _FLOAT for t in carried_types]
    if any(not f and ctx.needs(2 + j) for j, f in enumerate(is_float)):
        raise ctx.fail("only float loop-carried values have gradients")
    through = [_passed_through(body, j) for j in range(n)]
    outside = [o for o in outer_reads(body) if b.dtype(o) is not None and b.dtype(o).kind == "f"]
    if outside:  # their gradient would be lost; loading (odt_ops.load_model) makes them carried values
        raise ctx.fail(f"its body reads the float values {outside} from outside; load the model with "
                       "odt_ops.load_model, which passes them in as loop-carried values")

    # the forward Loop saves each iteration's starting values and counts its iterations
    saved: dict[int, str] = {}
    forward_body = onnx.GraphProto()
    forward_body.CopyFrom(body)
    counter = f"{body.name or 'body'}/iteration"
    forward_body.node.append(helper.make_node("Identity", [body.input[0].name], [counter]))
    forward_body.output.append(helper.make_tensor_value_info(counter, onnx.TensorProto.INT64, []))
    for j in range(n):
        if not through[j]:
            name = f"{body.input[2 + j].name}/saved"
            forward_body.node.append(helper.make_node("Identity", [body.input[2 + j].name], [name]))
            value = forward_body.output.add()
            value.name = name
            value.type.CopyFrom(carried_types[j])
            saved[j] = name
    for attr in node.attribute:
        if attr.name == "body":
            attr.g.CopyFrom(forward_body)
    iterations = b.fresh(f"{node.name}/iterations", scoped=False)
    node.output.append(iterations)
    saved_outer = {}
    for j in saved:
        saved_outer[j] = b.fresh(f"{node.name}/saved{j}", scoped=False)
        node.output.append(saved_outer[j])
    trips = b.Shape(iterations)
    last = b.Sub(b.Squeeze(trips, ctx.ints([0])), ctx.ints(1))

    # the backward body: rebuild the iteration's inputs, rerun the body, its gradient graph
    if any(has_subgraphs(inner) for inner in body.node):
        raise ctx.fail("a Loop body with nested subgraphs has no gradient")
    body = _renamed(body, "bwd/body/")
    scan_grads = {l: g for l, g in enumerate(dout[n:n + k]) if g is not None}
    step, go = "bwd/j", "bwd/cond"
    grad_in = [f"bwd/d{j}" for j in range(n) if is_float[j]]
    floats = [j for j in range(n) if is_float[j]]
    prelude = [helper.make_node("Sub", [last, step], ["bwd/t"])]
    prelude.append(helper.make_node("Identity", ["bwd/t"], [body.input[0].name]))
    prelude.append(helper.make_node("Identity", [go], [body.input[1].name]))
    for j in range(n):
        source = node.input[2 + j] if through[j] else None
        if source is not None:
            prelude.append(helper.make_node("Identity", [source], [body.input[2 + j].name]))
        else:
            prelude.append(helper.make_node("Gather", [saved_outer[j], "bwd/t"], [body.input[2 + j].name], axis=0))
    seeds = []  # (forward output, its seed)
    for j, d in zip(floats, grad_in):
        seeds.append((body.output[1 + j].name, d))
    for l, g in scan_grads.items():
        seed = f"bwd/ds{l}"
        prelude.append(helper.make_node("Gather", [g, "bwd/t"], [seed], axis=0))
        seeds.append((body.output[1 + n + l].name, seed))
    flat_shape = "bwd/flat_shape"
    pseudo, terms = [helper.make_node("Constant", [], [flat_shape], value=helper.make_tensor(flat_shape, onnx.TensorProto.INT64, [1], [-1]))], []
    for i, (value, seed) in enumerate(seeds):
        prod, flat, term = f"bwd/prod{i}", f"bwd/flat{i}", f"bwd/term{i}"
        # flattened first, so each term is a scalar of known rank whatever the body's shapes
        pseudo += [helper.make_node("Mul", [value, seed], [prod]), helper.make_node("Reshape", [prod, flat_shape], [flat]),
                   helper.make_node("ReduceSum", [flat], [term], keepdims=0)]
        terms.append(term)
    loss = "bwd/pseudo_loss"
    pseudo.append(helper.make_node("Sum", terms, [loss]) if len(terms) > 1 else helper.make_node("Identity", terms, [loss]))

    # differentiate the rerun body as a graph of its own, the iteration's inputs as its inputs
    wrt = [body.input[2 + j].name for j in floats]
    seed_types = {d: carried_types[j] for j, d in zip(floats, grad_in)}
    for l in scan_grads:
        seed_types[f"bwd/ds{l}"] = body.output[1 + n + l].type
    outer = list(outer_reads(body))  # values of the enclosing graph the body reads
    outer_types = [b.types[o] if o in b.types else onnx.TypeProto() for o in outer]
    rerun = helper.make_graph(
        [*body.node, *pseudo], "rerun",
        [body.input[0], body.input[1], *(body.input[2 + j] for j in range(n)),
         *(helper.make_value_info(s, t) for s, t in seed_types.items()),
         *(helper.make_value_info(o, t) for o, t in zip(outer, outer_types))],
        [helper.make_tensor_value_info(loss, carried_types[floats[0]].tensor_type.elem_type, [])], list(body.initializer))
    rerun.value_info.extend(body.value_info)
    model = helper.make_model(rerun, opset_imports=[helper.make_opsetid("", ctx.opset)])
    grads = build_gradients(model, loss, wrt)
    outputs = [helper.make_node("Identity", [go], ["bwd/cond_out"])]
    for j, name in zip(floats, wrt):
        outputs.append(helper.make_node("Identity", [grads.grads[name]], [f"bwd/d{j}_out"]))
    backward_body = helper.make_graph(
        [*prelude, *body.node, *pseudo, *grads.nodes, *outputs], "loop_backward",
        [helper.make_tensor_value_info(step, onnx.TensorProto.INT64, []), helper.make_tensor_value_info(go, onnx.TensorProto.BOOL, []),
         *(helper.make_value_info(d, carried_types[j]) for j, d in zip(floats, grad_in))],
        [helper.make_tensor_value_info("bwd/cond_out", onnx.TensorProto.BOOL, []),
         *(helper.make_value_info(f"bwd/d{j}_out", carried_types[j]) for j in floats)],
        [*body.initializer, *grads.initializers])

    start = [dout[j] if dout[j] is not None else ctx.zeros_like(node.input[2 + j]) for j in floats]
    final = b.op_multi("Loop", [b.Squeeze(trips, ctx.ints([0])), "", *start], len(floats), body=backward_body)
    result: list[str | None] = [None, None] + [None] * n
    for j, g in zip(floats, final):
        result[2 + j] = g
    return tuple(result)


__all__ = ["loop_grad"]
