"""Turn an ONNX Runtime training artifact directory into ours, so training continues where ONNX Runtime stopped.

ONNX Runtime's artifacts cannot be run as they are (their training and optimizer models
use its com.microsoft gradient and optimizer kernels), but they say everything needed
to regenerate ours:

- ``eval_model.onnx`` is the forward graph plus the loss block, with the parameters as
  graph inputs. The loss block is recognised by the nodes ONNX Runtime's onnxblock losses
  emit (SoftmaxCrossEntropyLoss; Sub, Pow, Reduce*; Sub, Abs, Reduce*; Sigmoid, Log, Mul,
  Add, Neg, Reduce*), and the forward model is what the loss's input depends on, with the
  checkpoint's values put back as initializers.
- ``optimizer_model.onnx`` holds one com.microsoft AdamWOptimizer or SGDOptimizerV2 node
  (and InplaceClipGradNorm when clipping), whose attributes are the hyperparameters.
- the checkpoint (``checkpoint``, ONNX Runtime's FlatBuffer) holds the parameters, which
  are trainable, the optimizer's step and moments and the property bag.

``import_ort_artifacts`` regenerates our artifacts with ``generate_artifacts`` from these
(same trainable and frozen names, loss and optimizer) and writes our checkpoint with
ONNX Runtime's values and optimizer state. What cannot be carried over exactly is an
ArtifactError naming it, never a silently different training run.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from odt_ops.artifacts import generate_artifacts
from odt_ops.checkpoint import Checkpoint, OptimizerState, check_matches, load_checkpoint, save_checkpoint
from odt_ops.checkpoint.ort import read_ort_checkpoint
from odt_ops.domain import is_default
from odt_ops.errors import ArtifactError, CheckpointError
from odt_ops.ir import external
from odt_ops.ir.graph import producers
from odt_ops.ir.load import read_model
from odt_ops.onnxblock import Block, optim
from odt_ops.onnxblock import loss as losses

MS = "com.microsoft"
_REDUCTIONS = {"ReduceMean": "mean", "ReduceSum": "sum"}


@dataclass
class OrtArtifacts:
    """What an ONNX Runtime artifact directory says, in our terms."""

    forward: onnx.ModelProto  # the forward model, parameters as initializers
    trainable: list[str]
    frozen: list[str]
    loss: Block | None  # None: the eval model has no loss block ONNX Runtime emits
    loss_kind: str  # "CrossEntropyLoss", "MSELoss", ... or "none"
    loss_inputs: list[str]  # the forward outputs the loss reads
    additional_outputs: list[str]
    optimizer: optim.Optimizer | None
    checkpoint: Checkpoint
    notes: list[str] = field(default_factory=list)


class _Loss(Block):
    """One of our loss blocks, built with ONNX Runtime's name for its target input."""

    takes_all_outputs = False

    def __init__(self, inner: Block, target: str):
        self.inner, self.target = inner, target

    def build(self, output_name: str) -> str:
        return self.inner.build(output_name, self.target)


def read_ort_artifacts(ort_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None, prefix: str = "") -> OrtArtifacts:
    """Read ``ort_dir``'s eval model, optimizer model and checkpoint (``checkpoint`` names
    another ONNX Runtime checkpoint file, e.g. one saved after training)."""
    ort_dir = Path(ort_dir)
    eval_path = ort_dir / f"{prefix}eval_model.onnx"
    eval_model = _load(eval_path)
    ckpt_path = Path(checkpoint) if checkpoint is not None else ort_dir / f"{prefix}checkpoint"
    shapes = {i.name: _static_shape(i) for i in eval_model.graph.input}
    ckpt = read_ort_checkpoint(ckpt_path, shapes=shapes)
    inputs = {i.name for i in eval_model.graph.input}
    absent = [n for n in ckpt.parameters if n not in inputs]
    if absent:
        raise ArtifactError(f"{ckpt_path}: parameters {absent} are not inputs of {eval_path}; the checkpoint is not of these artifacts")
    declared = {i.name: (shapes[i.name], helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
                for i in eval_model.graph.input if i.name in ckpt.parameters and shapes[i.name] is not None
                and _numeric(i.type.tensor_type.elem_type)}
    check_matches(ckpt, declared, f"{ckpt_path} (against {eval_path.name})")
    loss_info = _split_loss(eval_model, set(ckpt.parameters), str(eval_path))
    forward = _forward_model(eval_model, ckpt, loss_info, str(eval_path))
    opt_path = ort_dir / f"{prefix}optimizer_model.onnx"
    optimizer = _optimizer(_load(opt_path), str(opt_path)) if opt_path.exists() else None
    trainable = [n for n in ckpt.parameters if ckpt.requires_grad.get(n)]
    frozen = [n for n in ckpt.parameters if not ckpt.requires_grad.get(n)]
    return OrtArtifacts(forward, trainable, frozen, loss_info["block"], loss_info["kind"], loss_info["forward_outputs"],
                        loss_info["extra"], optimizer, ckpt)


def import_ort_artifacts(ort_dir: str | os.PathLike, out_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                         prefix: str = "") -> dict[str, Path]:
    """Write our artifacts and checkpoint for ONNX Runtime's in ``ort_dir`` to ``out_dir``;
    returns the written paths by kind."""
    return write_artifacts(read_ort_artifacts(ort_dir, checkpoint, prefix), out_dir, prefix)


def write_artifacts(ort: OrtArtifacts, out_dir: str | os.PathLike, prefix: str = "") -> dict[str, Path]:
    """Our artifacts for what ``read_ort_artifacts`` read, and our checkpoint with its values."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = generate_artifacts(ort.forward, requires_grad=ort.trainable, frozen_params=ort.frozen, loss=ort.loss,
                               optimizer=ort.optimizer, artifact_directory=out_dir, prefix=prefix,
                               additional_output_names=ort.additional_outputs or None,
                               loss_input_names=ort.loss_inputs if ort.loss is not None else None)
    ours = load_checkpoint(paths["checkpoint"])
    ours = Checkpoint(parameters={n: np.array(a) for n, a in ours.parameters.items()}, requires_grad=dict(ours.requires_grad),
                      buffers={n: np.array(a) for n, a in ours.buffers.items()}, properties=dict(ort.checkpoint.properties))
    ours.optimizer = _optimizer_state(ort, ours)
    if ort.checkpoint.nominal:  # ONNX Runtime's has names only: so does ours
        ours.make_nominal()
    save_checkpoint(ours, paths["checkpoint"])
    return paths


def _load(path: Path) -> onnx.ModelProto:
    """The model with its external data moved in, read by our reader (external data only from
    regular files inside the artifact folder; see odt_ops.ir.external), not onnx.load."""
    if not path.is_file():
        raise ArtifactError(f"{path}: no such file; an ONNX Runtime artifact directory has eval_model.onnx and checkpoint "
                            "(and optimizer_model.onnx when generate_artifacts was given an optimizer)")
    model = read_model(path)
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            external.inline(tensor, model.base_dir, model.source)
    return model.proto


def _numeric(elem_type: int) -> bool:
    try:
        return helper.tensor_dtype_to_np_dtype(elem_type).kind in "biufc"
    except KeyError:  # UNDEFINED, or a type this onnx does not know
        return False


def _static_shape(value: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    dims = value.type.tensor_type.shape.dim
    if not value.type.tensor_type.HasField("shape") or not all(d.HasField("dim_value") for d in dims):
        return None
    return tuple(d.dim_value for d in dims)


# ------------------------------------------------------------------------------------------- the loss block


def _split_loss(model: onnx.ModelProto, params: set[str], where: str) -> dict:
    """Recognise ONNX Runtime's loss block at the eval model's first output."""
    graph = model.graph
    producer = producers(graph.node)
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    outputs = [o.name for o in graph.output]
    if not outputs:
        raise ArtifactError(f"{where}: the eval model has no outputs")
    node = producer.get(outputs[0])

    def made_by(name: str, *ops: str) -> onnx.NodeProto | None:
        n = producer.get(name)
        return n if n is not None and n.op_type in ops else None

    def const(name: str):
        return consts.get(name)

    found = None
    if node is not None and node.op_type in ("SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossInternal"):
        found = _cross_entropy(node, const, where)
    elif node is not None:
        reduction, core = ("none", node)
        if node.op_type in _REDUCTIONS:
            reduction, core = _REDUCTIONS[node.op_type], producer.get(node.input[0])
        weight = None
        if core is not None and core.op_type == "Mul" and any(const(i) is not None for i in core.input):
            # BCEWithLogitsLoss's per-element weight: Mul(weight, Neg(...))
            w_in = next(i for i in core.input if const(i) is not None)
            inner = made_by(next(i for i in core.input if i != w_in), "Neg")
            if inner is not None:
                weight, core = const(w_in), inner
        if core is not None and core.op_type == "Pow" and _is_scalar(const(core.input[1]), 2.0):
            sub = made_by(core.input[0], "Sub")
            if sub is not None:
                found = ("MSELoss", losses.MSELoss(reduction), sub.input[0], sub.input[1])
        elif core is not None and core.op_type == "Abs":
            sub = made_by(core.input[0], "Sub")
            if sub is not None:
                found = ("L1Loss", losses.L1Loss(reduction), sub.input[0], sub.input[1])
        elif core is not None and core.op_type == "Neg":
            found = _bce(core, made_by, const, reduction, weight)
    if found is None:
        return {"kind": "none", "block": None, "forward_outputs": outputs, "extra": [], "target": None}
    kind, block, forward_output, target = found
    if target in params or target not in {i.name for i in graph.input}:
        raise ArtifactError(f"{where}: the {kind} block's target {target!r} is not a data input of the eval model")
    extra = outputs[1:]  # additional_output_names, which may name the loss's input too
    return {"kind": kind, "block": _Loss(block, target), "forward_outputs": [forward_output], "extra": extra, "target": target}


def _is_scalar(value, expected: float) -> bool:
    return value is not None and value.size == 1 and float(value.ravel()[0]) == expected


def _cross_entropy(node: onnx.NodeProto, const, where: str):
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    reduction = attrs.get("reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else str(reduction)
    ignore_index = attrs.get("ignore_index")
    weight = None
    if len(node.input) > 2 and node.input[2]:
        weight = const(node.input[2])
        if weight is None:
            raise ArtifactError(f"{where}: the cross-entropy weight {node.input[2]!r} is not a constant of the eval model")
    if node.op_type == "SoftmaxCrossEntropyLossInternal" and len(node.input) > 3 and node.input[3]:
        value = const(node.input[3])
        if value is None:
            raise ArtifactError(f"{where}: the cross-entropy ignore_index {node.input[3]!r} is not a constant of the eval model")
        if value.size != 1:
            raise ArtifactError(f"{where}: the cross-entropy ignore_index {node.input[3]!r} is not a scalar")
        ignore_index = int(value.ravel()[0])
    block = losses.CrossEntropyLoss(weight=weight, reduction=reduction, ignore_index=ignore_index)
    return "CrossEntropyLoss", block, node.input[0], node.input[1]


def _bce(neg: onnx.NodeProto, made_by, const, reduction: str, weight):
    """-(log(sigmoid(x)) * y [* pos_weight] + log(1 - sigmoid(x)) * (1 - y)), as ONNX Runtime writes it."""
    add = made_by(neg.input[0], "Add")
    if add is None:
        return None
    first = made_by(add.input[0], "Mul")
    second = made_by(add.input[1], "Mul")
    if first is None or second is None:
        return None
    pos_weight = None
    if any(const(i) is not None for i in first.input):  # Mul(Mul(log_sig, y), pos_weight)
        pos_in = next(i for i in first.input if const(i) is not None)
        pos_weight = const(pos_in)
        first = made_by(next(i for i in first.input if i != pos_in), "Mul")
        if first is None:
            return None
    log = made_by(first.input[0], "Log")
    sigmoid = made_by(log.input[0], "Sigmoid") if log is not None else None
    if sigmoid is None:
        return None
    block = losses.BCEWithLogitsLoss(weight=weight, reduction=reduction, pos_weight=pos_weight)
    return "BCEWithLogitsLoss", block, sigmoid.input[0], first.input[1]


# ------------------------------------------------------------------------------------------- the forward model


def _forward_model(model: onnx.ModelProto, ckpt: Checkpoint, loss: dict, where: str) -> onnx.ModelProto:
    """The nodes the forward outputs depend on, the parameters back as initializers."""
    graph = model.graph
    wanted = list(dict.fromkeys([*loss["forward_outputs"], *loss["extra"]]))
    producer = producers(graph.node)
    needed: set[str] = set()
    stack = list(wanted)
    keep: set[int] = set()
    while stack:
        name = stack.pop()
        if name in needed:
            continue
        needed.add(name)
        node = producer.get(name)
        if node is not None and id(node) not in keep:
            keep.add(id(node))
            stack.extend(i for i in node.input if i)
            stack.extend(_subgraph_inputs(node))
    nodes = [n for n in graph.node if id(n) in keep]
    if loss["target"] is not None and loss["target"] in needed:
        raise ArtifactError(f"{where}: the forward outputs {wanted} depend on the loss target {loss['target']!r}; "
                            "the loss block cannot be separated from the forward graph")
    params = set(ckpt.parameters)
    inputs = [i for i in graph.input if i.name in needed and i.name not in params]
    initializers = [t for t in graph.initializer if t.name in needed]
    for name in ckpt.parameters:  # every parameter, so the trainable and frozen lists stay ONNX Runtime's
        shape, dtype = ckpt.spec(name)
        value = np.zeros(shape, dtype) if name in ckpt.missing else ckpt.parameters[name]
        initializers.append(numpy_helper.from_array(np.asarray(value), name))
    types = _value_types(model)
    outputs = []
    for name in wanted:
        if name not in types:
            raise ArtifactError(f"{where}: the type of forward output {name!r} cannot be inferred")
        outputs.append(onnx.ValueInfoProto(name=name, type=types[name]))
    used_domains = {n.domain for n in nodes} | {""}
    opsets = [o for o in model.opset_import if o.domain in used_domains or (is_default(o.domain) and "" in used_domains)]
    forward_graph = helper.make_graph(nodes, graph.name or "forward", inputs, outputs, initializers)
    forward = helper.make_model(forward_graph, opset_imports=opsets, ir_version=model.ir_version)
    forward.producer_name = "odt_ops.ort_import"
    return forward


def _subgraph_inputs(node: onnx.NodeProto) -> list[str]:
    """Outer-scope names read by a node's subgraphs (If, Loop, Scan bodies)."""
    names = []
    for attr in node.attribute:
        for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
            produced = {i.name for i in g.input} | {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
            names += [i for n in g.node for i in (*n.input, *_subgraph_inputs(n)) if i and i not in produced]
    return names


def _value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:
        inferred = model
    g = inferred.graph
    return {v.name: v.type for v in (*g.value_info, *g.output, *g.input) if v.type.HasField("tensor_type")
            and v.type.tensor_type.elem_type}


# ------------------------------------------------------------------------------------------- the optimizer


def _optimizer(model: onnx.ModelProto, where: str) -> optim.Optimizer:
    max_norm = None
    found = None
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.domain != MS:
            continue
        if node.op_type == "InplaceClipGradNorm":
            max_norm = float(attrs.get("max_norm", 1.0))
        elif node.op_type == "AdamWOptimizer":
            if int(attrs.get("correct_bias", 1)) != 1:
                raise ArtifactError(f"{where}: AdamWOptimizer without bias correction (correct_bias=0) has no odt_ops "
                                    "counterpart; regenerate with bias_correction=True")
            mode = int(attrs.get("adam_mode", 0))
            if mode not in (0, 1):
                raise ArtifactError(f"{where}: AdamWOptimizer adam_mode={mode} is unknown (0: torch, 1: transformers)")
            found = ("AdamW", dict(betas=(float(attrs.get("alpha", 0.9)), float(attrs.get("beta", 0.999))),
                                   eps=float(attrs.get("epsilon", 1e-8)), weight_decay=float(attrs.get("weight_decay", 0.0)),
                                   mode="ort" if mode == 1 else "torch"))
        elif node.op_type == "SGDOptimizerV2":
            found = ("SGD", {})
    if found is None:
        ops = sorted({f"{n.domain or 'ai.onnx'}::{n.op_type}" for n in model.graph.node})
        raise ArtifactError(f"{where}: no AdamWOptimizer or SGDOptimizerV2 node (the optimizer model has {ops}); "
                            "odt_ops imports ONNX Runtime's AdamW and SGD")
    kind, params = found
    cls = optim.AdamW if kind == "AdamW" else optim.SGD
    return cls(max_norm=max_norm, **params)


def _optimizer_state(ort: OrtArtifacts, ours: Checkpoint) -> OptimizerState | None:
    """ONNX Runtime's step, learning rate and moments, checked against our optimizer's states."""
    theirs = ort.checkpoint.optimizer
    if theirs is None or ort.optimizer is None:
        return None
    names = tuple(ort.optimizer.state_names)
    states: dict[str, dict[str, np.ndarray]] = {}
    for param in ort.trainable:
        got = theirs.states.get(param, {})
        missing = [s for s in names if s not in got]
        if missing and names:
            raise CheckpointError(f"the ONNX Runtime checkpoint has no {missing} for {param!r} (it has {sorted(got)}); "
                                  f"{ort.optimizer.kind} needs {list(names)}")
        states[param] = {s: np.array(got[s]) for s in names}
    return OptimizerState(step=theirs.step, learning_rate=theirs.learning_rate,
                          initial_learning_rate=theirs.initial_learning_rate, states=states)


__all__ = ["OrtArtifacts", "import_ort_artifacts", "read_ort_artifacts", "write_artifacts"]
