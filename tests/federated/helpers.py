"""Small artifacts for the federated tests (a linear model with closed forms, an MLP on the digits)
and an in-process grid that delivers messages to ClientApps as SuperNodes do."""
from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from odt_ops import artifacts
from odt_ops.onnxblock import optim


def linear(n_in: int = 5, n_out: int = 3, seed: int = 0) -> onnx.ModelProto:
    """logits = x @ W.T + b."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array((rng.standard_normal((n_out, n_in)) * 0.3).astype(np.float32), "fc.weight")
    b = numpy_helper.from_array((rng.standard_normal(n_out) * 0.1).astype(np.float32), "fc.bias")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc")], "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", n_in])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", n_out])], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def mlp(sizes=(64, 32, 10), seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "input"
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        last = i == len(sizes) - 2
        inits += [numpy_helper.from_array((rng.standard_normal((fan_out, fan_in)) * np.sqrt(2 / fan_in)).astype(np.float32), f"fc{i}.weight"),
                  numpy_helper.from_array(np.zeros(fan_out, np.float32), f"fc{i}.bias")]
        out = "logits" if last else f"z{i}"
        nodes.append(helper.make_node("Gemm", [x, f"fc{i}.weight", f"fc{i}.bias"], [out], transB=1, name=f"fc{i}"))
        if not last:
            nodes.append(helper.make_node("Relu", [out], [f"h{i}"], name=f"relu{i}"))
            out = f"h{i}"
        x = out
    nodes.insert(0, helper.make_node("Flatten", ["image"], ["input"], axis=1, name="flatten"))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", 1, 8, 8])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", sizes[-1]])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


def linear_artifacts(directory: Path, *, momentum: float = 0.0, seed: int = 0) -> Path:
    artifacts.generate_artifacts(linear(seed=seed), requires_grad=["fc.weight", "fc.bias"], loss=artifacts.LossType.MSELoss,
                                 optimizer=optim.SGD(momentum=momentum), artifact_directory=directory)
    return Path(directory)


def mlp_artifacts(directory: Path, *, optimizer=None, seed: int = 0, requires_grad=("fc0.weight", "fc0.bias", "fc1.weight", "fc1.bias")) -> Path:
    model = mlp(seed=seed)
    names = [t.name for t in model.graph.initializer]
    artifacts.generate_artifacts(model, requires_grad=list(requires_grad), frozen_params=[n for n in names if n not in requires_grad],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=optimizer or optim.SGD(),
                                 artifact_directory=directory, additional_output_names=["logits"])
    return Path(directory)


class NodeGrid:
    """Flower's Grid surface over ClientApps in this process, one persistent Context per node
    (SecAgg+ keeps its keys and shares there across its four stages); every reply is kept."""

    run = SimpleNamespace(run_id=1)

    def __init__(self, app, n: int):
        from flwr.app import Context, RecordDict
        from flwr.common.constant import SUPERLINK_NODE_ID
        from flwr.supercore.task_identity import TaskIdentity

        # what the SuperLink (or run_simulation) sets before a ServerApp creates messages
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
        self.app = app
        self.contexts = {1000 + 17 * i: Context(run_id=1, node_id=1000 + 17 * i, node_config={"partition-id": i}, state=RecordDict(),
                                                run_config={}) for i in range(n)}
        self.replies: list = []  # flwr.app.Message

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Error, Message

        out = []
        for msg in messages:
            try:  # each node gets its own copy, as over the wire (the workflow shares one content between messages)
                reply = self.app(copy.deepcopy(msg), self.contexts[msg.metadata.dst_node_id])
            except Exception as exc:
                reply = Message(Error(code=1, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            out.append(reply)
        self.replies += out
        return out
