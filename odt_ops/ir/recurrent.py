"""Recurrent ops (LSTM, GRU, RNN) rewritten into standard ONNX ops, unrolled over time.

Each recurrent node becomes, per direction: one MatMul projecting the whole input
sequence (``X @ W^T + Wb + Rb``), a Split of that projection into time steps, and one
small cell per step (MatMul with ``R^T``, Split into gates, activations, elementwise
updates). The existing kernels and gradient rules then cover forward and backward, and
the training artifacts stay standard ONNX. The cost: the graph grows linearly with the
sequence length, which must therefore be static (known from shapes at load time).

Semantics follow the ONNX spec (onnx.defs.get_schema("LSTM").doc, GRU, RNN):
directions forward, reverse and bidirectional; layouts 0 and 1; optional B,
sequence_lens, initial_h, initial_c and P; activations with activation_alpha and
activation_beta (consumed, as onnxruntime does, only by the functions that take them;
missing values default, as the spec says, to those of the ONNX operators, Affine to 1*x+0
and ScaledTanh to 1*tanh(1*x); onnxruntime 1.32 uses 0 for Affine's, ScaledTanh's and
ThresholdedRelu's instead, so models relying on those defaults differ from it); clip
on every gate's pre-activation; input_forget (LSTM: f = 1 - i); linear_before_reset
(GRU). With sequence_lens, steps past a sequence's end output zeros and leave the state
unchanged (Where masks), so Y_h and Y_c are the states at its last valid step, and the
reverse direction starts at each sequence's own last step; a constant sequence_lens
equal to the full length everywhere needs no masks.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import numpy as np
import onnx
from onnx import numpy_helper

from odt_ops.domain import is_default
from odt_ops.errors import ModelCheckError
from odt_ops.ir.attributes import node_attributes
from odt_ops.ir.builder import GraphBuilder
from odt_ops.ir.model import Model
from odt_ops.ir.passes import replace_nodes

RECURRENT_OPS = frozenset({"LSTM", "GRU", "RNN"})
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT_ACTIVATIONS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}

# activation -> (default alpha, default beta); None: the function takes no such value
_PARAMS: dict[str, tuple[float | None, float | None]] = {
    "sigmoid": (None, None),
    "tanh": (None, None),
    "relu": (None, None),
    "softsign": (None, None),
    "softplus": (None, None),
    "leakyrelu": (0.01, None),
    "thresholdedrelu": (1.0, None),
    "elu": (1.0, None),
    "hardsigmoid": (0.2, 0.5),
    "affine": (1.0, 0.0),
    "scaledtanh": (1.0, 1.0),
}
_SMALL_CONSTANT = 4096  # initializers up to this many elements are read as values (sequence_lens)
_TYPES_ASIDE = 1 << 12  # initializers above this many elements are typed only, during inference


def unroll_recurrent(model: Model) -> bool:
    """Rewrite every LSTM, GRU and RNN node into standard ops unrolled over its static
    sequence length; raise ModelCheckError naming the node when that length is dynamic."""
    graph = model.graph
    if not any(_is_recurrent(n) for n in graph.node):
        return False
    model.batch_axes.update(dict.fromkeys(_time_major_inputs(graph), 1))  # read before the nodes are gone
    types = _value_types(model)
    constants = {t.name: t for t in graph.initializer
                 if t.data_location != onnx.TensorProto.EXTERNAL and int(np.prod(t.dims, dtype=np.int64)) <= _SMALL_CONSTANT}
    taken = {v.name for v in (*graph.input, *graph.output, *graph.value_info)} | {t.name for t in graph.initializer}
    taken |= {o for n in graph.node for o in (*n.input, *n.output)} | {n.name for n in graph.node}
    read = _read_names(graph) | {o.name for o in graph.output}
    b = GraphBuilder(taken=taken, opset=model.opset, types=types, constants=constants)
    initializers = {t.name: t for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
    nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        if not _is_recurrent(node):
            nodes.append(node)
            continue
        start = len(b.nodes)
        with b.scope(node.name or f"{node.op_type}_{index}"):
            _Unroller(b, node, model.source, read, initializers).emit()
        nodes.extend(b.nodes[start:])
    if model.proto.ir_version < 4:  # IR 3 types initializers only as graph inputs: constants are nodes
        nodes[:0] = [onnx.helper.make_node("Constant", [], [t.name], name=b.fresh(f"{t.name}/Constant", scoped=False), value=t)
                     for t in b.initializers]
    else:
        graph.initializer.extend(b.initializers)
        model.derived.update(t.name for t in b.initializers)
    replace_nodes(model, nodes)
    return True


def _read_names(graph: onnx.GraphProto) -> set[str]:
    """Every value a node reads, in subgraphs (If, Loop, Scan bodies) too."""
    names = set()
    for node in graph.node:
        names.update(node.input)
        for attr in node.attribute:
            for sub in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
                names |= _read_names(sub)
    return names


# ops whose output keeps the leading axes of the input named by the index: a time-major
# sequence stays time-major through them (an embedding lookup of [T, B] token ids included)
_KEEPS_LEADING_AXES = {op: 0 for op in ("Identity", "Cast", "Dropout", "Relu", "Tanh", "Sigmoid", "Add", "Sub", "Mul", "Div",
                                        "MatMul", "LayerNormalization")} | {"Gather": 1}


def _time_major_inputs(graph: onnx.GraphProto) -> set[str]:
    """Graph inputs that reach a recurrent node's X in its default layout (time, batch, features)
    through ops that keep their leading axes: their batch is axis 1, not 0."""
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, i))
    found = set()
    for value in graph.input:
        frontier, seen = [value.name], {value.name}
        while frontier:
            name = frontier.pop()
            for node, i in readers.get(name, []):
                if _is_recurrent(node) and i == 0 and node_attributes(node).get("layout", 0) == 0:
                    found.add(value.name)
                elif node.op_type in _KEEPS_LEADING_AXES and _KEEPS_LEADING_AXES[node.op_type] == i and node.output[0] not in seen:
                    if node.op_type == "Gather" and node_attributes(node).get("axis", 0) != 0:
                        continue
                    seen.add(node.output[0])
                    frontier.append(node.output[0])
    return found


def _is_recurrent(node: onnx.NodeProto) -> bool:
    return node.op_type in RECURRENT_OPS and is_default(node.domain)


def _value_types(model: Model) -> dict[str, onnx.TypeProto]:
    """Types of every value by ONNX shape inference, run on a copy whose large
    initializers are stood in for by typed graph inputs (no weights are copied)."""
    graph = model.graph
    light = onnx.ModelProto()
    light.ir_version = model.proto.ir_version
    light.opset_import.extend(model.proto.opset_import)
    g = light.graph
    g.name = graph.name
    g.node.extend(graph.node)
    g.input.extend(graph.input)
    g.output.extend(graph.output)
    g.value_info.extend(graph.value_info)
    inputs = {i.name for i in graph.input}
    for t in graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or int(np.prod(t.dims, dtype=np.int64)) > _TYPES_ASIDE:
            if t.name not in inputs:
                g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            g.initializer.append(t)
    if light.ir_version < 4:
        light.ir_version = 4
    types = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
    types.update({t.name: onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in graph.initializer})
    try:
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=True).graph
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        return types  # the load's own shape inference names the fault
    types.update({v.name: v.type for v in (*inferred.value_info, *inferred.output)})
    return types


Activation = Callable[[str], str]


class _Unroller:
    """Emits the standard-op equivalent of one recurrent node into a GraphBuilder."""

    def __init__(self, b: GraphBuilder, node: onnx.NodeProto, source: str, read: set[str],
                 initializers: dict[str, onnx.TensorProto]):
        self.b, self.node, self.source = b, node, source
        self.op = node.op_type
        self.attrs = node_attributes(node)
        names = list(node.input) + [""] * (8 - len(node.input))
        self.X, self.W, self.R, self.B, self.lens, self.h0, self.c0, self.P = names[:8]
        if self.op != "LSTM":
            self.c0 = self.P = ""
        # exporters write the zero initial state of a fixed batch size as a constant: without it
        # the step needs no state at t=0 and the model serves any batch size
        for attr in ("h0", "c0"):
            tensor = initializers.get(getattr(self, attr))
            if tensor is not None and not np.any(numpy_helper.to_array(tensor)):
                setattr(self, attr, "")
        self.outputs = [o if o and o in read else "" for o in node.output]
        self.layout = int(self.attrs.get("layout", 0))
        direction = self.attrs.get("direction", "forward")
        if direction not in ("forward", "reverse", "bidirectional"):
            self.fail(f"has direction {direction!r}; ONNX defines forward, reverse and bidirectional")
        if self.layout not in (0, 1):
            self.fail(f"has layout {self.layout}; ONNX defines layouts 0 and 1")
        self.reverse = [direction == "reverse"] if direction != "bidirectional" else [False, True]
        self.D = len(self.reverse)
        self.gates = _GATES[self.op]
        self.dtype = b.dtype(self.X) or np.dtype(np.float32)
        self.T = self.sequence_length()
        self.H = self.hidden_size()
        self.clip = self.attrs.get("clip")
        self.activations = self.parse_activations()

    def fail(self, what: str) -> NoReturn:
        raise ModelCheckError(f"{self.source}: {self.op} node {self.node.name!r} {what}")

    # ---- static facts --------------------------------------------------------------
    def sequence_length(self) -> int:
        shape = self.b.shape(self.X)
        axis = self.layout  # layout 0: [seq, batch, input]; layout 1: [batch, seq, input]
        dim = shape[axis] if shape is not None and len(shape) == 3 else None
        if not isinstance(dim, int) or dim <= 0:
            shown = "unknown" if shape is None else "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
            self.fail(
                f"has a dynamic sequence length (input X {self.X!r} has shape {shown}, sequence axis {axis}); "
                "odt_ops unrolls recurrent ops over a static number of time steps: export the model with a fixed "
                "sequence length (a static input shape, with no dynamic axis / dynamic_shapes entry on the time dimension)"
            )
        return dim

    def hidden_size(self) -> int:
        if self.attrs.get("hidden_size"):
            return int(self.attrs["hidden_size"])
        shape = self.b.shape(self.R)
        if shape is not None and len(shape) == 3 and isinstance(shape[2], int):
            return shape[2]
        self.fail(f"has no hidden_size attribute and R {self.R!r} has no static shape; set hidden_size")
        raise AssertionError  # unreachable

    def parse_activations(self) -> list[list[Activation]]:
        """One activation function per role (f, g, h), per direction."""
        defaults = _DEFAULT_ACTIVATIONS[self.op]
        names = list(self.attrs.get("activations") or [])
        if not names:
            names = list(defaults) * self.D
        elif len(names) == len(defaults) and self.D == 2:
            names = names * 2  # one set given for both directions
        if len(names) != len(defaults) * self.D:
            self.fail(f"has {len(names)} activations; it needs {len(defaults)} per direction ({len(defaults) * self.D})")
        alphas = list(self.attrs.get("activation_alpha") or [])
        betas = list(self.attrs.get("activation_beta") or [])
        functions = []
        for name in names:
            key = name.lower()
            if key not in _PARAMS:
                self.fail(f"uses activation {name!r}; odt_ops supports {', '.join(sorted(_PARAMS))}")
            alpha, beta = _PARAMS[key]
            if alpha is not None and alphas:
                alpha = alphas.pop(0)
            if beta is not None and betas:
                beta = betas.pop(0)
            functions.append(self.activation(key, alpha, beta))
        n = len(defaults)
        return [functions[d * n:(d + 1) * n] for d in range(self.D)]

    def activation(self, key: str, alpha: float | None, beta: float | None) -> Activation:
        b = self.b
        simple = {"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu", "softsign": "Softsign", "softplus": "Softplus"}
        if key in simple:
            return lambda x: b.op(simple[key], [x])
        assert alpha is not None, f"{key} takes alpha (_PARAMS)"
        if key in ("leakyrelu", "thresholdedrelu", "elu"):
            op = {"leakyrelu": "LeakyRelu", "thresholdedrelu": "ThresholdedRelu", "elu": "Elu"}[key]
            return lambda x: b.op(op, [x], alpha=float(alpha))
        assert beta is not None, f"{key} takes beta (_PARAMS)"
        if key == "hardsigmoid":
            return lambda x: b.HardSigmoid(x, alpha=float(alpha), beta=float(beta))
        if key == "affine":
            return lambda x: b.Add(b.Mul(x, self.scalar(alpha)), self.scalar(beta))
        return lambda x: b.Mul(b.Tanh(b.Mul(x, self.scalar(beta))), self.scalar(alpha))  # scaledtanh

    # ---- opset-aware helpers -------------------------------------------------------
    def scalar(self, value: float) -> str:
        return self.b.constant(np.array(value, dtype=self.dtype), hint="scalar")

    def ints(self, values: list[int]) -> str:
        return self.b.constant(np.array(values, dtype=np.int64), hint="ints")

    def squeeze(self, x: str, axes: list[int]) -> str:
        if self.b.opset >= 13:
            return self.b.Squeeze(x, self.ints(axes))
        return self.b.Squeeze(x, axes=axes)

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        if self.b.opset >= 13:
            return self.b.Unsqueeze(x, self.ints(axes))
        return self.b.Unsqueeze(x, axes=axes)

    def split(self, x: str, sizes: list[int], axis: int) -> list[str]:
        if len(sizes) == 1:
            return [x]
        if self.b.opset >= 13:
            return self.b.op_multi("Split", [x, self.ints(sizes)], len(sizes), axis=axis)
        return self.b.op_multi("Split", [x], len(sizes), axis=axis, split=sizes)

    def unstack(self, x: str, axis: int, n: int) -> list[str]:
        """``n`` slices of ``x`` along ``axis``, that axis removed (one Split: its gradient is a Concat)."""
        return [self.squeeze(part, [axis]) for part in self.split(x, [1] * n, axis)]

    def time_steps(self, x: str) -> list[str]:
        """Per time step, the [batch, G*H] slice of the projection ``x`` ([T, batch, G*H], or
        [batch, T, G*H] in layout 1): flattened so that the steps are equal blocks along one axis,
        then one even Split. No Squeeze per step, and in the gradient no Reshape per step."""
        if self.T == 1 or self.b.opset < 13:  # older opsets: Split and Squeeze by attribute
            return self.unstack(x, self.layout, self.T)
        width = self.gates * self.H
        flat = self.b.Reshape(x, self.ints([-1, width] if self.layout == 0 else [0, -1]))
        axis = self.layout
        if self.b.opset >= 18:
            return self.b.op_multi("Split", [flat], self.T, axis=axis, num_outputs=self.T)
        return self.b.op_multi("Split", [flat], self.T, axis=axis)  # no sizes: even parts, one per output

    def stacked(self, ys: list[str]) -> str:
        """One direction's outputs, [batch, H] per step, as Y's [T, 1, batch, H] (or [batch, T, 1, H]
        in layout 1): one Concat and one Reshape rather than an Unsqueeze per step."""
        b, T, H = self.b, self.T, self.H
        axes = [0, 1] if self.layout == 0 else [1, 2]
        if T == 1 or self.b.opset < 13:
            return b.Concat(*[self.unsqueeze(v, axes) for v in ys], axis=axes[0]) if T > 1 else self.unsqueeze(ys[0], axes)
        joined = b.Concat(*ys, axis=self.layout)  # [T*batch, H] or [batch, T*H]
        return b.Reshape(joined, self.ints([T, 1, -1, H] if self.layout == 0 else [0, T, 1, H]))

    def per_direction(self, x: str, axis: int) -> list[str]:
        return self.unstack(x, axis, self.D) if x else [""] * self.D

    def clipped(self, x: str) -> str:
        if self.clip is None:
            return x
        c = float(self.clip)
        if self.b.opset >= 11:
            return self.b.Clip(x, self.scalar(-c), self.scalar(c))
        return self.b.Clip(x, min=-c, max=c)

    def add(self, x: str, y: str | None) -> str:
        return x if not y else self.b.Add(x, y)

    # ---- the rewrite ---------------------------------------------------------------
    def emit(self) -> None:
        b, H, G, T = self.b, self.H, self.gates, self.T
        Ws = self.per_direction(self.W, 0)
        Rs = self.per_direction(self.R, 0)
        Bs = self.per_direction(self.B, 0)
        Ps = self.per_direction(self.P, 0)
        state_axis = 0 if self.layout == 0 else 1
        h0s = self.per_direction(self.h0, state_axis)
        c0s = self.per_direction(self.c0, state_axis)
        masks = self.masks()
        lbr = self.op == "GRU" and int(self.attrs.get("linear_before_reset", 0)) != 0
        ys, hs, cs = [], [], []
        for d in range(self.D):
            # the input projection of every time step at once
            xw = b.MatMul(self.X, b.Transpose(Ws[d], perm=[1, 0]))
            Rb_h = None
            if Bs[d]:
                Wb, Rb = self.split(Bs[d], [G * H, G * H], 0)
                if lbr:
                    Wb_zr, Wb_h = self.split(Wb, [2 * H, H], 0)
                    Rb_zr, Rb_h = self.split(Rb, [2 * H, H], 0)
                    bias = b.Concat(b.Add(Wb_zr, Rb_zr), Wb_h, axis=0)
                else:
                    bias = b.Add(Wb, Rb)
                xw = b.Add(xw, bias)
            steps = self.time_steps(xw)
            RT = b.Transpose(Rs[d], perm=[1, 0])  # [H, G*H]
            cell = self.cell_fn(d, RT, Ps[d], Rb_h, lbr)
            h, c = h0s[d] or None, c0s[d] or None
            y: list[str | None] = [None] * T
            for t in (reversed(range(T)) if self.reverse[d] else range(T)):
                h_new, c_new = cell(steps[t], h, c)
                if masks is None:
                    y[t], h, c = h_new, h_new, c_new
                    continue
                zero = self.scalar(0.0)
                m = masks[t]
                y[t] = self.select(m, h_new, zero)
                h = y[t] if h is None else self.select(m, h_new, h)
                if c_new is not None:
                    c = self.select(m, c_new, c if c is not None else zero)
            ys.append([_present(v) for v in y])  # every step wrote its output
            hs.append(h)
            cs.append(c)
        Y, Y_h, Y_c = (self.outputs + ["", "", ""])[:3]
        if Y:
            per_dir = [self.stacked(y) for y in ys]  # Y: [T, D, batch, H] or [batch, T, D, H]
            self.produce(per_dir[0] if self.D == 1 else b.Concat(*per_dir, axis=1 if self.layout == 0 else 2), Y)
        for name, states in ((Y_h, hs), (Y_c, cs)):
            if name:
                parts = [self.unsqueeze(_present(s), [state_axis]) for s in states]
                self.produce(parts[0] if self.D == 1 else b.Concat(*parts, axis=state_axis), name)

    def masks(self) -> list[str] | None:
        """Per step, [batch, 1] booleans: is the step inside each sequence; None if all are."""
        if not self.lens:
            return None
        known = self.b.value(self.lens)
        if known is not None and known.size and np.all(known == self.T):
            return None
        b = self.b
        if b.opset < 9:  # no Where, and Less on floats only: masks are 0/1 floats
            lens = b.Cast(self.lens, to=onnx.helper.np_dtype_to_tensor_dtype(self.dtype))
            to = onnx.helper.np_dtype_to_tensor_dtype(self.dtype)
            return [self.unsqueeze(b.Cast(b.Less(self.scalar(float(t)), lens), to=to), [1]) for t in range(self.T)]
        lens_dtype = b.dtype(self.lens) or np.dtype(np.int32)
        return [self.unsqueeze(b.Less(b.constant(np.array(t, dtype=lens_dtype), hint="step"), self.lens), [1])
                for t in range(self.T)]

    def select(self, mask: str, new: str, old: str) -> str:
        """``new`` inside the sequence, ``old`` past its end."""
        if self.b.opset >= 9:
            return self.b.Where(mask, new, old)
        b = self.b
        return b.Add(b.Mul(mask, new), b.Mul(b.Sub(self.scalar(1.0), mask), old))

    def cell_fn(self, d: int, RT: str, P: str, Rb_h: str | None, lbr: bool):
        b, H = self.b, self.H
        acts = self.activations[d]
        if self.op == "RNN":
            (f,) = acts

            def rnn(x, h, c):
                pre = self.add(x, b.MatMul(h, RT) if h else None)
                return f(self.clipped(pre)), None

            return rnn
        if self.op == "GRU":
            f, g = acts
            RT_zr, RT_h = (None, None) if lbr else self.split(RT, [2 * H, H], 1)

            def gru(x, h, c):
                x_zr, x_h = self.split(x, [2 * H, H], 1)
                if lbr:
                    h_zr, h_h = self.split(b.MatMul(h, RT), [2 * H, H], 1) if h else (None, None)
                else:
                    h_zr = b.MatMul(h, RT_zr) if h else None
                z, r = self.split(f(self.clipped(self.add(x_zr, h_zr))), [H, H], 1)
                if lbr:
                    inner = self.add(h_h, Rb_h) if h_h else Rb_h
                    pre = self.add(x_h, b.Mul(r, inner) if inner else None)
                else:
                    pre = self.add(x_h, b.MatMul(b.Mul(r, h), RT_h) if h else None)
                candidate = g(self.clipped(pre))
                new = b.Mul(b.Sub(self.scalar(1.0), z), candidate)
                return self.add(new, b.Mul(z, h) if h else None), None

            return gru
        f, g, hact = acts
        p_i, p_o, p_f = self.split(P, [H, H, H], 0) if P else (None, None, None)
        input_forget = int(self.attrs.get("input_forget", 0)) != 0

        def lstm(x, h, c):
            gates = self.add(x, b.MatMul(h, RT) if h else None)
            if not P and not input_forget:
                # the three gates i, o, f are adjacent and share f: one activation over them (and one
                # gradient), three times fewer small nodes per step than a call per gate
                iof, cand = self.split(gates, [3 * H, H], 1)
                i, o, fg = self.split(f(self.clipped(iof)), [H, H, H], 1)
                c_new = self.add(b.Mul(i, g(self.clipped(cand))), b.Mul(fg, c) if c else None)
                return b.Mul(o, hact(c_new)), c_new
            i, o, fg, cand = self.split(gates, [H, H, H, H], 1)
            if p_i and c:
                i = b.Add(i, b.Mul(p_i, c))
            i = f(self.clipped(i))
            if input_forget:
                fg = b.Sub(self.scalar(1.0), i)
            else:
                if p_f and c:
                    fg = b.Add(fg, b.Mul(p_f, c))
                fg = f(self.clipped(fg))
            cand = g(self.clipped(cand))
            c_new = self.add(b.Mul(i, cand), b.Mul(fg, c) if c else None)
            if p_o:
                o = b.Add(o, b.Mul(p_o, c_new))
            o = f(self.clipped(o))
            return b.Mul(o, hact(c_new)), c_new

        return lstm

    def produce(self, value: str, name: str) -> None:
        """Make the node that computes ``value`` write it as ``name`` (the original output),
        or add an Identity when emitted nodes read ``value`` too."""
        b = self.b
        readers = any(value in n.input for n in b.nodes)
        for node in reversed(b.nodes):
            if value in node.output:
                if not readers:
                    node.output[list(node.output).index(value)] = name
                    if value in b.types:
                        b.types[name] = b.types.pop(value)
                    return
                break
        b.nodes.append(onnx.helper.make_node("Identity", [value], [name], name=b.fresh("Identity")))
        if value in b.types:
            b.types[name] = b.types[value]


def _present(value: str | None) -> str:
    assert value is not None, "a state or output the unrolled steps left unset"
    return value


__all__ = ["RECURRENT_OPS", "unroll_recurrent"]
