"""Leaving training: inference models, and model differences for federated learning.

A model difference is a tensor file (see ``tensorfile``) holding, per trainable
parameter, trained minus base, plus a hash that identifies the base it applies to and
the number of training examples and steps behind it, so a server can weight it.
"""
from __future__ import annotations

import hashlib
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from odt_ops import meta
from odt_ops.checkpoint import Checkpoint, load_checkpoint
from odt_ops.errors import ArtifactError, ModelDiffError
from odt_ops.ir.load import read_model, save_model
from odt_ops.ir.model import TARGET_IR_VERSION
from odt_ops.ir.modes import set_inference_mode
from odt_ops.ir.passes import prune_unused
from odt_ops.scalars import as_real, finite_at_least_zero
from odt_ops.tensorfile import read_tensor_file, write_tensor_file

DIFF_FORMAT = "odt-model-diff"
DIFF_VERSION = 1
# The largest example (or step) count a model difference may carry: 2**53, the last integer
# from which every smaller one is exact in float64, where ``aggregate`` (and Flower's FedAvg)
# turn counts into weights. A count above it is no honest device's (9.0e15 examples) and is
# refused, so a forged one can neither raise inside the weighting (10**400 does not convert to
# a float) nor push the weights' sum to infinity (two counts of 10**308), which zeroes every
# weight and makes the average all zeros in silence.
MAX_COUNT = 2**53


# ---- inference export ----------------------------------------------------------------------
def export_inference_model(eval_model, checkpoint: Checkpoint, path: str | os.PathLike, graph_output_names: Sequence[str] | None = None) -> onnx.ModelProto:
    """The eval graph pruned to ``graph_output_names`` (default: the original model's outputs),
    with loss and labels removed and parameters and buffers baked in as initializers."""
    source = read_model(eval_model)
    proto = onnx.ModelProto()
    proto.CopyFrom(source.proto)
    info = meta.read(proto, source.source)
    wanted = list(graph_output_names or info.inference_outputs)
    graph = proto.graph
    set_inference_mode(graph)  # also for eval models written before the eval graph was put in inference mode
    types = {v.name: v for v in (*graph.value_info, *graph.output, *graph.input)}
    missing = [n for n in wanted if n not in types and not any(n in node.output for node in graph.node)]
    if missing:
        raise ArtifactError(f"{source.source}: {missing} are not values of the eval model; the original outputs are "
                            f"{info.inference_outputs}")
    weights = {**checkpoint.parameters, **checkpoint.buffers}
    absent = [n for n in (*info.parameters, *info.buffers) if n not in weights or n in checkpoint.missing]
    if absent:
        raise ArtifactError(f"the checkpoint has no values for {absent}; load the weights (copy_buffer_to_parameters) first")
    baked = set(info.parameters) | set(info.buffers)
    keep_inputs = [i for i in graph.input if i.name not in baked]
    del graph.input[:]
    graph.input.extend(keep_inputs)
    graph.initializer.extend(numpy_helper.from_array(np.asarray(weights[n]), n) for n in (*info.parameters, *info.buffers))
    del graph.output[:]
    graph.output.extend(types[n] if n in types else helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in wanted)
    del proto.metadata_props[:]
    from odt_ops.ir.model import Model

    model = Model(proto, source=str(path))
    prune_unused(model)
    used = {n for node in model.graph.node for n in node.input} | set(wanted)
    inputs = [i for i in model.graph.input if i.name in used]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    proto = onnx.shape_inference.infer_shapes(model.proto, check_type=True, strict_mode=True)
    proto.ir_version = TARGET_IR_VERSION
    onnx.checker.check_model(proto, full_check=True)
    save_model(proto, path)
    return proto


# ---- model differences ------------------------------------------------------------------------
def _fingerprint(params: Mapping[str, np.ndarray], names: Sequence[str]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes of the given parameters."""
    h = hashlib.sha256()
    for name in sorted(names):
        a = np.ascontiguousarray(params[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


@dataclass
class ModelDiff:
    deltas: dict[str, np.ndarray]
    base_hash: str
    num_examples: int = 0
    num_steps: int = 0
    metadata: dict[str, int | float | str] = field(default_factory=dict)


def _as_checkpoint(x) -> Checkpoint:
    if isinstance(x, Checkpoint):
        return x
    if hasattr(x, "checkpoint"):  # an api.CheckpointState
        return x.checkpoint
    return load_checkpoint(x)


def model_diff(base, trained, *, num_examples: int = 0, num_steps: int = 0, metadata: Mapping | None = None) -> ModelDiff:
    """trained - base for every trainable parameter (checkpoints, paths or CheckpointStates)."""
    b, t = _as_checkpoint(base), _as_checkpoint(trained)
    names = t.trainable_names()
    problems = [f"{n}: missing from the base" for n in names if n not in b.parameters]
    problems += [f"{n}: base {b.parameters[n].dtype}{list(b.parameters[n].shape)} vs trained {t.parameters[n].dtype}{list(t.parameters[n].shape)}"
                 for n in names if n in b.parameters and (b.parameters[n].shape != t.parameters[n].shape or b.parameters[n].dtype != t.parameters[n].dtype)]
    if problems:
        raise ModelDiffError("the trained checkpoint does not come from this base:\n  " + "\n  ".join(problems))
    examples = check_count(num_examples, "num_examples", "model_diff")
    steps = check_count(num_steps, "num_steps", "model_diff")
    deltas = {n: np.asarray(t.parameters[n]) - np.asarray(b.parameters[n]) for n in names}
    return ModelDiff(deltas, _fingerprint(b.parameters, names), examples, steps, dict(metadata or {}))


def check_count(value, key: str, where: str) -> int:
    """``value`` as an int if it is a whole number in [0, MAX_COUNT] (an example or step count
    of a model difference), else a ModelDiffError naming ``where`` and ``key``."""
    # numbers.Integral takes Python and numpy ints; bool is an int but never a count, a float never exact
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ModelDiffError(f"{where}: {key} is {value!r} ({type(value).__name__}); expected a whole number of "
                             f"{'examples' if 'example' in key else 'steps'} from 0 to 2**53")
    count = int(value)
    if not 0 <= count <= MAX_COUNT:
        shown = str(count) if abs(count) < 10**30 else f"{'-' if count < 0 else ''}about 10**{int(count.bit_length() * math.log10(2))}"
        raise ModelDiffError(f"{where}: {key} is {shown}, outside [0, 2**53]: refused; a count is a whole number from 0 "
                             "to 2**53 (exact in float64, where differences are weighted), and one outside is forged or damaged")
    return count


def save_diff(diff: ModelDiff, path: str | os.PathLike) -> None:
    _check_finite(diff.deltas, str(path))
    check_count(diff.num_examples, "num_examples", f"{path}: the model difference")  # load_diff would refuse the file
    check_count(diff.num_steps, "num_steps", f"{path}: the model difference")
    header = {"base_hash": diff.base_hash, "num_examples": diff.num_examples, "num_steps": diff.num_steps, "metadata": diff.metadata}
    write_tensor_file(path, DIFF_FORMAT, DIFF_VERSION, header, [({"name": n}, d) for n, d in diff.deltas.items()], ModelDiffError)


def load_diff(path: str | os.PathLike) -> ModelDiff:
    manifest, tensors = read_tensor_file(path, DIFF_FORMAT, DIFF_VERSION, ModelDiffError, "model difference")
    deltas = {entry["name"]: np.asarray(array) for entry, array in tensors}
    _check_finite(deltas, str(path))
    base_hash, num_examples, num_steps, metadata = diff_header(manifest, path)
    return ModelDiff(deltas, base_hash, num_examples, num_steps, metadata)


def diff_header(manifest: Mapping, path: str | os.PathLike) -> tuple[str, int, int, dict]:
    """(base_hash, num_examples, num_steps, metadata) of a model difference's manifest, each
    checked: a ModelDiffError naming the file and the key for one of the wrong kind, or a count
    that is not a whole number in [0, 2**53] (see MAX_COUNT)."""
    wrong = [k for k, kind in (("base_hash", str), ("metadata", dict)) if k in manifest and not isinstance(manifest[k], kind)]
    if wrong:
        raise ModelDiffError(f"{path}: the model difference's manifest has {wrong} of the wrong kind; the file is damaged")
    counts = [check_count(manifest.get(k, 0), k, f"{path}: the model difference's manifest") for k in ("num_examples", "num_steps")]
    return manifest.get("base_hash", ""), counts[0], counts[1], dict(manifest.get("metadata") or {})


def _check_finite(deltas: Mapping[str, np.ndarray], where: str) -> None:
    bad = [n for n, d in deltas.items() if not np.all(np.isfinite(d))]
    if bad:
        raise ModelDiffError(f"{where}: {bad} hold NaN or infinite values; refusing the difference")


def apply_diff(base, diff: ModelDiff | str | os.PathLike) -> Checkpoint:
    """A new checkpoint: base + diff. Refuses a diff made from another base, or with
    wrong names, shapes, dtypes or non-finite values, naming what is wrong."""
    b = _as_checkpoint(base)
    d = diff if isinstance(diff, ModelDiff) else load_diff(diff)
    where = "the model difference" if isinstance(diff, ModelDiff) else f"{diff}: the model difference"
    _check_finite(d.deltas, where)
    problems = [f"{n}: not a parameter of the base" for n in d.deltas if n not in b.parameters]
    for n, delta in d.deltas.items():
        if n in b.parameters and (b.parameters[n].shape != delta.shape or b.parameters[n].dtype != delta.dtype):
            problems.append(f"{n}: base has {b.parameters[n].dtype}{list(b.parameters[n].shape)}, the difference {delta.dtype}{list(delta.shape)}")
    if problems:
        raise ModelDiffError(f"{where} does not fit this base:\n  " + "\n  ".join(problems))
    if _fingerprint(b.parameters, list(d.deltas)) != d.base_hash:
        raise ModelDiffError(f"{where} was made from another base model (base hash mismatch); apply it to the checkpoint it was computed against")
    params = {n: (np.asarray(a) + d.deltas[n]).astype(a.dtype, copy=False) if n in d.deltas else np.array(a) for n, a in b.parameters.items()}
    return Checkpoint(parameters=params, requires_grad=dict(b.requires_grad), buffers={n: np.array(a) for n, a in b.buffers.items()},
                      properties=dict(b.properties))


def aggregate(diffs: Sequence[ModelDiff], weights: Sequence[float] | None = None) -> ModelDiff:
    """Weighted federated averaging; weights default to each diff's number of examples.

    Refused with a ModelDiffError naming the input at fault, never averaged into a wrong
    result: differences of other bases, parameters, shapes or dtypes; non-finite values;
    counts that are not whole numbers in [0, 2**53] (see MAX_COUNT) or that sum past it;
    explicit weights that are not finite numbers >= 0 with a positive sum. By default each
    difference weighs its example count, as FedAvg does, and all weigh the same when none has
    a count."""
    if not diffs:
        raise ModelDiffError("aggregate needs at least one model difference")
    hashes = {d.base_hash for d in diffs}
    if len(hashes) != 1:
        raise ModelDiffError(f"the differences come from {len(hashes)} different base models; aggregate differences of one base only")
    names = list(diffs[0].deltas)
    for i, d in enumerate(diffs[1:], 1):
        if list(d.deltas) != names or any(d.deltas[n].shape != diffs[0].deltas[n].shape or d.deltas[n].dtype != diffs[0].deltas[n].dtype
                                          for n in names):
            raise ModelDiffError(f"difference {i} has other parameters, shapes or dtypes than difference 0")
    for i, d in enumerate(diffs):
        _check_finite(d.deltas, f"aggregate: difference {i}")
    counts = [check_count(d.num_examples, "num_examples", f"aggregate: difference {i}") for i, d in enumerate(diffs)]
    steps = [check_count(d.num_steps, "num_steps", f"aggregate: difference {i}") for i, d in enumerate(diffs)]
    total = sum(counts)
    if total > MAX_COUNT:
        raise ModelDiffError(f"aggregate: the differences' num_examples {counts} sum to {total}, more than 2**53 (exact in float64); "
                             "a count that large is forged or damaged: leave those differences out")
    if weights is None:
        # FedAvg: each difference weighs its example count (one with none weighs nothing); when
        # no difference has a count (model_diff's default), they weigh the same
        w = np.asarray(counts if total else [1] * len(diffs), dtype=np.float64)  # exact: counts and sum are at most 2**53
    else:
        w = _checked_weights(weights, len(diffs))
    w = w / w.sum()
    deltas = {n: sum(wi * d.deltas[n].astype(np.float64) for wi, d in zip(w, diffs)).astype(diffs[0].deltas[n].dtype) for n in names}
    _check_finite(deltas, "aggregate: the average")  # a weighted mean of finite values is finite; checked all the same
    return ModelDiff(deltas, diffs[0].base_hash, total, max(steps))


def _checked_weights(weights: Sequence[float], n: int) -> np.ndarray:
    """Explicit aggregation weights as float64, scaled so the largest is 1 (their sum then lies in
    [1, n]: no overflow to infinity, no underflow to zero), or a ModelDiffError naming the weight."""
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence | np.ndarray) or len(weights) != n:
        raise ModelDiffError(f"aggregate: weights must be {n} numbers, one per difference, got {weights!r:.200}")
    values = []
    for i, x in enumerate(weights):
        v = as_real(x)
        if v is None or not finite_at_least_zero(v):
            raise ModelDiffError(f"aggregate: weights[{i}] is {x!r:.60}; each weight must be a finite number >= 0")
        values.append(v)
    w = np.asarray(values, dtype=np.float64)
    top = w.max()
    if not top > 0:
        raise ModelDiffError(f"aggregate: the weights {list(weights)} sum to 0; give at least one difference a positive weight")
    return w / top


__all__ = ["MAX_COUNT", "ModelDiff", "ModelDiffError", "aggregate", "apply_diff", "check_count", "export_inference_model", "load_diff",
           "model_diff", "save_diff"]
