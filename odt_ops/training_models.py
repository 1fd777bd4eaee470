"""From a model whose graph ends in a loss, the training and eval models.

Shared by generate_artifacts (which adds a loss block to a forward model) and
onnxblock.TrainingBlock (where the user's block has added it). Parameters become graph
inputs, in ONNX Runtime's order after the user's inputs and labels; the eval graph runs
in inference mode and the training graph in training mode (odt_ops.ir.modes); the
training graph gains a gradient output per trainable parameter and an output per
updated BatchNormalization statistic; both carry the roles in their metadata (meta).
"""
from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import onnx
from onnx import helper

from odt_ops import meta
from odt_ops.errors import ArtifactError
from odt_ops.grad.build import build_gradients
from odt_ops.ir.builder import GraphBuilder
from odt_ops.ir.graph import node_reads
from odt_ops.ir.model import TARGET_IR_VERSION, Model
from odt_ops.ir.modes import set_inference_mode, set_training_mode


@dataclass(frozen=True)
class ParameterSplit:
    trainable: list[str]
    frozen: list[str]
    buffers: list[str]


def training_graphs(with_loss: onnx.ModelProto, split: ParameterSplit, loss_name: str, extra: Sequence[str],
                    user_inputs: Sequence[str], inference_outputs: Sequence[str], prefix: str = "", *,
                    input_gradients: Sequence[str] = ()) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The (training, eval) models, checked and with their metadata. ``input_gradients`` names
    graph inputs whose gradients the training model also puts out (a TrainingBlock may ask)."""
    eval_model = _with_parameters_as_inputs(with_loss, split, loss_name, extra, training=False)
    train_model = _with_parameters_as_inputs(with_loss, split, loss_name, extra, training=True)
    all_grads = _add_gradients(train_model, loss_name, [*split.trainable, *input_gradients])
    grads = {p: g for p, g in all_grads.items() if p in split.trainable}
    buffer_updates = _buffer_updates(train_model, split)
    weights = {*split.trainable, *split.frozen, *split.buffers}
    info = meta.ArtifactInfo(
        user_inputs=list(user_inputs),
        labels=[i.name for i in eval_model.graph.input if i.name not in set(user_inputs) and i.name not in weights],
        trainable=split.trainable,
        frozen=split.frozen,
        buffers=split.buffers,
        loss=loss_name,
        extra_outputs=list(extra),
        gradients=grads,
        buffer_updates=buffer_updates,
        inference_outputs=list(inference_outputs),
        input_gradients={n: all_grads[n] for n in input_gradients},
    )
    models = []
    for kind, proto in (("training_model", train_model), ("eval_model", eval_model)):
        meta.write(proto, info)
        models.append(finish(proto, f"{prefix}{kind}.onnx"))
    return models[0], models[1]


def _with_parameters_as_inputs(with_loss: onnx.ModelProto, split: ParameterSplit, loss_name: str, extra: Sequence[str],
                               *, training: bool) -> onnx.ModelProto:
    """A copy with parameters as inputs, the graph's mode set, and outputs [loss, *extra]."""
    proto = onnx.ModelProto()
    proto.CopyFrom(with_loss)
    graph = proto.graph
    as_inputs = [*split.trainable, *split.frozen, *split.buffers]
    moved = {t.name: t for t in graph.initializer if t.name in set(as_inputs)}
    kept = [t for t in graph.initializer if t.name not in moved]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    # ONNX Runtime's order: the user's inputs, the labels, then the parameters (ported code
    # reads module.input_names() against graph.input[:n])
    graph.input.extend(helper.make_tensor_value_info(n, moved[n].data_type, list(moved[n].dims)) for n in as_inputs)
    (set_training_mode if training else set_inference_mode)(graph)
    graph = _inferred(proto).graph  # the loss's own type: float64 models, reduction="none" keeps a shape
    types = {v.name: v for v in (*graph.output, *graph.value_info)}
    missing = [n for n in extra if n not in types]
    if missing:
        raise ArtifactError(f"additional outputs {missing} are not values of the model")
    del graph.output[:]
    graph.output.append(types.get(loss_name) or helper.make_tensor_value_info(loss_name, onnx.TensorProto.FLOAT, []))
    for name in extra:
        graph.output.append(types[name])
    return _inferred(proto)


def _add_gradients(proto: onnx.ModelProto, loss_name: str, wrt: Sequence[str]) -> dict[str, str]:
    if not wrt:
        return {}
    result = build_gradients(proto, loss_name, list(wrt))
    proto.graph.node.extend(result.nodes)
    proto.graph.initializer.extend(result.initializers)
    grads = {}
    for param, grad in result.grads.items():
        proto.graph.output.append(_typed_like(proto, grad, param))
        grads[param] = grad
    return grads


def _buffer_updates(proto: onnx.ModelProto, split: ParameterSplit) -> dict[str, str]:
    """BatchNormalization in training mode outputs new running statistics: expose them."""
    updates = {}
    b = GraphBuilder(taken={n for node in proto.graph.node for n in (*node.input, *node.output)})
    for node in proto.graph.node:
        if node.op_type != "BatchNormalization":
            continue
        outs = list(node.output) + [""] * (3 - len(node.output))
        for i, buf in ((1, node.input[3]), (2, node.input[4])):
            if buf in split.buffers:
                outs[i] = outs[i] or b.fresh(f"{buf}/updated")
                updates[buf] = outs[i]
        del node.output[:]
        node.output.extend(outs)
    for buf, out in updates.items():
        proto.graph.output.append(_typed_like(proto, out, buf))
    return updates


def _typed_like(proto: onnx.ModelProto, name: str, like: str) -> onnx.ValueInfoProto:
    """An output declared with the type of graph input ``like``: a gradient or an updated
    buffer has its parameter's dtype and shape, whether or not shape inference can tell."""
    value = onnx.ValueInfoProto(name=name)
    value.type.CopyFrom(next(i.type for i in proto.graph.input if i.name == like))
    return value


def _inferred(proto: onnx.ModelProto) -> onnx.ModelProto:
    inferred = onnx.shape_inference.infer_shapes(proto, check_type=True, strict_mode=False, data_prop=True)
    proto.CopyFrom(inferred)
    return proto


def _complete_output_types(proto: onnx.ModelProto) -> None:
    """Give outputs declared without a shape (gradients, buffer updates) their inferred type."""
    inferred = onnx.shape_inference.infer_shapes(proto, data_prop=True).graph
    types = {v.name: v.type for v in (*inferred.value_info, *inferred.output, *inferred.input)}
    for out in proto.graph.output:
        if not out.type.tensor_type.HasField("shape") and out.name in types:
            out.type.CopyFrom(types[out.name])


def finish(proto: onnx.ModelProto, what: str) -> onnx.ModelProto:
    proto.ir_version = TARGET_IR_VERSION
    used = {n for node in proto.graph.node for n in node_reads(node)} | {o.name for o in proto.graph.output}  # Loop bodies' too
    unused = [t for t in proto.graph.initializer if t.name not in used]
    for t in unused:
        proto.graph.initializer.remove(t)
    _complete_output_types(proto)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        raise ArtifactError(f"{what}: the generated model fails onnx.checker (a bug in odt_ops): {exc}") from None
    return proto


# BatchNormalization inputs 3 and 4 are running statistics: buffers, not parameters
_BUFFER_INPUTS = {"BatchNormalization": (3, 4)}


def classify_parameters(model: Model, requires_grad: Sequence[str] | None, frozen_params: Sequence[str] | None) -> ParameterSplit:
    """Resolve names and glob patterns to trainable, frozen and buffer initializers.

    As in onnxruntime: initializers named in neither list stay graph constants.
    """
    arrays = model.initializer_arrays()
    names = list(arrays)
    buffers = sorted({node.input[i] for node in model.graph.node for i in _BUFFER_INPUTS.get(node.op_type, ())
                      if i < len(node.input) and node.input[i] in arrays})

    def resolve(patterns: Sequence[str] | None, what: str) -> list[str]:
        chosen: list[str] = []
        unknown = []
        for pattern in patterns or []:
            hits = [n for n in names if n == pattern or fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                unknown.append(pattern)
            chosen.extend(h for h in hits if h not in chosen)
        if unknown:
            raise ArtifactError(f"{model.source}: {what}: {unknown} match no initializer of the model; its initializers are "
                                f"{_preview(names)}")
        return chosen

    trainable = resolve(requires_grad, "requires_grad")
    frozen = resolve(frozen_params, "frozen_params")
    both = sorted(set(trainable) & set(frozen))
    if both:
        raise ArtifactError(f"{both} are both in requires_grad and frozen_params; a parameter is one or the other")
    as_buffer = sorted(set(trainable) & set(buffers))
    if as_buffer:
        raise ArtifactError(f"{as_buffer} are BatchNormalization running statistics (buffers); they are updated, not trained")
    not_float = [n for n in trainable if arrays[n].dtype.kind != "f"]
    if not_float:
        raise ArtifactError(f"requires_grad: {not_float} are not floating point; only float tensors can be trained")
    frozen = [n for n in frozen if n not in buffers]
    return ParameterSplit(trainable, frozen, buffers)


def _preview(names: Sequence[str], n: int = 12) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def default_trainable(model: Model) -> list[str]:
    """Every float initializer that is not a running statistic: "train the whole model"."""
    arrays = model.initializer_arrays()
    buffers = set(classify_parameters(model, None, None).buffers)
    return [n for n, a in arrays.items() if a.dtype.kind == "f" and n not in buffers]
