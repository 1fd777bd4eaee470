"""Named graph passes over a Model; each returns whether it changed anything."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from odt_ops.coverage import NOT_SUPPORTED
from odt_ops.domain import is_default, opset_versions
from odt_ops.errors import KernelError, ModelCheckError, OdtError, UnsupportedOpError
from odt_ops.ir import symbolic
from odt_ops.ir.attributes import node_attributes
from odt_ops.ir.binding import bind_kernel, missing_kernels
from odt_ops.ir.graph import implicit_inputs, node_reads
from odt_ops.ir.model import Model

# folding these would freeze a random draw or a training-time behaviour into a weight, or
# (DequantizeLinear) turn a quantized weight into float memory four to eight times its size
NOT_FOLDABLE = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout",
                          "DequantizeLinear"})


def initializers_not_inputs(model: Model) -> bool:
    """Old IR versions list initializers as graph inputs too; make them plain constants."""
    names = {t.name for t in model.graph.initializer}
    keep = [i for i in model.graph.input if i.name not in names]
    if len(keep) == len(model.graph.input):
        return False
    del model.graph.input[:]
    model.graph.input.extend(keep)
    return True


def drop_saved_batch_statistics(model: Model) -> bool:
    """BatchNormalization below opset 14 says it trains by having more than one output: the
    updated running statistics and the batch's mean and inverse deviation (outputs 4 and 5,
    a cache for training backends). Opset 14 has no outputs 4 and 5, onnx's converter aborts
    on them, and its adapter keeps the node in inference mode, which then has one output.
    Exporters leave all four unread, and the artifacts choose each graph's mode themselves
    (odt_ops.ir.modes): drop them before conversion."""
    if model.opset >= 14:
        return False
    read = {n for node in model.graph.node for n in node_reads(node)} | {o.name for o in model.graph.output}
    changed = False
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" or len(node.output) <= 1:
            continue
        used = [n for n in node.output[1:] if n and n in read]
        if used:
            raise ModelCheckError(
                f"{model.source}: BatchNormalization {node.name!r} feeds its training outputs {used} to other nodes, "
                "which onnx cannot convert to opset 14. Re-export the model at opset 14 or later"
            )
        del node.output[1:]
        changed = True
    return changed


def inline_constant_nodes(model: Model) -> bool:
    """Constant nodes become initializers (they are weights in all but name)."""
    initializers_not_inputs(model)
    graph = model.graph
    keep, changed = [], False
    for node in graph.node:
        if node.op_type == "Constant" and is_default(node.domain):
            from odt_ops.kernels.shape import constant

            (value,) = constant(**node_attributes(node))
            graph.initializer.append(numpy_helper.from_array(np.asarray(value), node.output[0]))
            model.derived.add(node.output[0])
            changed = True
        else:
            keep.append(node)
    if changed:
        replace_nodes(model, keep)
    return changed


def fold_constants(model: Model) -> bool:
    """Evaluate every node whose inputs are all constant (ConstantOfShape weights,
    Shape arithmetic, ...) and store its outputs as initializers."""

    graph = model.graph
    const = _LazyConstants(graph.initializer, model)
    parameters = potential_parameters(model)
    static_shapes = _static_shapes(graph)
    known_dims = _known_dims(graph)
    shape_dims: dict[str, list[int | None]] = {}  # a Shape node's output -> the dims it holds, None where unknown
    keep, added = [], []
    reshaped_from: dict[str, str] = {}  # a folded Reshape's (Unsqueeze's, ...) output -> its folded data input
    outputs = {o.name for o in graph.output}
    for node in graph.node:
        value = None
        if node.op_type in NOT_FOLDABLE or not is_default(node.domain):
            keep.append(node)
            continue
        if node.op_type in ("Shape", "Size") and node.input[0] not in const and node.input[0] in static_shapes:
            shape = static_shapes[node.input[0]]
            if node.op_type == "Size":
                value = (np.array(int(np.prod(shape)), dtype=np.int64),)
            else:
                attrs = node_attributes(node)
                value = (np.array(shape, dtype=np.int64)[attrs.get("start", 0) : attrs.get("end", None)],)
        elif node.op_type == "Gather" and node.input[0] in shape_dims and node.input[1] in const:
            # x.size(i) of a value whose dim i is static while others (the batch) are not: the
            # sizes exporters compute from it (MobileViT's patch folding, Resize targets) fold too
            value = _static_dims_at(shape_dims[node.input[0]], const[node.input[1]])
        elif node.input and all(n == "" or n in const for n in node_reads(node)) and not parameters.intersection(node_reads(node)):
            try:  # a subgraph's outer reads follow the inputs (odt_ops/kernels/control_flow.py)
                fn = bind_kernel(node, model.opset)
                value = fn(*[const[n] if n else None for n in node.input], *[const[n] for n in implicit_inputs(node)])
            except (OdtError, ArithmeticError, ValueError, TypeError, IndexError):
                value = None  # leave it to run time, where errors name the node
        if value is None:
            if node.op_type == "Shape" and node.input[0] in known_dims:
                attrs = node_attributes(node)
                shape_dims[node.output[0]] = known_dims[node.input[0]][attrs.get("start", 0) : attrs.get("end", None)]
            keep.append(node)
            continue
        for name, v in zip(node.output, value):
            if name:
                const[name] = np.asarray(v)
                added.append(name)
        if node.op_type in _SAME_VALUES and node.input[0] in added:
            reshaped_from[node.output[0]] = node.input[0]
    if not added:
        return False
    used = {n for node in keep for n in node_reads(node)} | outputs  # subgraphs read outer values by name
    names = _names_users_gave(added, used, reshaped_from, keep, outputs, {t.name for t in graph.initializer})
    for name in added:
        if name in used:
            graph.initializer.append(numpy_helper.from_array(const[name], names.get(name, name)))
            model.derived.add(names.get(name, name))
    if names:
        for node in keep:
            node.input[:] = [names.get(n, n) for n in node.input]
        # the source's recorded shape is the one before the Reshape: let inference find it again
        stale = set(names) | set(names.values())
        kept_info = [v for v in graph.value_info if v.name not in stale]
        del graph.value_info[:]
        graph.value_info.extend(kept_info)
    replace_nodes(model, keep)
    prune_unused(model)
    return True


# ops that hand their data input's values on unchanged, only in another shape
_SAME_VALUES = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity"})


def _names_users_gave(added: list[str], used: set[str], reshaped_from: dict[str, str], keep: list[onnx.NodeProto],
                      outputs: set[str], taken: set[str]) -> dict[str, str]:
    """{folded value: the name to store it under}: a weight the file makes as ConstantOfShape ->
    Reshape (the onnx zoo's inception and densenet do) keeps the name its maker gave it, the one
    a user reads in the file and passes to requires_grad, rather than the Reshape's output name.
    Only where nothing else reads the original value and no subgraph reads the folded one by name."""
    implicit = {n for node in keep for n in implicit_inputs(node)}
    renamed: dict[str, str] = {}
    claimed = set(taken)
    for name in added:
        if name not in used or name in outputs or name in implicit or name not in reshaped_from:
            continue
        source = name
        while source in reshaped_from and reshaped_from[source] not in used and reshaped_from[source] not in claimed:
            source = reshaped_from[source]
        if source != name:
            renamed[name] = source
            claimed.add(source)
    return renamed


def potential_parameters(model: Model) -> set[str]:
    """The model's own float tensors (not folded results, not scalars): a user may train them,
    so folding never turns one into a new initializer of another name (a Transpose of a
    weight in an export made without constant folding stays a Transpose of that weight)."""
    return {t.name for t in model.graph.initializer
            if t.name not in model.derived and t.data_type in _FLOAT_TYPES and int(np.prod(t.dims, dtype=np.int64)) > 1}


_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})


class _LazyConstants(dict):
    """Initializer arrays, decoded only when a foldable node reads them (weights mostly are not)."""

    def __init__(self, initializers, model: Model):
        super().__init__()
        self._protos = {t.name: t for t in initializers}
        self._model = model

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or name in self._protos

    def __missing__(self, name: str) -> np.ndarray:
        from odt_ops.ir.model import tensor_to_array

        value = tensor_to_array(self._protos[name], self._model.base_dir, self._model.source)
        self[name] = value
        return value


def unique_node_names(model: Model) -> bool:
    """Every node gets a name, unique in the graph (errors and gradients refer to them)."""
    seen: set[str] = set()
    changed = False
    for i, node in enumerate(model.graph.node):
        name = node.name or f"{node.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        if name != node.name:
            node.name = name
            changed = True
        seen.add(name)
    produced: set[str] = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    for node in model.graph.node:
        for out in node.output:
            if out and out in produced:
                raise ModelCheckError(f"{model.source}: value {out!r} is produced twice (node {node.name!r}); values must be unique")
            produced.add(out)
    return changed


def symbolic_batch_dim(model: Model, name: str = "batch") -> bool:
    """Give every data input of rank >= 2 a symbolic first dimension, so one model
    serves every batch size; output shapes are then re-inferred."""
    if any(v.type.tensor_type.HasField("shape") and len(v.type.tensor_type.shape.dim) >= 2
           and v.type.tensor_type.shape.dim[0].dim_param != name for v in model.graph.input):
        _shapes_keep_batch(model)
    changed = False
    for value in model.graph.input:
        tt = value.type.tensor_type
        if not tt.HasField("shape") or len(tt.shape.dim) < 2:
            continue
        # a time-major recurrent input (odt_ops.ir.recurrent) has its batch at axis 1
        dim = tt.shape.dim[model.batch_axes.get(value.name, 0)]
        if dim.dim_param != name:
            dim.Clear()
            dim.dim_param = name
            changed = True
    if changed:
        del model.graph.value_info[:]
        for out in model.graph.output:
            tt = out.type.tensor_type
            if not tt.HasField("shape") or not len(tt.shape.dim):
                continue
            if model.batch_axes:  # where the batch lands in each output is inference's to say
                tt.ClearField("shape")
            else:
                tt.shape.dim[0].Clear()
                tt.shape.dim[0].dim_param = name
    return changed


def _shapes_keep_batch(model: Model) -> None:
    """Exporters bake the batch size a model was traced with into shape constants: a Resize's
    ``sizes``, a Reshape's target (``x.view(x.size(0), -1)`` traces to ``[2, -1]``). Once the
    batch is symbolic these would resize the batch, or fold it into another axis. Where such a
    constant keeps its input's batch as it was, it stops naming it: the Resize names its other
    axes instead (``axes``, opset 18) and the Reshape copies the batch (0 in its target)."""
    constants = {t.name: t for t in model.graph.initializer}
    resizes = [n for n in model.graph.node if n.op_type == "Resize" and len(n.input) > 3 and n.input[3] in constants
               and not any(a.name == "axes" for a in n.attribute) and model.opset >= 18]
    reshapes = [n for n in model.graph.node if n.op_type == "Reshape" and n.input[1] in constants
                and not any(a.name == "allowzero" and a.i for a in n.attribute)]
    if not resizes and not reshapes:
        return
    try:
        inferred = onnx.shape_inference.infer_shapes(model.proto).graph
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        return
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in (*inferred.input, *inferred.value_info) if v.type.tensor_type.HasField("shape")}
    taken = {t.name for t in model.graph.initializer}

    def replace(node: onnx.NodeProto, index: int, value: np.ndarray, hint: str) -> None:
        fresh = f"{node.input[index]}/{hint}"
        while fresh in taken:
            fresh += "_"
        taken.add(fresh)
        model.graph.initializer.append(numpy_helper.from_array(value.astype(np.int64), fresh))
        node.input[index] = fresh

    for node in resizes:
        sizes = numpy_helper.to_array(constants[node.input[3]])
        shape = shapes.get(node.input[0])
        if shape is None or len(shape) != sizes.size or shape[0] is None or int(sizes[0]) != shape[0]:
            continue
        replace(node, 3, sizes[1:], "without_batch")
        node.attribute.append(onnx.helper.make_attribute("axes", list(range(1, sizes.size))))
    for node in reshapes:
        target = numpy_helper.to_array(constants[node.input[1]])
        shape = shapes.get(node.input[0])
        if shape is None or not shape or shape[0] is None or target.ndim != 1 or not target.size or int(target[0]) != shape[0]:
            continue
        copied = target.copy()
        copied[0] = 0  # "copy the input's dim", whatever the batch
        replace(node, 1, copied, "batch_copied")
    model.forget_arrays()


def complete_output_types(model: Model) -> bool:
    """Graph outputs declared without a shape get the inferred one (the checker requires it)."""
    outputs = [o for o in model.graph.output if o.type.HasField("tensor_type") and not o.type.tensor_type.HasField("shape")]
    if not outputs:
        return False
    try:
        inferred = onnx.shape_inference.infer_shapes(model.proto, data_prop=True).graph
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        return False  # the checker will say what is wrong
    types = {v.name: v.type for v in (*inferred.value_info, *inferred.output)}
    changed = False
    for out in outputs:
        tp = types.get(out.name)
        if tp is not None and tp.tensor_type.HasField("shape"):
            out.type.CopyFrom(tp)
            changed = True
    return changed


# ops whose output has its first input's type and shape, for which onnx's shape inference
# gives nothing (GroupNormalization-21 has no inference function): without the type, no
# gradient downstream can be unbroadcast
SAME_TYPE_AS_INPUT = frozenset({"GroupNormalization"})


def infer_shapes(model: Model) -> bool:
    def infer(proto: onnx.ModelProto) -> onnx.ModelProto:
        return onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=True, data_prop=True)

    try:
        inferred = infer(model.proto)
        if _complete_same_type_outputs(inferred.graph):  # then propagate the types they give
            inferred = infer(inferred)
        inferred = symbolic.refine_shapes(inferred, infer)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as exc:
        raise ModelCheckError(f"{model.source}: shape inference failed: {exc}") from None
    model.proto = inferred
    return True


def _complete_same_type_outputs(graph: onnx.GraphProto) -> bool:
    known = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output) if v.type.HasField("tensor_type")}
    changed = False
    for node in graph.node:
        if node.op_type not in SAME_TYPE_AS_INPUT or not node.output or node.input[0] not in known:
            continue
        out = node.output[0]
        if out in known and known[out].type.tensor_type.HasField("shape"):
            continue
        source = known[node.input[0]]
        existing = next((v for v in (*graph.value_info, *graph.output) if v.name == out), None)
        if existing is None:
            existing = graph.value_info.add()
            existing.name = out
        existing.type.CopyFrom(source.type)
        known[out] = existing
        changed = True
    return changed


def prune_unused(model: Model) -> bool:
    """Drop nodes and initializers that no graph output depends on."""
    graph = model.graph
    needed = {o.name for o in graph.output}
    live = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            live.append(node)
            needed.update(node_reads(node))  # with what its subgraphs read from outside
    live.reverse()
    inits = [t for t in graph.initializer if t.name in needed]
    changed = len(live) != len(graph.node) or len(inits) != len(graph.initializer)
    if changed:
        replace_nodes(model, live)
        del graph.initializer[:]
        graph.initializer.extend(inits)
        model.forget_arrays()
    return changed


def require_kernels(model: Model) -> bool:
    """Reject, in one error, every op that has no kernel (before anything runs)."""

    opsets = opset_versions(model.proto.opset_import)
    missing = missing_kernels(model.graph.node, opsets)
    if missing:
        raise UnsupportedOpError(missing, reasons=NOT_SUPPORTED)
    return False


def replace_nodes(model: Model, nodes: list[onnx.NodeProto]) -> None:
    """Make ``nodes`` (copied: they may be the graph's own) the graph's nodes."""
    kept = [onnx.NodeProto() for _ in nodes]
    for dst, src in zip(kept, nodes):
        dst.CopyFrom(src)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    model.forget_arrays()


def _known_dims(graph: onnx.GraphProto) -> dict[str, list[int | None]]:
    """Each value of known rank: its dims, None where not a number (a symbolic batch)."""
    dims = {}
    for v in (*graph.input, *graph.value_info, *graph.output):
        tt = v.type.tensor_type
        if tt.HasField("shape"):
            dims[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
    return dims


def _static_dims_at(dims: list[int | None], indices: np.ndarray) -> tuple[np.ndarray] | None:
    """Gather(shape, indices) when every gathered dim is a number, else None."""
    if indices.dtype.kind not in "iu" or indices.ndim > 1:
        return None
    picked = []
    for i in np.ravel(indices).tolist():
        if not -len(dims) <= i < len(dims) or dims[i] is None:
            return None
        picked.append(dims[i])
    return (np.array(picked if indices.ndim else picked[0], dtype=np.int64),)


def _static_shapes(graph: onnx.GraphProto) -> dict[str, list[int]]:
    shapes = {}
    for v in (*graph.input, *graph.value_info, *graph.output):
        tt = v.type.tensor_type
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            shapes[v.name] = [d.dim_value for d in tt.shape.dim]
    return shapes


__all__ = [
    "KernelError",
    "fold_constants",
    "infer_shapes",
    "initializers_not_inputs",
    "inline_constant_nodes",
    "prune_unused",
    "require_kernels",
    "symbolic_batch_dim",
    "unique_node_names",
]
