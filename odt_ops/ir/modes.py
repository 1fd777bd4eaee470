"""Training and inference behaviour of the ops that have both: Dropout and BatchNormalization.

A model exported in training mode (what ONNX Runtime's documentation told its users to
do) carries BatchNormalization with ``training_mode=1`` and Dropout with a true
``training_mode`` input; one exported for inference carries the opposite. The artifacts
fix the mode per graph whatever the export said: the training model draws Dropout masks
and normalizes with batch statistics, the eval model and the inference export use the
running statistics and pass Dropout through, as ONNX Runtime's eval model does.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

TRAINING_FLAG = "odt/training_mode"  # the constant true fed to every Dropout of a training graph


def set_training_mode(graph: onnx.GraphProto) -> None:
    """Dropout draws masks and BatchNormalization uses batch statistics."""
    needs_flag = False
    for node in graph.node:
        if node.op_type == "Dropout":
            ins = list(node.input) + [""] * (3 - len(node.input))
            ins[2] = TRAINING_FLAG
            del node.input[:]
            node.input.extend(ins)
            needs_flag = True
        elif node.op_type == "BatchNormalization":
            _set_attribute(node, "training_mode", 1)
    if needs_flag and not any(t.name == TRAINING_FLAG for t in graph.initializer):
        graph.initializer.append(numpy_helper.from_array(np.array(True), TRAINING_FLAG))


def set_inference_mode(graph: onnx.GraphProto) -> None:
    """Dropout is the identity and BatchNormalization normalizes with its running statistics.

    BatchNormalization in inference mode has one output; a graph that reads the running
    statistics a training-mode node put out gets its unchanged inputs instead (that is
    what the update amounts to when nothing trains).
    """
    renamed: dict[str, str] = {}
    for node in graph.node:
        if node.op_type == "Dropout":
            if len(node.input) >= 3:
                node.input[2] = ""  # an absent training_mode is false; ORT's eval model reads the same
        elif node.op_type == "BatchNormalization":
            for a in node.attribute:  # absent means 0, and opsets below 14 have no such attribute
                if a.name == "training_mode":
                    a.i = 0
            for out, stat in zip(node.output[1:3], node.input[3:5]):
                if out:
                    renamed[out] = stat
            del node.output[1:]
    if not renamed:
        return
    stale = [v for v in graph.value_info if v.name in renamed]
    for v in stale:
        graph.value_info.remove(v)
    outputs = {o.name for o in graph.output}
    for node in graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
    for name in sorted(outputs & renamed.keys()):  # a graph output keeps its name
        graph.node.append(helper.make_node("Identity", [renamed[name]], [name], name=f"{name}/inference"))


def _set_attribute(node: onnx.NodeProto, name: str, value: int) -> None:
    for a in node.attribute:
        if a.name == name:
            a.i = value
            return
    node.attribute.append(helper.make_attribute(name, value))
