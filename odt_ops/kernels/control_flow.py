"""Control flow: If, Loop, Scan. Each runs its subgraphs through nested execution plans.

A subgraph reads outer-scope values by name. The plan feeds a control-flow kernel those
values after the node's own inputs, in the order of ``implicit_inputs(node)``
(odt_ops/ir/control_flow.py), and binds ``_scope`` (ir/binding.py): the names of
those values, the model's opsets, the session's generator and the compiler the runtime
hands down (its ``Plan``). Each subgraph is compiled once per bound node into a nested plan
whose feeds are the subgraph's formal inputs followed by the outer values it reads; the
kernels themselves never import the runtime.

Most Loops and Scans of trainable models never reach these kernels: loading unrolls
those whose trip count is static, and inlines Ifs whose condition is a constant
(odt_ops/ir/control_flow.py), so the graph is differentiated with the ordinary rules.
"""
from __future__ import annotations

import numpy as np
import onnx

from odt_ops.errors import KernelError
from odt_ops.kernels.registry import kernel


def _true(value: np.ndarray) -> bool:
    value = np.asarray(value)
    if value.size != 1:
        raise KernelError(f"a condition must hold one element, got shape {value.shape}")
    return bool(value.reshape(-1)[0])


@kernel("If", since=1)
def if_(cond, *outer, then_branch, else_branch, _scope):
    """The outputs of ``then_branch`` if ``cond`` else those of ``else_branch``."""
    return tuple(_scope.run(then_branch if _true(cond) else else_branch, [], outer))


@kernel("Loop", since=1)
def loop(*args, body, _scope):
    """for (i = 0; (M is "" or i < M) and (cond is "" or cond); ++i) cond, v... , s... = body(i, cond, v...):
    final v..., then every scan output s stacked along a new first axis."""
    args, outer = _scope.split(args)
    M = args[0] if len(args) > 0 else None
    cond = args[1] if len(args) > 1 else None
    carried = list(args[2:])
    n = len(carried)
    k = len(body.output) - 1 - n
    if k < 0:
        raise KernelError(f"{_scope.label}: the body has {len(body.output)} outputs for {n} loop-carried values")
    trip = None if M is None else int(np.asarray(M).reshape(-1)[0])
    go = True if cond is None else _true(cond)
    i = 0
    scans: list[list[np.ndarray]] = [[] for _ in range(k)]
    while go and (trip is None or i < trip):
        outs = _scope.run(body, [np.array(i, dtype=np.int64), np.array(go), *carried], outer)
        if cond is not None:  # without a cond input, the body's condition is ignored
            go = _true(outs[0])
        carried = list(outs[1 : 1 + n])
        for j in range(k):
            scans[j].append(outs[1 + n + j])
        i += 1
    stacked = []
    for j, values in enumerate(scans):
        out = body.output[1 + n + j]
        stacked.append(_stack(values, 0, out, _scope) if values else _empty(out, 0))
    return (*carried, *stacked)


@kernel("Scan", since=9)
def scan(*args, body, num_scan_inputs, scan_input_axes=None, scan_input_directions=None,
         scan_output_axes=None, scan_output_directions=None, _scope):
    """states, x... -> final states, y...: the body maps (states, x[t]...) to (states, y[t]...) for
    every t along each scan input's axis (reversed where its direction is 1); each y is
    stacked along its output axis (in reverse where its direction is 1)."""
    args, outer = _scope.split(args)
    m = num_scan_inputs
    n = len(args) - m
    states, xs = list(args[:n]), args[n:]
    k = len(body.output) - n
    if n < 0 or k < 0:
        raise KernelError(f"{_scope.label}: {len(args)} inputs for {m} scan inputs and a body of {len(body.output)} outputs")
    in_axes = [_axis(a, x.ndim) for a, x in zip(scan_input_axes or [0] * m, xs)]
    in_dirs = scan_input_directions or [0] * m
    lengths = {x.shape[a] for x, a in zip(xs, in_axes)}
    if len(lengths) != 1:
        raise KernelError(f"{_scope.label}: scan inputs differ in sequence length {sorted(lengths)}")
    (steps,) = lengths
    ys: list[list[np.ndarray]] = [[] for _ in range(k)]
    for t in range(steps):
        slices = [np.take(x, steps - 1 - t if d else t, axis=a) for x, a, d in zip(xs, in_axes, in_dirs)]
        outs = _scope.run(body, [*states, *slices], outer)
        states = list(outs[:n])
        for j in range(k):
            ys[j].append(outs[n + j])
    out_axes = scan_output_axes or [0] * k
    out_dirs = scan_output_directions or [0] * k
    stacked = []
    for j, values in enumerate(ys):
        out = body.output[n + j]
        if not values:
            stacked.append(_empty(out, out_axes[j]))
            continue
        axis = _axis(out_axes[j], values[0].ndim + 1)
        stacked.append(_stack(values[::-1] if out_dirs[j] else values, axis, out, _scope))
    return (*states, *stacked)


@kernel("Scan", since=8)
def scan_8(*args, body, num_scan_inputs, directions=None, _scope):
    """Scan-8: every input has a batch axis first (sequence axis second on scan inputs) and
    ``sequence_lens`` (optional, first) bounds each batch entry's steps; scan outputs are
    zero past an entry's length."""
    args, outer = _scope.split(args)
    lens, rest = (args[0] if args else None), args[1:]
    m = num_scan_inputs
    n = len(rest) - m
    states, xs = rest[:n], rest[n:]
    batch = xs[0].shape[0]
    longest = xs[0].shape[1]
    finals: list[list[np.ndarray]] = [[] for _ in range(n)]
    ys: list[list[np.ndarray]] = []
    for b in range(batch):
        length = longest if lens is None else int(lens[b])
        result = scan(*[s[b] for s in states], *[x[b, :length] for x in xs], *outer, body=body, num_scan_inputs=m,
                      scan_input_directions=directions, _scope=_scope)
        for j in range(n):
            finals[j].append(result[j])
        scanned = result[n:]
        if not ys:
            ys = [[] for _ in scanned]
        for j, y in enumerate(scanned):
            if y.shape[0] < longest:
                y = np.concatenate([y, np.zeros((longest - y.shape[0], *y.shape[1:]), dtype=y.dtype)])
            ys[j].append(y)
    return (*[np.stack(f) for f in finals], *[np.stack(y) for y in ys])


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _stack(values: list[np.ndarray], axis: int, out: onnx.ValueInfoProto, scope) -> np.ndarray:
    shapes = {v.shape for v in values}
    if len(shapes) != 1:
        raise KernelError(f"{scope.label}: scan output {out.name!r} changes shape between iterations {sorted(shapes)}")
    return np.stack(values, axis=axis)


def _empty(out: onnx.ValueInfoProto, axis: int) -> np.ndarray:
    """A scan output after no iteration: zero along the scan axis, the body's static shape elsewhere."""
    tt = out.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else np.float32
    inner = [d.dim_value if d.HasField("dim_value") else 0 for d in tt.shape.dim] if tt.HasField("shape") else []
    shape = list(inner)
    shape.insert(_axis(axis, len(inner) + 1), 0)
    return np.zeros(shape, dtype=dtype)
