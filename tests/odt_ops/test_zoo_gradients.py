"""One training step of each of the onnx wheel's nine zoo networks, every float weight
trainable (BatchNormalization running statistics are buffers): odt_ops' Module and
onnxruntime, executing the same training_model.onnx, agree on the loss (rtol 1e-4),
every updated buffer and every gradient (max abs error <= 1e-3 of the largest magnitude
of onnxruntime's gradient).

Weights are randomized (the shipped ones are one constant each); the loss is a mean
squared error on the logits; Dropout ratios are 0 so both runtimes compute the same
function. Batch 1 at 224x224: about 100 s on two cores in all, hence ``slow``.

Float32 rounding can tip a discrete decision: a ReLU input within rounding of zero, or
two nearly equal values in a MaxPool window, go one way in one runtime and the other
way in the other, and a gradient moves by a few percent; against float64, either
runtime can be the one that is off. When the end-to-end comparison misses 1e-3, the
test finds out whether such a flip explains it: it runs onnxruntime on the gradient
half of the graph fed odt_ops' own forward values (so both take the same decisions)
and requires that to agree to 1e-3, the Module to agree with odt_ops' plain engine to
1e-3, and at least one decision to differ between the two end-to-end runs. Then the miss is an expected failure (xfail, with
the numbers); otherwise it fails.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import odt_ops
from odt_ops import artifacts, meta
from odt_ops.api import CheckpointState, Module
from odt_ops.checkpoint import load_checkpoint
from odt_ops.runtime.plan import Plan
from tests.odt_ops.engines import run_ort
from tests.odt_ops.zoo import ZOO_MODELS, randomize_weights, zoo_path

GRAD_TOL = 1e-3  # max abs error relative to the largest magnitude of onnxruntime's gradient
# A gradient below this fraction of the model's largest is rounding noise in float32: a
# bias feeding a training-mode BatchNormalization is exactly 0 in exact arithmetic, and
# densenet121's first BatchNormalization/Mul/Add gradients (4e-5 of its largest) sum
# terms that cancel to 2e-2 of their size in both runtimes, against float64.
ROUNDING = 1e-4
# Given identical forward values, the gradient half still sums in a different order in each
# runtime; through densenet121's 121 BatchNormalizations its first-layer gradients (sums of
# terms that cancel to ~1e-2 of their size) differ by up to 4e-3 that way. A wrong rule
# is off by O(1), so this still catches one.
SAME_FORWARD_TOL = 1e-2
GRAD_PREFIX = "grad/"  # odt_ops.grad names the nodes it adds
# inputs that are not weights: BatchNormalization's running statistics (buffers), Dropout's ratio
NOT_WEIGHTS = {"BatchNormalization": (3, 4), "Dropout": (1, 2)}


def _trainable(model: onnx.ModelProto) -> list[str]:
    skip = {n.input[i] for n in model.graph.node for i in NOT_WEIGHTS.get(n.op_type, ()) if i < len(n.input)}
    return [t.name for t in model.graph.initializer if numpy_helper.to_array(t).dtype.kind == "f" and t.name not in skip]


def _logits(model: onnx.ModelProto) -> list[str] | None:
    """The final Softmax's input: a loss on probabilities saturates (random weights give
    near one-hot outputs whose gradients are exactly zero in float32)."""
    softmax = [n for n in model.graph.node if n.op_type == "Softmax"]
    return [softmax[-1].input[0]] if softmax else None


def _without_dropout(model: onnx.ModelProto) -> onnx.ModelProto:
    """Dropout draws different masks in each runtime: ratio 0 makes it the identity in both.
    (Set before generation: the gradient graph bakes in a constant ratio's 1 / (1 - ratio).)"""
    ratios = {n.input[1] for n in model.graph.node if n.op_type == "Dropout" and len(n.input) > 1 and n.input[1]}
    for t in model.graph.initializer:
        if t.name in ratios:
            t.CopyFrom(numpy_helper.from_array(np.zeros((), numpy_helper.to_array(t).dtype), t.name))
    return model


def _shape(value: onnx.ValueInfoProto) -> list[int]:
    return [d.dim_value if d.HasField("dim_value") else 1 for d in value.type.tensor_type.shape.dim]  # batch 1


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape
    assert got.dtype == want.dtype
    return float(np.max(np.abs(got.astype(np.float64) - want))) / float(np.max(np.abs(want)))


def _worst(ratios: dict[str, float]) -> tuple[str, float]:
    where = max(ratios, key=ratios.get)
    return where, ratios[where]


def _typed(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype), np.shape(value))


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_training_step_matches_onnxruntime(name, tmp_path):
    forward = _without_dropout(randomize_weights(odt_ops.load_model(zoo_path(name)).proto, seed=sum(map(ord, name))))
    trainable = _trainable(forward)
    paths = artifacts.generate_artifacts(forward, requires_grad=trainable, loss=artifacts.LossType.MSELoss,
                                         loss_input_names=_logits(forward), artifact_directory=tmp_path)
    proto = onnx.load(paths["training_model"])
    info = meta.read(proto)
    assert info.trainable == trainable
    assert len(info.gradients) == len(trainable)

    rng = np.random.default_rng(0)
    inputs = {i.name: i for i in proto.graph.input}
    x = rng.standard_normal(_shape(inputs[info.user_inputs[0]])).astype(np.float32)
    target = rng.standard_normal(_shape(inputs[info.labels[0]])).astype(np.float32)
    ckpt = load_checkpoint(paths["checkpoint"])
    feeds = {info.user_inputs[0]: x, info.labels[0]: target, **ckpt.parameters, **ckpt.buffers}
    want = dict(zip([o.name for o in proto.graph.output], run_ort(proto, feeds)))

    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    loss = Module(paths["training_model"], state)(x, target)
    np.testing.assert_allclose(loss, want[info.loss], rtol=1e-4)
    for buf, updated in info.buffer_updates.items():
        error = _relative_error(state.checkpoint.buffers[buf], want[updated])
        assert error <= GRAD_TOL, f"{name}: updated {buf} differs by {error:.2e}"

    got = {p: state.parameters[p].grad for p in info.trainable}
    reference = {p: want[g] for p, g in info.gradients.items()}
    largest = max(float(np.max(np.abs(w))) for w in reference.values())
    # noise in both runtimes: check that odt_ops' value is as small as onnxruntime's
    noise = {p for p, w in reference.items() if float(np.max(np.abs(w))) <= ROUNDING * largest}
    for param in noise:
        assert float(np.max(np.abs(got[param]))) <= ROUNDING * largest, f"{name}: {param} should be zero"
    where, worst = _worst({p: _relative_error(got[p], reference[p]) for p in reference if p not in noise})
    print(f"{name}: worst gradient error {worst:.2e} of onnxruntime's largest magnitude ({where}); "
          f"{len(reference) - len(noise)} gradients compared, {len(noise)} zero within rounding")
    if worst <= GRAD_TOL:
        return
    message = f"{name}: the gradient of {where} differs from onnxruntime's by {worst:.2e} of its largest magnitude"
    del reference, want
    flips, backward, same_engine = _explain(proto, feeds, info, noise, got)
    print(f"{name}: {flips} decision(s) differ between the runtimes; given odt_ops' forward values onnxruntime's "
          f"gradients agree to {backward[1]:.2e} ({backward[0]}); odt_ops' engine and Module agree to {same_engine[1]:.2e}")
    assert backward[1] <= SAME_FORWARD_TOL, f"{message}, and still by {backward[1]:.2e} ({backward[0]}) given the same forward values"
    assert same_engine[1] <= SAME_FORWARD_TOL, f"{message}; the Module differs from odt_ops' own engine by {same_engine[1]:.2e}"
    assert flips, f"{message}, with every ReLU and MaxPool decision the same in both runtimes"
    pytest.xfail(f"{message}: {flips} ReLU/MaxPool decision(s) within float32 rounding went the other way; "
                 f"with odt_ops' forward values onnxruntime's gradients agree to {backward[1]:.2e}")


def _explain(proto: onnx.ModelProto, feeds: dict, info: meta.ArtifactInfo, noise: set[str], module_grads: dict):
    """(decisions that differ, worst gradient error of onnxruntime on the gradient half
    given odt_ops' forward values, worst error of the Module against odt_ops' plain engine)."""
    graph = proto.graph
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    names = [o for n in graph.node for o in n.output if o]
    values = dict(zip(names, Plan(graph, {"": 21}, constants, list(feeds), names).run(list(feeds.values()))))

    # the decisions: every bool or integer value (ReLU masks, MaxPool indices), end to end in onnxruntime
    decisions = [n for n in names if np.asarray(values[n]).dtype.kind in "biu"]
    full = onnx.ModelProto()
    full.CopyFrom(proto)
    full.graph.output.extend(_typed(n, values[n]) for n in decisions)
    ort_values = dict(zip([o.name for o in full.graph.output], run_ort(full, feeds)))
    flips = sum(int(np.sum(np.asarray(values[n]) != ort_values[n])) for n in decisions)
    del full, ort_values

    # the gradient half alone, fed odt_ops' forward values
    backward_nodes = [n for n in graph.node if n.name.startswith(GRAD_PREFIX)]
    produced = {o for n in backward_nodes for o in n.output}
    needed = dict.fromkeys(i for n in backward_nodes for i in n.input if i and i not in produced)
    fed = [i for i in needed if i not in constants]
    outputs = [info.gradients[p] for p in info.trainable if p not in noise]
    assert set(outputs) <= produced
    half = helper.make_model(
        helper.make_graph(backward_nodes, "backward", [_typed(i, values[i] if i in values else feeds[i]) for i in fed],
                          [_typed(o, values[o]) for o in outputs], [t for t in graph.initializer if t.name in needed]),
        opset_imports=proto.opset_import, ir_version=proto.ir_version)
    ort_grads = run_ort(half, {i: np.asarray(values[i] if i in values else feeds[i]) for i in fed})
    backward = _worst({o: _relative_error(np.asarray(values[o]), g) for o, g in zip(outputs, ort_grads)})
    # the Module may fuse and reuse buffers: its gradients must still be the engine's
    same_engine = _worst({p: _relative_error(module_grads[p], np.asarray(values[info.gradients[p]]))
                          for p in info.trainable if p not in noise})
    return flips, backward, same_engine
