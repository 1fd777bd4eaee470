"""ForwardBlock and TrainingBlock: blocks that turn the model they are built on into a whole
model, as onnxruntime.training.onnxblock's do, so users' custom-graph code runs unchanged.

A ForwardBlock's output becomes the model's only output. A TrainingBlock's output is the
loss: calling it builds our training and eval models (odt_ops.training_models) for the
parameters marked with ``requires_grad``. Its training model also keeps ONNX Runtime's
gradient-accumulation contract, in standard ops, so code that runs it directly keeps
working: inputs ``<param>_grad.accumulation.buffer`` and ``lazy_reset_grad`` (bool[1]),
outputs ``<param>_grad.accumulation.out`` = lazy_reset_grad ? grad : buffer + grad. Our
Module accumulates in its own buffers and leaves that part of the graph out.
"""
from __future__ import annotations

import onnx
from onnx import helper

from odt_ops.errors import ArtifactError
from odt_ops.onnxblock.base import Block, current_accessor, flush
from odt_ops.training_models import classify_parameters

LAZY_RESET = "lazy_reset_grad"


def _outputs_only(model: onnx.ModelProto, names: list[str]) -> None:
    """Make ``names`` the graph's outputs, typed by shape inference where it can tell."""
    inferred = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v for v in (*inferred.output, *inferred.value_info, *inferred.input)}
    del model.graph.output[:]
    for name in names:
        value = onnx.ValueInfoProto()
        value.CopyFrom(types[name]) if name in types else value.CopyFrom(helper.make_empty_tensor_value_info(name))
        model.graph.output.append(value)


def _names(output) -> list[str]:
    return [output] if isinstance(output, str) else list(output)


class ForwardBlock(Block):
    """Subclass and implement ``build``; calling the block inside ``onnxblock.base(model)``
    stacks it on the model, whose output becomes what ``build`` returned."""

    def __init__(self):
        self._model: onnx.ModelProto | None = None
        self.base: onnx.ModelProto | None = None

    def __call__(self, *args, **kwargs):
        self.base = flush()
        output = super().__call__(*args, **kwargs)
        model = flush()
        _outputs_only(model, _names(output))
        self._model = model
        return output

    def to_model_proto(self) -> onnx.ModelProto:
        if self._model is None:
            raise ArtifactError("Please build the forward models first before trying to retrieve it. Call the block "
                                "inside `with onnxblock.base(model):`")
        return self._model


class TrainingBlock(Block):
    """Subclass and implement ``build`` returning the loss (or ``(loss, *extra outputs)``, which the
    training and eval models put out after the loss and ``Module`` returns); mark what trains with
    ``requires_grad(name)``; calling the block inside ``onnxblock.base(model)`` builds the
    training and eval models (``to_model_proto()``) and records ``parameters()``."""

    def __init__(self):
        self._requires_grad: list[str] = []
        self._frozen: list[str] = []
        self._parameters: tuple[list[onnx.TensorProto], list[onnx.TensorProto]] | None = None
        self._models: tuple[onnx.ModelProto, onnx.ModelProto] | None = None
        self.base: onnx.ModelProto | None = None

    def requires_grad(self, argument_name: str, value: bool = True) -> None:
        """Train ``argument_name`` (a parameter, or a graph input whose gradient is wanted) or freeze it."""
        for names in (self._requires_grad, self._frozen):
            if argument_name in names:
                names.remove(argument_name)
        (self._requires_grad if value else self._frozen).append(argument_name)

    def parameters(self) -> tuple[list[onnx.TensorProto], list[onnx.TensorProto]]:
        """(trainable, frozen) initializers, known once the block has been built."""
        if self._parameters is None:
            raise ArtifactError("Please build the training model first before trying to retrieve the parameters. Call "
                                "the block inside `with onnxblock.base(model):`")
        return self._parameters

    def to_model_proto(self) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        """(training model, eval model)."""
        if self._models is None:
            raise ArtifactError("Please build the training and eval models first before trying to retrieve them. Call "
                                "the block inside `with onnxblock.base(model):`")
        return self._models

    def __call__(self, *args, **kwargs):
        from odt_ops.ir.load import load_model
        from odt_ops.training_models import training_graphs

        self.base = flush()
        user_inputs = [i.name for i in self.base.graph.input]
        output = super().__call__(*args, **kwargs)
        # as in ONNX Runtime: the loss first, then any values the user wants back (ORT's desktop
        # MNIST example returns (loss, output)); they become the training model's extra outputs
        names = _names(output)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ArtifactError(f"{type(self).__name__}.build must return the loss's name, or (loss, *extra outputs) "
                                f"as names, got {output!r}")
        loss, extra = names[0], names[1:]
        model = flush()
        _outputs_only(model, names)
        initializers = {t.name: t for t in model.graph.initializer}
        wanted_inputs = [n for n in self._requires_grad if n not in initializers]
        unknown = [n for n in wanted_inputs if n not in {i.name for i in model.graph.input}]
        if unknown:
            raise ArtifactError(f"requires_grad: {unknown} are neither initializers nor inputs of the model")
        normalized = load_model(model)
        split = classify_parameters(normalized, [n for n in self._requires_grad if n in initializers],
                                    [n for n in self._frozen if n in initializers])
        # the running statistics are parameters that do not train, as ONNX Runtime counts them
        frozen = split.frozen + split.buffers
        self._parameters = ([initializers[n] for n in split.trainable], [initializers[n] for n in frozen if n in initializers])
        train, evaluation = training_graphs(normalized.proto, split, loss, extra,
                                            [n for n in user_inputs if n not in initializers], extra or [loss],
                                            input_gradients=wanted_inputs)
        _add_ort_accumulation(train, [*split.trainable, *wanted_inputs])
        self._models = (train, evaluation)
        model.CopyFrom(train)
        current_accessor().eval_model = evaluation
        return output


def _add_ort_accumulation(train: onnx.ModelProto, trainable: list[str]) -> None:
    # ``trainable``: the parameters, and any graph input whose gradient was asked for
    """ONNX Runtime's gradient accumulation I/O, in standard ops, recorded in the metadata."""
    from odt_ops import meta

    info = meta.read(train)
    graph = train.graph
    types = {i.name: i.type for i in graph.input}
    graph.input.append(helper.make_tensor_value_info(LAZY_RESET, onnx.TensorProto.BOOL, [1]))
    gradients = {**info.gradients, **info.input_gradients}
    for param in trainable:
        grad = gradients[param]
        buffer, out = f"{param}_grad.accumulation.buffer", f"{param}_grad.accumulation.out"
        buffer_input = onnx.ValueInfoProto(name=buffer)
        buffer_input.type.CopyFrom(types[param])
        graph.input.append(buffer_input)
        summed = f"{param}_grad.accumulation.sum"
        graph.node.append(helper.make_node("Add", [buffer, grad], [summed], name=f"{param}/accumulate"))
        graph.node.append(helper.make_node("Where", [LAZY_RESET, grad, summed], [out], name=f"{param}/accumulate_or_reset"))
        accumulated = onnx.ValueInfoProto(name=out)
        accumulated.type.CopyFrom(types[param])
        graph.output.append(accumulated)
    info.unfed_inputs = [LAZY_RESET, *(f"{p}_grad.accumulation.buffer" for p in trainable)]
    meta.write(train, info)
    onnx.checker.check_model(train, full_check=True)
