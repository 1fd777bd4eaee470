"""The channels-last training graph: around depthwise convolutions, values are kept as
(N, H, W, C) arrays through the forward and backward graph, with a transpose only where a
consumer needs ONNX's (N, C, H, W).

Why: the depthwise kernels run channels last (kernels/conv.py: their taps are then long
contiguous runs), and BatchNormalization, the activations and their gradients around them
ran channels first, so every depthwise Conv and its input gradient paid transposes (about
1 ns an element). Elementwise ops do not care about the layout; a 1x1 convolution channels
last is one matrix product per batch, as channels first.

The pass (``channels_last``, last in the fusion order: it sees the fused normalization and
activation gradients) decides a layout per value: it starts from every depthwise Conv and
ConvTranspose (the seeds) and grows, through the values they read and write, over every node
that has a channels-last form (``_rule``: elementwise ops and their fused gradients,
BatchNormalization and its fused gradient, 1x1 and depthwise convolutions and their transposes,
GlobalAveragePool, ReduceSum keeping dims, Shape, Expand, Transpose). A node it reaches becomes
a ``ChannelsLast`` node in the engine's domain (layout_ops.py runs the op on channels-last
arrays) that writes ``<value>@nhwc``; the value under its own name is then made by a
``ToChannelsFirst`` node only if something still reads it that way (a 3x3 Conv, a graph output,
a check), and a channels-last reader of a value from outside gets one ``ToChannelsLast`` copy.
Graph inputs, outputs, parameters and checkpoints therefore keep ONNX's layout. A network
without depthwise convolutions is left channels first (but see the weight gradients below).

Why other k x k convolutions stay channels first (measured, not assumed): kernels/conv.py has a
channels-last one-group convolution (``windows_channels_last``: one product of the windows), but
admitting those convolutions here made every plan slower, single-threaded, batch 32, on an AMD EPYC
Zen 4 under load: as seeds, UNet 1.19x and the small CNN 1.50x the step time (their regions end at
the convolution itself: GroupNorm's Reshape, MaxPool and the weight gradients' window columns have
no channels-last form yet, so every convolution paid a transpose each way, and the product is
slower than ``conv``'s per-tap GEMMs with 16 output channels); joining the depthwise regions (the
stems), MobileNetV3 1.01x and EfficientNet 1.05x.

What the pass does for every network (with or without depthwise convolutions): a one-group
stride-1 2-D convolution's weight gradient over at least 16 input channels, as the rule writes it
on channels-first values (Transposes to (C, N, H, W), window columns, one MatMul), becomes one
``StrideOneWeightGrad`` node that lays X out on a zero-padded flat grid, one plane per channel over
the whole batch, and takes one product per kernel tap over cache-sized blocks of pixels, with no
window columns (``_stride_one_weight_grads``): UNet's training step at batch 32 0.89x with pixel-major
planes, then 0.93x again at batch 8 and 32 with channel-major planes in blocks (layout_ops.py says
why); the same sums in another order.

Measured and left as they are (UNet, one thread, batch 8 and 32, Zen 4 under load): the stride-1
input gradient (a Conv by the flipped kernel) as per-tap products is slower than ``conv``'s im2col
when it widens the channels (16 -> 32 at 32x32: 6.1 against 5.3 ms per call, batch 32; whole-batch
planes in pixel blocks 1.4-3x slower), and the forward convolutions' choice between per-tap products
and im2col (kernels/conv.py) is the faster one on every UNet layer but the 8x8 one (within 0.1 ms);
the weight gradient of UNet's 1-channel first layer as one product of the taps' stacked planes ran no
faster than its window columns.

Equal to the graph as written: elementwise ops, the depthwise convolutions and the
transposes compute the same values from the same operands (bit for bit); the statistics of
BatchNormalization, its gradient, GlobalAveragePool, ReduceSum, the 1x1 convolutions' products and
the weight gradients (StrideOneWeightGrad, PointwiseWeightGrad, DepthwiseWeightGrad)
sum the same numbers in another order (rounding only; tests/odt_ops/runtime/test_channels_last.py
holds the plans to the graph as written and to onnxruntime).

What it needs to know: the rank and some dimensions of the values (onnx's shape inference,
run only when the graph has a grouped convolution, completed where it gives up inside the
gradient graph); a value of unknown rank stays as it is.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from odt_ops.ir.attributes import node_attributes
from odt_ops.ir.graph import implicit_inputs
from odt_ops.kernels.conv import is_depthwise_conv
from odt_ops.runtime.fusion.graph import DOMAIN, STANDARD, Graph, fused_node, fusion
from odt_ops.runtime.fusion.layout_ops import CHANNELS_LAST, FUSED_ELEMENTWISE, TO_FIRST, TO_LAST

Shape = tuple  # of int (a known dimension) or None
SUFFIX = "@nhwc"  # a value's channels-last copy is named <value>@nhwc

# ops whose every output element depends on the inputs' elements at the same position
_ELEMENTWISE = frozenset({"Relu", "HardSwish", "HardSigmoid", "Sigmoid", "Tanh", "Mul", "Add", "Sub", "Div", "Neg",
                          "Where", "Greater", "Less", "GreaterOrEqual", "LessOrEqual", "Equal", "And", "Or", "Not",
                          "Sum", "Identity", "Reciprocal", "Sqrt", "Clip", "LeakyRelu", "Elu", "Erf"})
# (op, input position) that read only a value's size or type: any layout will do
_LAYOUT_BLIND = {("Size", 0), ("CastLike", 1), ("DivideBySize", 1), ("DivideBySize", 2)}


# ---------------------------------------------------------------- value shapes


def value_shapes(graph: onnx.GraphProto, opsets: Mapping[str, int]) -> dict[str, Shape]:
    """Every value's shape as onnx's shape inference sees it (None for an unknown dimension),
    from a copy of the graph without its initializers' data; {} if inference fails."""
    light = onnx.GraphProto(name=graph.name)
    light.node.extend(graph.node)
    light.input.extend(graph.input)
    light.output.extend(graph.output)
    light.value_info.extend(graph.value_info)
    declared = {i.name for i in graph.input}
    light.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                       for t in graph.initializer if t.name not in declared)
    model = onnx.helper.make_model(light, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # an op the checker does not know: no layout decisions, the graph runs as written
        return {}
    shapes = {}
    for info in [*inferred.input, *inferred.value_info, *inferred.output]:
        tensor = info.type.tensor_type
        if tensor.HasField("shape"):
            shapes[info.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
    return shapes


# ---------------------------------------------------------------- which nodes have a channels-last form


class _Shapes:
    """Value shapes: shape inference's, completed where it gave up inside the gradient graph (the
    fused nodes, and ops whose shape it could not follow) by what the layout needs: the rank and
    the channels of the image values around the depthwise convolutions."""

    def __init__(self, g: Graph):
        self.g = g
        self.known: dict[str, Shape] = {}
        for _ in range(3):  # a few sweeps: the node list is not necessarily in order after the fusions
            for node in g.nodes:
                self._complete(node)

    def __call__(self, name: str) -> Shape | None:
        shape = self.known.get(name) or self.g.shape(name)
        constant = self.g.constant(name)
        return constant.shape if shape is None and constant is not None else shape

    def _complete(self, node: onnx.NodeProto) -> None:
        out = node.output[0] if node.output else ""
        known = self(out) if out else None
        if not out or (known is not None and None not in known[:2]):
            return
        first = self(node.input[0]) if node.input else None
        shaped = self.g.producer(node.input[1], "Shape") if node.op_type == "Expand" and len(node.input) > 1 else None
        if node.op_type in _ELEMENTWISE or (node.domain == DOMAIN and node.op_type in {"NormalizationTrainingGrad", *FUSED_ELEMENTWISE}):
            ranked = [sh for sh in map(self, filter(None, node.input)) if sh is not None and len(sh) == 4]
            if ranked:
                self.known[out] = max(ranked, key=lambda sh: sum(d is not None for d in sh[:2]))
        elif shaped is not None:
            expanded = self(shaped.input[0])  # Expand(v, Shape(x)): x's shape
            if expanded is not None:
                self.known[out] = expanded
        elif node.op_type == "ReduceSum" and first is not None and node_attributes(node).get("keepdims", 1):
            self.known[out] = tuple(None for _ in first)  # keeps the rank
        elif node.op_type in ("Conv", "ConvTranspose") and first is not None and len(first) == 4:
            group, w = node_attributes(node).get("group", 1), self(node.input[1])
            if node.op_type == "Conv":
                channels = w[0] if w is not None and len(w) == 4 else (group if group == first[1] else None)
            else:
                channels = w[1] * group if w is not None and len(w) == 4 and w[1] is not None else None
            self.known[out] = (first[0], channels, None, None)


def _is_image(shapes: _Shapes, name: str) -> bool:
    shape = shapes(name)
    return shape is not None and len(shape) == 4


def _broadcasts_anyhow(shapes: _Shapes, name: str) -> bool:
    """A value that broadcasts the same against either layout: one element, rank 0 or 1."""
    shape = shapes(name)
    return shape is not None and len(shape) <= 1 and all(d == 1 for d in shape)


def _rule(g: _Shapes, node: onnx.NodeProto) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(input positions, output positions) the node's channels-last form reads and writes channels
    last, or None if it has none here."""
    op, attrs = node.op_type, node_attributes(node)
    elementwise = op in _ELEMENTWISE if node.domain in STANDARD else (node.domain == DOMAIN and op in FUSED_ELEMENTWISE)
    if elementwise:
        images = tuple(i for i, name in enumerate(node.input) if name and _is_image(g, name))
        others_fit = all(_broadcasts_anyhow(g, name) for i, name in enumerate(node.input) if name and i not in images)
        if images and others_fit and len(node.output) == 1 and _is_image(g, node.output[0]):
            return images, (0,)
        return None
    if node.domain == DOMAIN:
        if op == "NormalizationTrainingGrad" and attrs.get("spread") == [0, 2, 3] and attrs.get("axes") == [0, 2, 3] \
                and _is_image(g, node.input[0]) and _is_image(g, node.input[1]):
            return (0, 1), (0,)
        return None
    if node.domain not in STANDARD:
        return None
    if not _is_image(g, node.input[0]):
        return None
    if op == "BatchNormalization" and attrs.get("spatial", 1) == 1:
        return (0,), (0,)
    if op in ("Conv", "ConvTranspose"):
        x, w = g(node.input[0]), g(node.input[1])
        group = attrs.get("group", 1)
        if w is not None and is_pointwise(w, attrs):
            return (0,), (0,)
        if x is None:
            return None
        if op == "Conv" and w is not None and len(w) == 4 and w[1] is None:
            w = (w[0], 1, *w[2:]) if x[1] == group else w  # a Conv's weights have C/group input channels
        if w is not None and x[1] is not None and is_depthwise_conv(x[1], w, group):
            return (0,), (0,)
        return None
    if op == "GlobalAveragePool":
        return (0,), ()
    if op == "ReduceSum" and attrs.get("keepdims", 1) and not attrs.get("noop_with_empty_axes", 0) \
            and g.g.ints(node, 1, "axes") and _is_image(g, node.output[0]):
        return (0,), (0,)
    if op == "Shape" and "start" not in attrs and "end" not in attrs:
        return (0,), ()
    if op == "Transpose" and "perm" in attrs:
        return (0,), ()
    if op == "Expand" and g(node.input[1]) == (4,) and _is_image(g, node.output[0]):
        return (0,), (0,)
    return None


def is_pointwise(w: Shape, attrs: dict) -> bool:
    """A 1x1 convolution (or transposed one) in one group, stride 1, unpadded: a matrix product per pixel."""
    flat = ("pads", "output_padding")
    return (len(w) == 4 and w[2] == 1 and w[3] == 1 and attrs.get("group", 1) == 1 and "output_shape" not in attrs
            and all(v == 1 for v in attrs.get("strides", [1])) and all(not any(attrs.get(a, [0])) for a in flat)
            and attrs.get("auto_pad", "NOTSET") in ("NOTSET", "VALID"))


def _is_seed(g: _Shapes, node: onnx.NodeProto) -> bool:
    """A depthwise convolution (the pointwise ones join a region, they do not start one)."""
    if node.op_type not in ("Conv", "ConvTranspose") or node.domain not in STANDARD or _rule(g, node) is None:
        return False
    w = g(node.input[1])
    return w is None or not is_pointwise(w, node_attributes(node))


# ---------------------------------------------------------------- the pass


@fusion("channels_last")
def _channels_last(g: Graph) -> bool:
    """Rewrite the nodes reachable from the depthwise convolutions through channels-last forms
    into ChannelsLast nodes, converting at the region's edges only."""
    changed = _stride_one_weight_grads(g)
    if not any(n.op_type in ("Conv", "ConvTranspose") and node_attributes(n).get("group", 1) > 1 for n in g.nodes):
        return changed  # no depthwise convolution: no shape inference either
    shapes = _Shapes(g)
    rules = _region(g, shapes)
    if not rules:
        return changed
    nodes: list[onnx.NodeProto] = []
    made_last: dict[str, onnx.NodeProto] = {}
    last_written = {n.output[o] for n in g.nodes if id(n) in rules for o in rules[id(n)][1]}

    def channels_last(name: str) -> str:
        if name in last_written:
            return name + SUFFIX
        if name not in made_last:  # a value from outside the region, read channels last: one copy
            made_last[name] = fused_node(TO_LAST, [name], [name + SUFFIX], f"layout/{name}{SUFFIX}")
            nodes.append(made_last[name])
        return name + SUFFIX

    for node in g.nodes:
        rule = rules.get(id(node))
        if rule is None:
            nodes.append(node)
            continue
        ins, outs = rule
        inputs = [channels_last(name) if i in ins else name for i, name in enumerate(node.input)]
        outputs = [name + SUFFIX if o in outs else name for o, name in enumerate(node.output)]
        rewritten = fused_node(CHANNELS_LAST, inputs, outputs, f"layout/{node.name or node.output[0]}",
                               layout_op=node.op_type, layout_outputs=len(node.output))
        rewritten.attribute.extend(node.attribute)
        nodes.append(rewritten)
    # every other read of a value the region writes channels last: a read of its size or type
    # takes the channels-last copy, any other wants the value as written
    first = {name for name in last_written if name in g.keep}
    for i, node in enumerate(nodes):
        blind = [j for j, name in enumerate(node.input) if name in last_written and (node.op_type, j) in _LAYOUT_BLIND]
        if blind:
            nodes[i] = node = _copy(node)
            for j in blind:
                node.input[j] += SUFFIX
        first.update(name for name in (*node.input, *implicit_inputs(node)) if name in last_written)
    nodes += [fused_node(TO_FIRST, [name + SUFFIX], [name], f"layout/{name}") for name in sorted(first)]
    g.rewrite(nodes)
    _pointwise_weight_grads(g, shapes)
    _depthwise_weight_grads(g)
    return True


def _layout_transpose(g: Graph, name: str) -> str | None:
    """The channels-last value that ``name`` is Transpose(perm=[1, 0, 2, 3]) of, if so."""
    node = g.made_by(name)
    if node is None or node.op_type != CHANNELS_LAST or node.domain != DOMAIN:
        return None
    attrs = node_attributes(node)
    return node.input[0] if attrs.get("layout_op") == "Transpose" and attrs.get("perm") == [1, 0, 2, 3] else None


def _pointwise_weight_grads(g: Graph, shapes: _Shapes) -> None:
    """A 1x1 Conv's weight gradient (grad/rules/conv.py, _weight_grad) on channels-last X and dY:
    MatMul(Reshape(Unsqueeze([Slice](X^T))), Transpose(Reshape(dY^T))) -> one product
    X^T @ dY of the (pixels, channels) matrices, which BLAS reads in place: the rule's form copied
    both operands across the layout first. The same sums in BLAS's order for the shape."""
    for matmul in [n for n in g.nodes if n.op_type == "MatMul" and n.domain in STANDARD]:
        columns = g.producer(matmul.input[0], "Reshape")
        unsqueeze = g.producer(columns.input[0], "Unsqueeze") if columns else None
        gradient = g.producer(matmul.input[1], "Transpose")
        grads = g.producer(gradient.input[0], "Reshape") if gradient else None
        if columns is None or unsqueeze is None or gradient is None or grads is None \
                or node_attributes(gradient).get("perm") != [0, 2, 1] \
                or g.ints(unsqueeze, 1, "axes") != [1] or g.ints(columns, 1, "shape") is None \
                or (g.ints(columns, 1, "shape") or [0])[0] != 1 or (g.ints(grads, 1, "shape") or [0])[0] != 1:
            continue
        sliced = g.producer(unsqueeze.input[0], "Slice")
        x = _layout_transpose(g, sliced.input[0] if sliced else unsqueeze.input[0])
        dy = _layout_transpose(g, grads.input[0])
        if x is None or dy is None or (sliced is not None and not _whole(g, sliced, shapes(x.removesuffix(SUFFIX)))):
            continue
        chain = [unsqueeze, columns, grads, gradient, matmul] if sliced is None else [sliced, unsqueeze, columns, grads, gradient, matmul]
        fused = fused_node("PointwiseWeightGrad", [x, dy], matmul.output, f"layout/{matmul.name or matmul.output[0]}")
        g.replace(chain, fused)


def _depthwise_weight_grads(g: Graph) -> None:
    """A depthwise Conv's weight gradient on channels-last X and dY: MatMul(Reshape(window columns
    of [Pad](X^T)), Transpose(Reshape(dY^T))) -> one node that, per kernel tap, multiplies the tap's
    view of the padded channels-last X by dY and sums down the rows: no column copy across the
    layout, no C tiny products. The same products, summed in another order."""
    for matmul in [n for n in g.nodes if n.op_type == "MatMul" and n.domain in STANDARD]:
        columns = g.producer(matmul.input[0], "Reshape")
        stack = g.made_by(columns.input[0]) if columns else None
        gradient = g.producer(matmul.input[1], "Transpose")
        grads = g.producer(gradient.input[0], "Reshape") if gradient else None
        if columns is None or stack is None or gradient is None or grads is None or stack.domain != DOMAIN \
                or stack.op_type not in ("StackedSlices", "WindowColumns"):
            continue
        attrs = node_attributes(stack)
        taps = len(attrs["regions"]) // (4 * attrs["rank"])
        group = (g.ints(columns, 1, "shape") or [0])[0]
        if node_attributes(gradient).get("perm") != [0, 2, 1] or attrs["axis"] != 1 or attrs["rank"] != 2 \
                or g.ints(columns, 1, "shape") != [group, taps, -1] or g.ints(grads, 1, "shape") != [group, 1, -1] \
                or any(a not in (2, 3) for a in attrs["regions"][::4]):
            continue
        chain, pads = [stack, columns, grads, gradient, matmul], [0, 0, 0, 0]
        source = stack.input[0]
        pad = g.producer(source, "Pad")
        if stack.op_type == "WindowColumns":
            pads = attrs["pads"]  # checked zero padding of the spatial axes, (begins, ends)
        elif pad is not None:
            padding = _zero_spatial_pads(g, pad)
            if padding is None:
                continue
            chain, pads, source = [pad, *chain], padding, pad.input[0]
        x, dy = _layout_transpose(g, source), _layout_transpose(g, grads.input[0])
        if x is None or dy is None:
            continue
        fused = fused_node("DepthwiseWeightGrad", [x, dy], matmul.output, f"layout/{matmul.name or matmul.output[0]}",
                           regions=attrs["regions"], pads=pads)
        g.replace(chain, fused)


# ``StrideOneWeightGrad`` from this many input channels: with fewer, a tap's product (C rows) is too
# thin and the window columns' one product was as fast or faster (UNet's 1-channel stem 1.5x slower)
_WEIGHT_GRAD_MIN_CHANNELS = 16


def _stride_one_weight_grads(g: Graph) -> bool:
    """A one-group stride-1 2-D Conv's weight gradient as the rule writes it on channels-first X and dY,
    MatMul(Reshape(WindowColumns(Transpose(X, [1, 0, 2, 3]))), Transpose(Reshape(Transpose(dY, [1, 0, 2, 3])))),
    -> one ``StrideOneWeightGrad`` node: per kernel tap one product of X's channels-last padded planes
    and dY, no window columns (measured 1.5x faster on UNet's 32- and 64-channel layers, batch 32).
    The same products summed in another order: rounding only."""
    changed = False
    for matmul in [n for n in g.nodes if n.op_type == "MatMul" and n.domain in STANDARD]:
        columns = g.producer(matmul.input[0], "Reshape")
        stack = g.producer(columns.input[0], "WindowColumns", domains=(DOMAIN,)) if columns else None
        x = g.producer(stack.input[0], "Transpose") if stack else None
        gradient = g.producer(matmul.input[1], "Transpose")
        grads = g.producer(gradient.input[0], "Reshape") if gradient else None
        dy = g.producer(grads.input[0], "Transpose") if grads else None
        if columns is None or stack is None or x is None or gradient is None or grads is None or dy is None:
            continue
        attrs = node_attributes(stack)
        kernel, shape, grads_shape = attrs["kernel"], g.ints(columns, 1, "shape"), g.ints(grads, 1, "shape")
        if len(kernel) != 2 or shape is None or len(shape) != 3 or shape[0] != 1 \
                or shape[1] < _WEIGHT_GRAD_MIN_CHANNELS * kernel[0] * kernel[1] or grads_shape is None \
                or grads_shape[0] != 1 or node_attributes(gradient).get("perm") != [0, 2, 1] \
                or any(node_attributes(t).get("perm") != [1, 0, 2, 3] for t in (x, dy)):
            continue
        fused = fused_node("StrideOneWeightGrad", [x.input[0], dy.input[0]], matmul.output,
                           f"layout/{matmul.name or matmul.output[0]}", kernel=kernel, dilations=attrs["dilations"], pads=attrs["pads"])
        chain = [stack, columns, grads, gradient, matmul]
        # the transposes go too unless another node reads them
        changed = g.replace([x, dy, *chain], fused) or g.replace(chain, fused) or changed
    return changed


def _zero_spatial_pads(g: Graph, pad: onnx.NodeProto) -> list[int] | None:
    """[begin H, begin W, end H, end W] if ``pad`` zero-pads only the last two axes of a rank-4 value by constants >= 0."""
    pads = g.ints(pad, 1, "pads")
    mode = node_attributes(pad).get("mode", "constant")
    value = g.constant(pad.input[2]) if len(pad.input) > 2 and pad.input[2] else np.zeros(1)
    if pads is None or len(pads) != 8 or mode != "constant" or value is None or value.size != 1 or value.reshape(-1)[0] != 0 \
            or (len(pad.input) > 3 and pad.input[3]) or min(pads) < 0 or any(pads[i] for i in (0, 1, 4, 5)):
        return None
    return [pads[2], pads[3], pads[6], pads[7]]


def _whole(g: Graph, sliced: onnx.NodeProto, shape: Shape | None) -> bool:
    """Whether a Slice of Transpose(x, perm=[1, 0, 2, 3]), x of channels-first ``shape``, keeps every
    element: starts 0, step 1, ends past the axis."""
    starts, ends, axes = g.ints(sliced, 1, "starts"), g.ints(sliced, 2, "ends"), g.ints(sliced, 3, "axes")
    steps = g.ints(sliced, 4, "steps") if len(sliced.input) > 4 and sliced.input[4] else [1] * len(starts or [])
    if shape is None or starts is None or ends is None or axes is None or steps is None:
        return False
    sizes = {1: shape[0], 0: shape[1], 2: shape[2], 3: shape[3]}  # Transpose(perm=[1, 0, 2, 3]) of the channels-first value
    return all(s == 0 and st == 1 and sizes.get(a) is not None and e >= sizes[a]
               for s, e, a, st in zip(starts, ends, axes, steps))


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    """A node to edit: the graph's own NodeProtos belong to the caller."""
    copy = onnx.NodeProto()
    copy.CopyFrom(node)
    return copy


def _region(g: Graph, shapes: _Shapes) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The nodes to rewrite, with their rules: the seeds, then every node with a channels-last form
    that reads a value the region writes channels last, or writes one the region reads so."""
    rules: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}  # by id(node): NodeProtos do not hash
    frontier = []
    for n in g.nodes:
        seed = _rule(shapes, n) if _is_seed(shapes, n) else None
        if seed is not None:
            rules[id(n)] = seed
            frontier.append(n)
    while frontier:
        node = frontier.pop()
        ins, outs = rules[id(node)]
        neighbours = [g.made_by(node.input[i]) for i in ins]
        neighbours += [r for o in outs for r in g.consumers(node.output[o])]
        for other in neighbours:
            if other is None or id(other) in rules:
                continue
            rule = _rule(shapes, other)
            if rule is None:
                continue
            o_ins, o_outs = rule
            shared_in = {other.input[i] for i in o_ins} & {node.output[o] for o in outs}
            shared_out = {other.output[o] for o in o_outs} & {node.input[i] for i in ins}
            if shared_in or shared_out:
                rules[id(other)] = rule
                frontier.append(other)
    return rules
