"""Module: train and eval steps over the training artifacts, as in onnxruntime.training.api.

Parameters live in contiguous buffers (one per dtype) that the CheckpointState's
arrays are views into, so a step never copies parameters and the optimizer updates the
whole buffer in one pass (a weight that only enters Gemm as a transposed B is stored
transposed there, its gradient and optimizer states alike; get_contiguous_parameters
and checkpoints still see every parameter row-major). Gradients live in a buffer of
the same layout: a step after lazy_reset_grad() computes them straight into it, the
others add theirs until the next reset.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np
import onnx

from odt_ops import meta
from odt_ops.api.checkpoint_state import CheckpointState
from odt_ops.api.training_state import CompiledStep, FlatBuffers, TrainingState
from odt_ops.domain import is_default, opset_versions
from odt_ops.errors import ArtifactError, EmptyBatchError, InputError, ModelCheckError, TrainingDivergedError, UnsupportedOpError
from odt_ops.ir.load import check_artifact, read_model
from odt_ops.ir.model import Model, tensor_to_array
from odt_ops.ir.modes import set_inference_mode
from odt_ops.runtime.plan import Plan
from odt_ops.runtime.session import ValueSpec

_NO_EVAL_MODEL = "this Module has no eval model; pass eval_model_uri to Module(...)"


class ContiguousParameters(np.ndarray):
    """What get_contiguous_parameters returns: a numpy array that also answers ONNX Runtime's
    OrtValue calls (``.numpy()``, ``device_name()``), so code written for either works."""

    def numpy(self) -> np.ndarray:
        return self.view(np.ndarray)  # zero-copy

    def device_name(self) -> str:
        return "Cpu"


def _as_run_for_evaluation(model: Model) -> Model:
    """A copy of the eval model in inference mode, for onnx.checker: eval models of earlier
    releases kept BatchNormalization in training mode with one output, which the checker refuses
    and which evaluation and export run as inference anyway (odt_ops/export.py does the same)."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    set_inference_mode(proto.graph)
    return Model(proto, source=model.source, base_dir=model.base_dir)


def _transposed_weights(graph: onnx.GraphProto, names: Sequence[str]) -> frozenset[str]:
    """The names every reader of which is a Gemm taking it as B with transB=1."""
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for i, name in enumerate(node.input):
            readers.setdefault(name, []).append((node, i))

    def transposed_b(node: onnx.NodeProto, i: int) -> bool:
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return node.op_type == "Gemm" and is_default(node.domain) and i == 1 and trans_b == 1

    return frozenset(n for n in names if readers.get(n) and all(transposed_b(node, i) for node, i in readers[n]))


def _check_roles(info: meta.ArtifactInfo, graph: onnx.GraphProto, source: str, training: bool) -> None:
    """The metadata names the graph's inputs and outputs exactly (a damaged or hand-edited file
    fails here, by name, rather than deep in the plan)."""
    inputs = {i.name for i in graph.input}
    roles = [*info.user_inputs, *info.labels, *info.parameters, *info.buffers, *info.unfed_inputs]
    produced = inputs | {o for node in graph.node for o in node.output} | {t.name for t in graph.initializer}
    outputs = [info.loss, *info.extra_outputs]
    if training:
        outputs += [*info.gradients.values(), *info.buffer_updates.values()]
    problems = []
    if set(roles) != inputs or len(roles) != len(set(roles)):
        problems.append(f"its roles name the inputs {sorted(roles)} but the graph's inputs are {sorted(inputs)}")
    absent = [o for o in outputs if o not in produced]
    if absent:
        problems.append(f"{absent} are named as outputs but the graph computes no such values")
    unknown = [p for p in info.gradients if p not in info.trainable]
    if unknown:
        problems.append(f"gradients are listed for {unknown}, which are not trainable")
    if problems:
        raise ArtifactError(f"{source}: the {meta.ARTIFACT_KEY!r} metadata does not fit the graph: " + "; ".join(problems))


def _without_readers_of(graph: onnx.GraphProto, names: set[str]) -> onnx.GraphProto:
    """A copy of ``graph`` without the nodes that depend on ``names``."""
    pruned = onnx.GraphProto()
    pruned.CopyFrom(graph)
    tainted = set(names)
    kept = []
    for node in pruned.node:  # artifacts are topologically sorted
        if tainted.intersection(node.input):
            tainted.update(node.output)
        else:
            kept.append(node)
    del pruned.node[:]
    pruned.node.extend(kept)
    return pruned


def _as_array(x) -> np.ndarray:
    """A numpy array, or an ONNX Runtime OrtValue (anything with ``.numpy()``) read as one."""
    return x if isinstance(x, np.ndarray) else x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def _fixed_spec(spec: ValueSpec, source: str) -> tuple[tuple[int, ...], np.dtype]:
    """A parameter's or buffer's shape and dtype, which the training graph must fix: the
    checkpoint holds one array of that shape for it."""
    shape, dtype = spec.shape, spec.dtype
    if shape is None or dtype is None or not all(isinstance(d, int) for d in shape):
        what = "no element type" if dtype is None else "no shape" if shape is None else f"the shape {list(shape)}"
        raise ArtifactError(f"{source}: the parameter or buffer input {spec.name!r} has {what}; a parameter's element "
                            "type and every dimension must be fixed in the training graph (generate the artifacts again)")
    return tuple(d for d in shape if isinstance(d, int)), dtype


def _check_loss(loss: np.ndarray) -> None:
    # math.isfinite on a 0-d loss costs a thirtieth of np.all(np.isfinite(...))
    if not (math.isfinite(loss) if loss.ndim == 0 else np.all(np.isfinite(loss))):
        raise TrainingDivergedError(
            f"the loss is {loss}; parameters and gradients were left as they were. Lower the learning rate, "
            "check the data for NaN or infinite values, or enable gradient clipping"
        )


class Module:
    """``Module(training_model, state, eval_model)``: ``module(*inputs)`` runs a train step
    (forward + backward, gradients accumulated) in train mode, an eval step in eval mode."""

    def __init__(self, train_model_uri, state: CheckpointState, eval_model_uri=None, device: str = "cpu",
                 session_options=None, *, seed: int = 0):
        if str(device).lower().split(":")[0] != "cpu":
            raise InputError(f"Module(device={device!r}): odt_ops runs on the CPU only; pass device='cpu'")
        # session_options (an onnxruntime.SessionOptions) is accepted so ported code runs; its
        # thread and provider settings have no meaning for the numpy engine
        self.session_options = session_options
        self._state = state
        # what this Module shares with the state, the Optimizer and the schedulers
        self.training_state: TrainingState = state.training_state
        # one generator for every random draw (Dropout masks), so a seed makes a run repeatable
        self._rng = np.random.default_rng(seed)
        train = read_model(train_model_uri)
        check_artifact(train)  # a damaged artifact fails here, naming its file, not in a kernel
        self._info = meta.read(train.proto, train.source)
        _check_roles(self._info, train.proto.graph, train.source, True)  # before _bind looks the roles up
        self._bind(train.proto.graph, train.source)
        # the compiled train and eval steps (read by diagnostics such as odt_ops.benchmark.profile)
        self.compiled_train: CompiledStep = self._compile(train.proto, self._info, training=True, source=train.source,
                                            base_dir=train.base_dir)
        self.compiled_eval: CompiledStep | None = None
        self._eval_proto = None
        if eval_model_uri is not None:
            ev = read_model(eval_model_uri)
            check_artifact(_as_run_for_evaluation(ev))
            self._eval_proto = ev.proto
            self._eval_source = ev.source  # named by the export's errors
            self._eval_info = meta.read(ev.proto, ev.source)
            self.compiled_eval = self._compile(ev.proto, self._eval_info, training=False, source=ev.source,
                                               base_dir=ev.base_dir)
        self.training = True
        self._reset_grad = True

    # ---- construction -------------------------------------------------------------------
    def _compile(self, proto: onnx.ModelProto, info: meta.ArtifactInfo, *, training: bool, source: str,
                 base_dir: str | None = None) -> CompiledStep:
        graph = proto.graph
        _check_roles(info, graph, source, training)
        specs = {v.name: ValueSpec.of(v, source) for v in graph.input}
        data_inputs = [*info.user_inputs, *info.labels]
        outputs = [info.loss, *info.extra_outputs]
        destinations, checks = [], {}
        if training:
            # gradients are computed into the gradient buffer when a step resets it, and a
            # diverged loss stops the step before any gradient is written
            grads = [info.gradients[p] for p in info.trainable if p in info.gradients]
            outputs += grads + list(info.buffer_updates.values())
            destinations, checks = grads, {info.loss: _check_loss}
        if info.unfed_inputs:
            graph = _without_readers_of(graph, set(info.unfed_inputs))
        opsets = opset_versions(proto.opset_import)
        # ours, not onnx's to_array: it reads external data relative to the working directory
        constants = {t.name: tensor_to_array(t, base_dir, source) for t in graph.initializer}
        try:
            plan = Plan(graph, opsets, constants, [*data_inputs, *info.parameters, *info.buffers], outputs, rng=self._rng,
                        destinations=destinations, checks=checks, source=source)
        except ModelCheckError as exc:  # the artifact's graph itself is broken: say which file
            raise ModelCheckError(f"{source}: {exc}") from None
        except UnsupportedOpError as exc:
            raise UnsupportedOpError(exc.missing, exc.what, source) from None
        return CompiledStep(plan, tuple(specs[n] for n in data_inputs), 1 + len(info.extra_outputs))

    def _bind(self, graph: onnx.GraphProto, source: str) -> None:
        specs = {v.name: ValueSpec.of(v, source) for v in graph.input}
        info = self._info
        expected = {n: _fixed_spec(specs[n], source) for n in (*info.parameters, *info.buffers)}
        # a weight that only ever enters Gemm as a transposed B is stored transposed, so BLAS reads
        # B^T as a plain row-major matrix (what onnxruntime gets by prepacking constant weights;
        # a 784x256 layer at batch 64: 0.30 -> 0.27 ms). Its gradient and optimizer states share
        # the layout, so the optimizer's elementwise update over the flat buffers is unchanged.
        transposed = _transposed_weights(graph, info.parameters)
        ts = self.training_state
        ts.bind(info, expected, transposed, self._rng, source)
        # this Module's own references (a later Module binding the same state does not move them)
        self.params, self.frozen, self.grads, self.buffers = ts.params, ts.frozen, ts.grads, ts.buffers
        self._ckpt = ckpt = ts.checkpoint
        self._param_feeds = [ckpt.parameters[n] for n in info.parameters] + [self.buffers[n] for n in info.buffers]
        self._grad_views = [self.grads.views[p] for p in info.trainable if p in info.gradients]
        self._pending: tuple[FlatBuffers, list] | None = None  # an accumulating step's gradients, made on first use
        self._buffer_targets = [self.buffers[b] for b in info.buffer_updates]

    def require_loaded(self) -> None:
        """Raise unless every parameter holds values (a nominal checkpoint's must be copied in)."""
        self.training_state.require_loaded()

    # ---- onnxruntime's Module surface ------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        self.training = mode
        return self

    def eval(self) -> Module:
        if self.compiled_eval is None:
            raise InputError(_NO_EVAL_MODEL)
        self.training = False
        return self

    def _step(self) -> CompiledStep:
        """The compiled step of the current mode (``train(False)`` without an eval model has none)."""
        step = self.compiled_train if self.training else self.compiled_eval
        if step is None:
            raise InputError(_NO_EVAL_MODEL)
        return step

    def __call__(self, *user_inputs):
        if self._ckpt.missing:
            self.require_loaded()
        step = self._step()
        specs = step.inputs
        if len(user_inputs) != len(specs):
            raise InputError(f"expected {len(specs)} inputs ({[s.name for s in specs]}), got {len(user_inputs)}")
        feeds = [spec.check(_as_array(x)) for spec, x in zip(specs, user_inputs)]
        batched = [(spec.name, x) for spec, x in zip(specs, feeds) if x.ndim]
        # a mean over no examples is 0/0: NaN, which would read as divergence. Every input empty
        # along its first axis is an empty batch; one empty input may be an empty sequence
        if batched and all(x.shape[0] == 0 for _, x in batched):
            raise EmptyBatchError(f"input {batched[0][0]!r} holds a batch of 0 examples ({[list(x.shape) for x in feeds]}); "
                                  "skip empty batches (e.g. drop_last or a check on len(batch)). Nothing was updated")
        n = step.n_outputs
        if self.training:
            # a reset step computes the gradients into their buffer; an accumulating one into a
            # second buffer of the same layout, added to the first in one pass per dtype
            if self._reset_grad:
                outs = step.plan.run(feeds + self._param_feeds, into=self._grad_views)
                self._reset_grad = False
            else:
                if self._pending is None:
                    pending = self.grads.like()
                    self._pending = pending, [pending.views[p] for p in self._info.trainable if p in self._info.gradients]
                pending, views = self._pending
                outs = step.plan.run(feeds + self._param_feeds, into=views)
                for dtype, buffer in self.grads.buffers.items():
                    buffer += pending.buffers[dtype]
            for target, new in zip(self._buffer_targets, outs[n + len(self._grad_views) :]):
                np.copyto(target, new)
        else:
            outs = step.plan.run(feeds + self._param_feeds)
        user = [np.asarray(o) for o in outs[:n]]  # 0-d results come back from numpy as scalars
        wrap = next((type(x).ortvalue_from_numpy for x in user_inputs if hasattr(type(x), "ortvalue_from_numpy")), None)
        if wrap is not None:  # given onnxruntime OrtValues, answer in kind as ONNX Runtime does
            user = [wrap(u) for u in user]
        return user[0] if n == 1 else user

    def lazy_reset_grad(self) -> None:
        """The next train step overwrites the gradients instead of adding to them."""
        self._reset_grad = True

    def input_names(self) -> list[str]:
        return [s.name for s in self._step().inputs]

    def output_names(self) -> list[str]:
        info = self._info if self.training else self._eval_info
        return [info.loss, *info.extra_outputs]

    def get_parameters_size(self, trainable_only: bool = True) -> int:
        return self.params.size + (0 if trainable_only else self.frozen.size)

    def get_contiguous_parameters(self, trainable_only: bool = False) -> ContiguousParameters:
        """All parameters flattened (trainable first, then frozen), as a copy: a snapshot that
        later steps leave alone, as ONNX Runtime's is."""
        self.require_loaded()
        parts = [self.params.flat()] + ([] if trainable_only else [self.frozen.flat()])
        flat = np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
        return flat.view(ContiguousParameters)

    def copy_buffer_to_parameters(self, buffer, trainable_only: bool = True) -> None:
        """Fill parameters from a flat buffer laid out as get_contiguous_parameters returns it
        (a numpy array, or anything with ONNX Runtime's ``.numpy()``)."""
        buffer = _as_array(buffer).ravel()
        expected = self.get_parameters_size(trainable_only)
        if buffer.size != expected:
            raise InputError(f"buffer has {buffer.size} values, the {'trainable ' if trainable_only else ''}parameters need {expected}")
        offset = 0
        for flat in (self.params,) if trainable_only else (self.params, self.frozen):
            for name in flat.names:
                view = flat.views[name]
                np.copyto(view, buffer[offset : offset + view.size].reshape(view.shape), casting="same_kind")
                offset += view.size
                self._ckpt.fill(name)

    def export_model_for_inferencing(self, inference_model_uri: str | os.PathLike, graph_output_names: Sequence[str] | None = None) -> None:
        """An inference-only model: the eval graph without loss and labels, weights baked in."""
        from odt_ops.export import export_inference_model

        if self._eval_proto is None:  # set with compiled_eval
            raise InputError("exporting needs the eval model; pass eval_model_uri to Module(...)")
        self.require_loaded()
        export_inference_model(Model(self._eval_proto, source=self._eval_source), self._state.checkpoint, inference_model_uri,
                               graph_output_names)
