"""Float64 gradient checks: gradient graphs from odt_ops.grad against central finite differences.

    model = make_model([helper.make_node("Relu", ["X"], ["Y"])], {"X": x})
    errors = check_gradients(model, {"X": x}, wrt=["X"])   # {param: max abs error}

The model's float outputs are reduced to a scalar loss with fixed random projections,
``loss = sum_i ReduceSum(Y_i * R_i)``, so every output element is weighted differently.
The gradient graph is appended by ``build_gradients``, checked to be standard ONNX
(``onnx.checker`` full check, ai.onnx ops only), executed with odt_ops' Plan (or
onnx.reference where a kernel is still missing), and compared with
(loss(p + eps) - loss(p - eps)) / 2 eps for every element of every parameter.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from odt_ops.domain import canonical
from odt_ops.grad import build_gradients
from odt_ops.ir.graph import all_nodes, node_reads, topological_order
from odt_ops.runtime.plan import Plan, missing_kernels

OPSET = 21
EXECUTORS: Counter = Counter()  # which engine ran the gradient graphs
# (domain, op type) of every node a passing check_gradients differentiated in this process;
# tests/fd_coverage.py compares the session's record with the gradient registry
CHECKED: set[tuple[str, str]] = set()
FLOAT_KINDS = "f"


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Mapping[str, np.ndarray],
    outputs: Sequence[str] | None = None,
    *,
    initializers: Mapping[str, np.ndarray] | None = None,
    symbolic: Collection[str] = (),
    opset: int = OPSET,
) -> onnx.ModelProto:
    """A model of ``nodes`` whose inputs are typed after the arrays; inputs named in
    ``symbolic`` get a symbolic first dimension "batch". Outputs default to the last
    node's outputs and are typed by shape inference."""
    ins = []
    for name, value in inputs.items():
        shape: list = list(value.shape)
        if name in symbolic and shape:
            shape[0] = "batch"
        ins.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), shape))
    outputs = list(outputs or [o for o in nodes[-1].output if o])
    inits = [numpy_helper.from_array(np.asarray(v), n) for n, v in (initializers or {}).items()]
    graph = helper.make_graph(list(nodes), "gradcheck", ins, [helper.make_empty_tensor_value_info(o) for o in outputs], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    return _typed_outputs(model)


def _typed_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Run shape inference and copy the inferred types onto the graph outputs."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    types = {v.name: v.type for v in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)}
    for out in inferred.graph.output:
        if out.name in types and types[out.name].tensor_type.elem_type:
            out.type.CopyFrom(types[out.name])
    vi = [v for v in inferred.graph.value_info if v.name not in {o.name for o in inferred.graph.output}]
    del inferred.graph.value_info[:]
    inferred.graph.value_info.extend(vi)
    return inferred


def compile_model(model: onnx.ModelProto, inputs: Sequence[str], outputs: Sequence[str], seed: int = 0) -> Callable[..., list]:
    """``f(feeds) -> outputs``; ``inputs`` may name initializers, which then become feeds.

    Runs odt_ops' Plan when every node has a kernel, else onnx.reference. Random ops draw
    from a generator reset to ``seed`` on every call, so repeated calls agree."""
    graph = model.graph
    opsets = {o.domain: o.version for o in model.opset_import}
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer if t.name not in inputs}
    if not missing_kernels(graph.node, opsets):
        rng = np.random.default_rng(seed)
        state = rng.bit_generator.state
        plan = Plan(graph, opsets, constants, list(inputs), list(outputs), rng=rng)

        def run(feeds: Mapping[str, np.ndarray]) -> list:
            rng.bit_generator.state = state
            return plan.run([feeds[n] for n in inputs])

        run.executor = "odt_ops"
        return run
    from onnx.reference import ReferenceEvaluator

    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    kept = [t for t in proto.graph.initializer if t.name not in inputs]
    moved = [t for t in proto.graph.initializer if t.name in inputs]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    proto.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in moved)
    evaluator = ReferenceEvaluator(proto)

    def run_reference(feeds: Mapping[str, np.ndarray]) -> list:
        return evaluator.run(list(outputs), {n: feeds[n] for n in inputs})

    run_reference.executor = "onnx.reference"
    return run_reference


def with_projection_loss(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], seed: int = 0, loss: str = "loss") -> onnx.ModelProto:
    """The model plus ``loss = sum_i ReduceSum(Y_i * R_i)`` over its float outputs, as its only output."""
    names = [o.name for o in model.graph.output]
    values = compile_model(model, list(feeds), names)(feeds)
    rng = np.random.default_rng(seed)
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    terms, nodes = [], []
    for name, value in zip(names, values):
        if value.dtype.kind not in FLOAT_KINDS:
            continue
        r = f"{name}/projection"
        proto.graph.initializer.append(numpy_helper.from_array(rng.standard_normal(value.shape).astype(value.dtype), r))
        terms.append(f"{name}/projected")
        nodes += [
            helper.make_node("Mul", [name, r], [f"{name}/weighted"], name=f"{name}/weighted"),
            helper.make_node("ReduceSum", [f"{name}/weighted"], [terms[-1]], name=f"{name}/projected", keepdims=0),
        ]
    nodes.append(helper.make_node("Sum", terms, [loss], name=loss))
    proto.graph.node.extend(nodes)
    del proto.graph.output[:]
    proto.graph.output.append(helper.make_empty_tensor_value_info(loss))
    return _typed_outputs(proto)


def training_model(loss_model: onnx.ModelProto, wrt: Sequence[str], loss: str = "loss") -> tuple[onnx.ModelProto, dict[str, str]]:
    """The loss model with its gradient graph appended; outputs the loss and one gradient per
    parameter. Asserts the result is standard ONNX that passes the full checker."""
    proto = onnx.ModelProto()
    proto.CopyFrom(loss_model)
    nodes, initializers, grads = build_gradients(proto, loss, wrt)
    proto.graph.node.extend(nodes)
    proto.graph.initializer.extend(initializers)
    types = {v.name: v.type for v in proto.graph.input}
    types.update({t.name: helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in proto.graph.initializer})
    for p in wrt:  # a gradient is typed like its parameter
        out = proto.graph.output.add()
        out.name = grads[p]
        out.type.CopyFrom(types[p])
    foreign = {f"{n.domain}::{n.op_type}" for n in proto.graph.node if n.domain not in ("", "ai.onnx")}
    assert not foreign, f"non-standard ops in the gradient graph: {sorted(foreign)}"
    assert all(imp.domain in ("", "ai.onnx") for imp in proto.opset_import), proto.opset_import
    onnx.checker.check_model(proto, full_check=True)
    return proto, grads


def numeric_gradients(f: Callable[..., list], feeds: Mapping[str, np.ndarray], wrt: Sequence[str], eps: float = 1e-6) -> dict[str, np.ndarray]:
    """Central finite differences of the scalar f(feeds)[0] for every element of ``wrt``."""
    feeds = {k: np.array(v, copy=True) for k, v in feeds.items()}
    result = {}
    for name in wrt:
        x = feeds[name]
        grad = np.zeros_like(x)
        flat, gflat = x.reshape(-1), grad.reshape(-1)
        for i in range(flat.size):
            orig = flat[i]
            h = eps * max(1.0, abs(orig))
            flat[i] = orig + h
            up = float(f(feeds)[0])
            flat[i] = orig - h
            down = float(f(feeds)[0])
            flat[i] = orig
            gflat[i] = (up - down) / (2 * h)
        result[name] = grad
    return result


def check_gradients(
    model: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray],
    wrt: Sequence[str],
    *,
    params: Mapping[str, np.ndarray] | None = None,
    seed: int = 0,
    eps: float = 1e-6,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> dict[str, float]:
    """Analytic gradients of the projected loss equal finite differences; returns the
    largest absolute error per parameter. ``params`` gives the values of parameters that
    are initializers of ``model`` (they are perturbed like inputs)."""
    loss_model = with_projection_loss(model, feeds, seed)
    full, grads = training_model(loss_model, wrt)
    init_values = {t.name: numpy_helper.to_array(t) for t in loss_model.graph.initializer}
    values = dict(feeds)
    values.update({p: init_values[p] for p in wrt if p not in values})
    values.update(params or {})
    inputs = list(dict.fromkeys([*feeds, *wrt]))
    run = compile_model(full, inputs, ["loss", *[grads[p] for p in wrt]], seed)
    EXECUTORS[run.executor] += 1
    analytic = run(values)
    forward = compile_model(loss_model, inputs, ["loss"], seed)
    numeric = numeric_gradients(forward, {n: values[n] for n in inputs}, wrt, eps)
    errors = {}
    for p, got in zip(wrt, analytic[1:]):
        want = numeric[p]
        assert got.shape == want.shape, f"{p}: gradient {got.dtype}{got.shape} for a {want.dtype}{want.shape} parameter"
        assert got.dtype == want.dtype, f"{p}: gradient {got.dtype}{got.shape} for a {want.dtype}{want.shape} parameter"
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"gradient of {p}")
        errors[p] = float(np.max(np.abs(got - want))) if got.size else 0.0
    CHECKED.update(differentiated_ops(model, wrt))
    return errors


def differentiated_ops(model: onnx.ModelProto, wrt: Collection[str]) -> set[tuple[str, str]]:
    """(domain, op type) of the nodes that read a value depending on ``wrt``: the nodes whose
    gradient rules the check ran (with every node of their subgraphs, e.g. a Loop's body)."""
    graph = model.graph
    reached = set(wrt)
    ops = set()
    available = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    for node in topological_order(graph, available):
        if reached.intersection(node_reads(node)):
            reached.update(node.output)
            ops.update((canonical(n.domain), n.op_type) for n in all_nodes([node]))
    return ops


__all__ = ["check_gradients", "compile_model", "make_model", "numeric_gradients", "training_model", "with_projection_loss"]


def error_report(errors: dict, label: str):
    """A module-scoped autouse fixture printing the largest finite-difference error per key
    (family or op) after the module's tests, even under output capture."""
    import pytest

    @pytest.fixture(scope="module", autouse=True)
    def report_errors(request):
        yield
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if errors and capture is not None:
            with capture.global_and_fixture_disabled():
                print(f"\nlargest finite-difference error per {label}: " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(errors.items())))

    return report_errors
